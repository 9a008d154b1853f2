"""A synchronous data-parallel job on gloo (torchrun or plain processes) that knows nothing of fabtrain: what
fabtrain knows of its ranks comes from the launcher's progress hook alone (per-rank records of ``step`` and of
``data_time``, ``compute_time``, ``comm_time``; docs/progress.md).

    python sync_ranks.py [--steps N] [--ddp] [--spin RANK:STEP] [--slow-data RANK:SECONDS] [--cgroup RANK:DIR]

Each step: a batch from a DataLoader (its Dataset's __getitem__ sleeps --slow-data seconds on that
rank), forward and backward of a small linear model, then the gradients' all-reduce (the collective every
rank waits in for the last one), then the optimizer's step. The all-reduce is one ``dist.all_reduce`` of the
flattened gradients called here (as Horovod-style loops do), or, with --ddp, DistributedDataParallel's own
(its C++ reducer, at the end of ``backward()``). --spin: that rank spins in Python forever after that step,
while the others wait in their all-reduce. --cgroup: that rank moves itself into a cgroup whose CPU quota the
test set, once it is set up and before its first step: it has less CPU than the others for its steps.
"""
import argparse
import contextlib
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
ap.add_argument("--ddp", action="store_true", help="DistributedDataParallel's all-reduce instead of one of ours")
args = ap.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", 0))
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
if args.ddp:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.001)
loader = iter(torch.utils.data.DataLoader(Data(), batch_size=16, num_workers=0))
if args.cgroup and int(args.cgroup.split(":", 1)[0]) == rank:  # once set up (DDP's first use imports much): its steps
    with open(os.path.join(args.cgroup.split(":", 1)[1], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
for step in range(1, args.steps + 1):
    x, y = next(loader)
    opt.zero_grad()
    with model.no_sync() if args.ddp else contextlib.nullcontext():  # accumulated: DDP all-reduces once a step
        for _ in range(3):  # a few passes, so compute outweighs the bookkeeping
            torch.nn.functional.mse_loss(model(x), y).backward()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if not args.ddp:
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(flat)
    opt.step()
    if rank == spin_rank and step == spin_step:
        print(f"rank {rank}: spinning at step {step}", flush=True)
        spin_forever()
if step % 50 == 0 or step == args.steps:
    print(f"rank {rank}/{world} done at step {step}", flush=True)
dist.barrier()
dist.destroy_process_group()
