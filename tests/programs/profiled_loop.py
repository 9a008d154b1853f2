"""A loop profiled as the PyTorch profiler's tutorial does it: CPU activities, shapes, memory and Python stacks.

    python profiled_loop.py STEPS

Prints Adam's count of its steps. (It leaves the profile's events unread: reading them fails now and then
under torch 2.13 with Python stacks, an event's name not UTF-8, with or without fabtrain.)
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
print(f"adam's steps {int(opt.state[model[0].weight]['step'].item())}")
