"""An `accelerate` loop with gradient accumulation, in the shape of accelerate's gradient-accumulation guide and its
`run_clm_no_trainer.py` example; it knows nothing of fabtrain.

    python accelerate_accum.py STEPS K

`Accelerator(gradient_accumulation_steps=K, cpu=True)`; every batch inside `with accelerator.accumulate(model):`
runs the forward, `accelerator.backward(loss)` (which divides the loss by K), `optimizer.step()`,
`lr_scheduler.step()` and `optimizer.zero_grad()` (accelerate's wrappers do the real step, and the scheduler's,
only on the K-th batch); `total_loss += loss.detach().float()` every batch, and once `accelerator.sync_gradients`
(an optimizer step was taken) it logs the step's loss, the mean of its K micro-batches' losses, with
`accelerator.log({"train_loss": ...}, step=completed_steps)` and prints `step S loss L` (no tracker is
configured: log is then a no-op for accelerate).
"""
import sys

import torch
from accelerate import Accelerator

steps, accum = int(sys.argv[1]), int(sys.argv[2])
accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps)
g = torch.Generator().manual_seed(1)
x = torch.randn(4096, 8, generator=g)
data = torch.utils.data.TensorDataset(x, (x[:, :3] ** 2).sum(1, keepdim=True) + 0.3 * torch.randn(4096, 1, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
completed_steps, total_loss = 0, 0.0
while completed_steps < steps:
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            inputs, targets = batch
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            step_loss = (total_loss / accum).item()
            total_loss = 0.0
            accelerator.log({"train_loss": step_loss}, step=completed_steps)
            print(f"step {completed_steps} loss {step_loss:.6f}", flush=True)
            if completed_steps == steps:
                break
