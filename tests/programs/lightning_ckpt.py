"""A PyTorch Lightning script that checkpoints with ModelCheckpoint every N training steps; it knows nothing of
fabtrain.

    python lightning_ckpt.py OUT_DIR MAX_STEPS EVERY

A LightningModule that logs `train_loss`, one CPU device, ModelCheckpoint(dirpath=OUT_DIR,
every_n_train_steps=EVERY, save_top_k=-1): Lightning names each file `epoch=E-step=S.ckpt`.
"""
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Squares(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = DataLoader(TensorDataset(x, (x ** 2).sum(1, keepdim=True)), batch_size=8)
    checkpoints = ModelCheckpoint(dirpath=sys.argv[1], every_n_train_steps=int(sys.argv[3]), save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=int(sys.argv[2]), logger=False, callbacks=[checkpoints],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Squares(), data)
    print(f"done at step {trainer.global_step}", flush=True)
