"""A plain Hugging Face `accelerate` loop, as its docs write one; it knows nothing of fabtrain.

    python accelerate_loop.py STEPS

A small regression model on CPU: Accelerator.prepare, accelerator.backward, the
optimizer's step, and accelerator.log of the loss and a metric of its own name
every step (no tracker configured: log is then a no-op for accelerate). Prints
the final weights, so a test can compare a run with and without the hook.
"""
import sys

import torch
from accelerate import Accelerator

steps = int(sys.argv[1])
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
model, opt, loader = accelerator.prepare(model, opt, loader)
step = 0
while step < steps:
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        step += 1
        accelerator.log({"train_loss": loss.item(), "abs_weight": model.weight.abs().sum().item()}, step=step)
        if step == steps:
            break
print("weights", [float(v).hex() for v in model.weight.detach().flatten()], flush=True)
