"""Gradient accumulation under DDP's `no_sync()` or FSDP2's `set_requires_gradient_sync`, as their docs write it;
it knows nothing of fabtrain.

    torchrun --nproc-per-node=2 ddp_accum.py ddp|fsdp STEPS K

gloo on the CPU. Each rank reads its share of a regression set (DistributedSampler, a DataLoader of micro-batches
of 8); an optimizer step every K micro-batches: the K-1 before the last without gradient synchronisation (DDP:
inside `model.no_sync()`; FSDP: `model.set_requires_gradient_sync(False)`), each `loss = loss / K` then
`loss.backward()`. After each step a rank prints `rank R step S loss L`: its step's loss, the sum of its K
micro-losses as divided (the mean of its micro-batches' losses), as a script that keeps a running loss does.
"""
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    kind, steps, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8192, 16, generator=g)
    y = (x[:, :4] ** 2).sum(1, keepdim=True) + 0.3 * torch.randn(8192, 1, generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    step, step_loss, epoch = 0, 0.0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            sync = (i + 1) % accum == 0
            if kind == "ddp":
                ctx = contextlib.nullcontext() if sync else model.no_sync()
            else:
                model.set_requires_gradient_sync(sync)
                ctx = contextlib.nullcontext()
            with ctx:
                loss = F.mse_loss(model(xb), yb)
                loss = loss / accum
                loss.backward()
            step_loss += loss.item()
            if sync:
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                # one write a line: the ranks share torchrun's stdout
                sys.stdout.write(f"rank {rank} step {step} loss {step_loss:.6f}\n")
                sys.stdout.flush()
                step_loss = 0.0
                if step == steps:
                    break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
