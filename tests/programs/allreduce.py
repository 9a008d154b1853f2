"""A small collective job: every rank adds rank+1 with all_reduce (torch gloo), then trains for a while.

    python allreduce.py [--steps N] [--period S]     (MASTER_ADDR MASTER_PORT RANK WORLD_SIZE from the launcher)

Writes the all_reduce result and what it was given to
$FABTRAIN_WORKSPACE/allreduce-<RANK>.json (or ./ without fabtrain), and a
metrics record every step.
"""
import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--period", type=float, default=0.2)
args = ap.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
out = os.path.join(os.environ.get("FABTRAIN_WORKSPACE", "."), f"allreduce-{rank}.json")
with open(out, "w") as f:
    json.dump({"rank": rank, "world": world, "sum": total.item(), "master": os.environ["MASTER_ADDR"],
               "node": os.environ.get("SLURMD_NODENAME"), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
metrics = os.environ.get("FABTRAIN_METRICS")
for step in range(args.steps):
    x = torch.tensor([float(step)])
    dist.all_reduce(x)
    if metrics:
        with open(metrics, "a") as m:
            m.write(json.dumps({"ts": time.time(), "role": "trainer", "rank": rank, "step": step,
                                "loss": 1.0 / (step + 1)}) + "\n")
    print(f"rank {rank}/{world} step {step}", flush=True)
    time.sleep(args.period)
dist.barrier()
dist.destroy_process_group()
