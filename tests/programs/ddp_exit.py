"""A DDP program that ends right after its last step, as a loop that breaks on its last batch does.

    MASTER_ADDR=... MASTER_PORT=... RANK=... WORLD_SIZE=... python ddp_exit.py

gloo's worker thread drops its last reference to a backward's all-reduce a moment after the work is done;
if the interpreter is finalizing by then, the process aborts: "terminate called without an active
exception", exit code -6 (pytorch/pytorch#190489). Here the interpreter finalizes at once.
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3):
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
