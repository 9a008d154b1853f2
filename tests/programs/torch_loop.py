"""A plain single-process torch training loop that knows nothing of fabtrain.

    python torch_loop.py STEPS [OWN_FROM [EVAL_BATCHES]]

A DataLoader, a small model, SGD; prints its final weights and the next random numbers of torch and
Python, so two runs can be compared for numerics and RNG. OWN_FROM (0: never): from that step on the
program appends its own records to $FABTRAIN_METRICS, as a program that reports for itself does.
EVAL_BATCHES: after training, it evaluates that many batches (10 ms each, no step).
"""
import json
import os
import random
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

steps = int(sys.argv[1])
own_from = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "0" else None
eval_batches = int(sys.argv[3]) if len(sys.argv) > 3 else 0
torch.manual_seed(0)
random.seed(0)
x = torch.randn(64, 4)
dataset = TensorDataset(x, x.sum(1, keepdim=True))
data = DataLoader(dataset, batch_size=4, shuffle=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
step = 0
while step < steps:
    for source, target in data:
        loss = ((model(source) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if own_from is not None and step >= own_from:
            with open(os.environ["FABTRAIN_METRICS"], "a") as f:
                f.write(json.dumps({"ts": time.time(), "step": step, "loss": loss.item()}) + "\n")
        time.sleep(0.005)
        if step == steps:
            break
with torch.no_grad():  # one iterator: the same random numbers drawn however long it takes
    for (source,) in DataLoader(TensorDataset(torch.zeros(eval_batches, 4)), batch_size=1):
        model(source)
        time.sleep(0.01)
print("weights", [repr(v) for v in model.weight.flatten().tolist()], repr(model.bias.item()))
print("rng", repr(torch.rand(1).item()), repr(random.random()))
