"""A plain PyTorch DDP training script, as in PyTorch's DDP tutorial: nothing fabtrain-specific.

    torchrun --nnodes=2 --nproc-per-node=8 ... train.py --epochs 3      # what fabtrain runs on each node

torchrun gives every process RANK, LOCAL_RANK and WORLD_SIZE; fabtrain gives
torchrun its --nnodes/--node-rank/--master-addr/--master-port. Two optional
touches make fabtrain's watchdog and dashboard better: a metrics record per
step in $FABTRAIN_METRICS (hang detection by progress, loss charts), and a
checkpoint in $FABTRAIN_CHECKPOINT_DIR to resume from.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--epochs", type=int, default=2)
    args.add_argument("--batch", type=int, default=32)
    args = args.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same synthetic data set on every rank; the sampler splits it
    x = torch.randn(2048, 16)
    data = TensorDataset(x, x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    model = DDP(torch.nn.Linear(16, 1).to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    metrics = open(os.environ["FABTRAIN_METRICS"], "a") if os.environ.get("FABTRAIN_METRICS") else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if metrics:
                metrics.write(json.dumps({"ts": time.time(), "rank": rank, "step": step, "epoch": epoch,
                                          "loss": loss.item()}) + "\n")
                metrics.flush()
        print(f"rank {rank}: epoch {epoch} loss {loss.item():.4f}", flush=True)

    # Every rank adds rank+1: the sum proves all WORLD_SIZE ranks took part in one group.
    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    print(f"rank {rank}: all_reduce sum {total.item():g} world {world}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
