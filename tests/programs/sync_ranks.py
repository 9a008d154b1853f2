"""A synchronous data-parallel job on gloo (torchrun or plain processes) whose ranks write per-rank records
as the launcher's progress hook does: ``source: "auto"``, ``step``, ``rank``, ``local_rank`` and the means
of ``step_time``, ``data_time``, ``compute_time``, ``comm_time`` over the steps since the last record (the
first step at once, then at most every 0.5 s), all into one $FABTRAIN_METRICS.

    python sync_ranks.py [--steps N] [--spin RANK:STEP] [--slow-data RANK:SECONDS] [--cgroup RANK:DIR]

Each step: a batch from a DataLoader (its Dataset's __getitem__ sleeps --slow-data seconds on that
rank), forward and backward of a small linear model, then one all_reduce of the flattened gradients
(the collective every rank waits in for the last one), then the optimizer's step. --spin: that rank
writes its record of that step and spins in Python forever, while the others wait in their all_reduce.
--cgroup: that rank moves itself into a cgroup whose CPU quota the test set: it has less CPU than the
others.
"""
import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=100000)
ap.add_argument("--spin", default=None)
ap.add_argument("--slow-data", default=None)
ap.add_argument("--cgroup", default=None, help="RANK:DIR: that rank moves itself into the cgroup DIR (a CPU cap)")
ap.add_argument("--width", type=int, default=256)
args = ap.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", 0))
if args.cgroup and int(args.cgroup.split(":", 1)[0]) == rank:
    with open(os.path.join(args.cgroup.split(":", 1)[1], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
torch.set_num_threads(1)
torch.manual_seed(0)
spin_rank, spin_step = map(int, args.spin.split(":")) if args.spin else (None, None)
slow_rank, slow_s = (int(args.slow_data.split(":")[0]), float(args.slow_data.split(":")[1])) if args.slow_data \
    else (None, 0.0)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 9

    def __getitem__(self, i):
        if rank == slow_rank:
            time.sleep(slow_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(args.width, generator=g), torch.randn(1, generator=g)


def spin_forever():
    n = 0
    while True:
        n += 1


model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
loader = iter(torch.utils.data.DataLoader(Data(), batch_size=16, num_workers=0))
out = open(os.environ["FABTRAIN_METRICS"], "a", buffering=1) if os.environ.get("FABTRAIN_METRICS") else None
sums, count, last_write = [0.0] * 4, 0, 0.0
for step in range(1, args.steps + 1):
    t0 = time.perf_counter()
    x, y = next(loader)
    t1 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for _ in range(3):  # a few passes, so compute outweighs the bookkeeping
        torch.nn.functional.mse_loss(model(x), y).backward()
    t2 = time.perf_counter()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    for i, v in enumerate((t4 - t0, t1 - t0, t2 - t1, t3 - t2)):
        sums[i] += v
    count += 1
    spin = rank == spin_rank and step == spin_step
    if out and (step == 1 or spin or time.monotonic() - last_write >= 0.5):
        last_write = time.monotonic()
        out.write(json.dumps({"ts": time.time(), "step": step, "rank": rank, "local_rank": local_rank,
                              "source": "auto", "framework": "test", "loss": round(loss.item(), 6),
                              "step_time": sums[0] / count, "data_time": sums[1] / count,
                              "compute_time": sums[2] / count, "comm_time": sums[3] / count}) + "\n")
        sums, count = [0.0] * 4, 0
    if spin:
        print(f"rank {rank}: spinning at step {step}", flush=True)
        spin_forever()
if step % 50 == 0 or step == args.steps:
    print(f"rank {rank}/{world} done at step {step}", flush=True)
dist.barrier()
dist.destroy_process_group()
