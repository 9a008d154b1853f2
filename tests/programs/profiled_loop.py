"""A loop profiled as the PyTorch profiler's tutorial does it: CPU activities, shapes, memory and Python stacks.

    python profiled_loop.py STEPS

Prints the profiler's count of optimizer steps and Adam's own count of them.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

steps = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True) as prof:
    for _ in range(steps):
        x = torch.randn(8, 16)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
profiled = sum(1 for e in prof.events() if e.name.startswith("Optimizer.step#Adam.step"))
print(f"profiled optimizer steps {profiled}; adam's steps {int(opt.state[model[0].weight]['step'].item())}")
