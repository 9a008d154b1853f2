"""A PyTorch Lightning script with gradient accumulation, as Lightning's docs write one; it knows nothing of fabtrain.

    python lightning_accum.py OUT_DIR MAX_STEPS K

A LightningModule whose training_step logs `self.log("train_loss", loss, on_step=True)`; `Trainer(
accumulate_grad_batches=K, log_every_n_steps=1)` on the CPU, one device, with a CSVLogger (OUT_DIR/lightning_logs/
version_0/metrics.csv: what Lightning logs, with its step); no checkpoints. Prints `done at step N`.
"""
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset


class Squares(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":
    out, max_steps, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    x = torch.randn(4096, 8)
    y = (x[:, :3] ** 2).sum(1, keepdim=True) + 0.3 * torch.randn(4096, 1)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accum,
                         logger=CSVLogger(out), log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Squares(), data)
    print(f"done at step {trainer.global_step}", flush=True)
