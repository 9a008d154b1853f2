"""A training script of the kind in PyTorch's DDP tutorial series; it knows nothing of fabtrain.

    torchrun --nnodes=N --nproc-per-node=K --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT ddp_tutorial.py STEPS [SLEEP]

A Trainer with _run_batch and _run_epoch over a DataLoader with a
DistributedSampler, gloo, SGD; it prints one line an epoch on rank 0.
SLEEP (seconds, default 0) is spent in each batch's loading (the dataset's
__getitem__), so a test can make the run last.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Squares(Dataset):
    def __init__(self, size: int, sleep: float):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=g)
        self.y = (self.x ** 2).sum(1, keepdim=True)
        self.sleep = sleep

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.sleep:
            time.sleep(self.sleep)
        return self.x[i], self.y[i]


class Trainer:
    def __init__(self, model, data: DataLoader, optimizer):
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.data, self.optimizer = data, optimizer

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch: int):
        self.data.sampler.set_epoch(epoch)
        for source, targets in self.data:
            loss = self._run_batch(source, targets)
        if self.rank == 0:
            print(f"epoch {epoch} | batches {len(self.data)} | loss {loss.item():.4f}", flush=True)

    def train(self, steps: int):
        epochs = -(-steps // len(self.data))
        for epoch in range(epochs):
            self._run_epoch(epoch)


def main(steps: int, sleep: float):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = Squares(256, sleep)
    loader = DataLoader(data, batch_size=8, shuffle=False, sampler=DistributedSampler(data))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.01)).train(steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
