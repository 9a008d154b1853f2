"""A raw PyTorch loop that saves ckpt-<step>.pt every EVERY steps and takes the checkpoint to resume from from
FABTRAIN_RESUME_FROM (docs/programs.md), as a user writes one for on_failure restart:

    ckpt_steps.py OUT STEPS EVERY SLEEP CRASH_AT [LINGER]

It runs to step STEPS in all (counting the steps its checkpoint holds), sleeping SLEEP s a step. The first
run (FABTRAIN_RESTART_COUNT 0) raises at step CRASH_AT, having torn its newest checkpoint on disk (half its
bytes, as a storage fault or a copy cut short leaves it): every run pointed at that file fails loading it.
Every run waits LINGER s after its last step before it exits.
"""
import os
import sys
import time

import torch

out, steps, every, sleep, crash_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
linger = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
resume = os.environ.get("FABTRAIN_RESUME_FROM")
if resume:
    ck = torch.load(resume)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    start = ck["step"]
    print(f"resumed from {resume} at step {start}", flush=True)
first = os.environ.get("FABTRAIN_RESTART_COUNT", "0") == "0"
for step in range(start + 1, steps + 1):
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(sleep)
    if step % every == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                   os.path.join(out, f"ckpt-{step}.pt"))
    if first and step == crash_at:
        newest = os.path.join(out, f"ckpt-{step // every * every}.pt")
        os.truncate(newest, os.path.getsize(newest) // 2)
        raise RuntimeError(f"crashed at step {step}")
print(f"done at step {steps}", flush=True)
time.sleep(linger)
