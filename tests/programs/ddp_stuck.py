"""A DDP training script on gloo (CPU) as users write them, knowing nothing of fabtrain, in which one rank gets
stuck at a given step while the others wait for it.

    python ddp_stuck.py --stuck RANK:STEP:HOW [--fifo PATH] [--workers N]
    (under torchrun, or started once per rank with MASTER_ADDR MASTER_PORT RANK WORLD_SIZE)

Each step: a batch from a DataLoader, forward and backward of a small linear model wrapped in
DistributedDataParallel (its C++ reducer all-reduces the gradients at the end of ``backward()``), the optimizer's
step, then every rank's loss summed with ``dist.all_reduce`` for the log line, in a process group of its own (as
NCCL jobs keep a gloo group for numbers on the CPU). After its step STEP, rank RANK:

- spin: spins in its own Python code (``spin_forever``) before its next forward;
- data: waits for its next batch forever: its Dataset's ``__getitem__`` blocks (in a DataLoader worker with
  --workers N > 0, else in the rank itself);
- fifo: blocks opening --fifo PATH, a FIFO that nobody writes (state S, no CPU);
- skip: skips the loss's all_reduce that the others enter and goes on to its next step, where it waits in DDP's
  all-reduce for ranks that never come.

The others wait for it in DDP's gradient all-reduce inside ``loss.backward()``, or (skip) in the loss's all_reduce.
"""
import argparse
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=100000)
ap.add_argument("--stuck", default=None, help="RANK:STEP:HOW (spin, data, fifo, skip)")
ap.add_argument("--fifo", default=None)
ap.add_argument("--workers", type=int, default=0)
ap.add_argument("--width", type=int, default=16)
args = ap.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
stuck_rank, stuck_step, how = args.stuck.split(":") if args.stuck else (-1, -1, None)
stuck_rank, stuck_step = int(stuck_rank), int(stuck_step)
BATCH = 8


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 9

    def __getitem__(self, i):
        if rank == stuck_rank and how == "data" and i >= stuck_step * BATCH:
            threading.Event().wait()  # a sample that never comes (a dead mount, a stuck decoder)
        g = torch.Generator().manual_seed(i)
        return torch.randn(args.width, generator=g), torch.randn(1, generator=g)


def spin_forever():
    n = 0
    while True:
        n += 1


def read_fifo():
    with open(args.fifo) as f:  # nobody opens it for writing: blocks here, asleep
        return f.read()


log_group = dist.new_group(backend="gloo")
model = DDP(torch.nn.Linear(args.width, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = iter(torch.utils.data.DataLoader(Data(), batch_size=BATCH, num_workers=args.workers))
for step in range(1, args.steps + 1):
    x, y = next(loader)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    if not (rank == stuck_rank and step == stuck_step and how == "skip"):
        dist.all_reduce(total, group=log_group)
    if rank == stuck_rank and step == stuck_step:
        print(f"rank {rank}: stuck ({how}) after step {step}", flush=True)
        if how == "spin":
            spin_forever()
        elif how == "fifo":
            read_fifo()
    if step % 50 == 0:
        print(f"rank {rank}/{world} step {step} loss {total.item() / world:.4f}", flush=True)
dist.barrier()
dist.destroy_process_group()
