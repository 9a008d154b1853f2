"""A PyTorch Lightning DDP script that knows nothing of fabtrain.

    torchrun --nproc-per-node=2 lightning_ddp.py MAX_STEPS

A LightningModule that logs `train_loss` each step, a DataLoader, Trainer(strategy="ddp") on the
CPU with the world torchrun gives it (its processes a node, its nodes); no checkpoints, no logger files.
"""
import os
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Squares(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = DataLoader(TensorDataset(x, (x ** 2).sum(1, keepdim=True)), batch_size=8)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 2))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=int(os.environ.get("WORLD_SIZE", 2)) // devices,
                         strategy="ddp", max_steps=int(sys.argv[1]), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Squares(), data)
    print(f"done at step {trainer.global_step}", flush=True)
