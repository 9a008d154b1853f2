"""A plain torch DDP script, as users write them: everything from the environment.

    torchrun --nnodes=2 --nproc-per-node=1 ... ddp_min.py OUT_DIR
    (or started once per rank with MASTER_ADDR MASTER_PORT RANK WORLD_SIZE)

Trains a linear model for a few steps on rank-dependent data and writes the
final weights to OUT_DIR/rank-<RANK>.json: DDP keeps every rank's weights equal.
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + rank)
for step in range(20):
    x = torch.randn(8, 4, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"rank {rank}/{world} step {step} loss {loss.item():.4f}")
weights = [p.detach().flatten().tolist() for p in model.parameters()]
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
               "weights": weights, "loss": loss.item()}, f)
dist.barrier()  # every rank done with every collective before any tears gloo down
dist.destroy_process_group()
