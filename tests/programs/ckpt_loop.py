"""A raw PyTorch loop that knows nothing of fabtrain, as a user writes one: it saves a checkpoint with
torch.save every EVERY steps into its own folder, and resumes from it when the file is there.

    ckpt_loop.py OUT STEPS EVERY SLEEP [CRASH_AT] [LINGER]

It runs to step STEPS in all (counting the steps its checkpoint holds), sleeping SLEEP s a step. The first
run (FABTRAIN_RESTART_COUNT unset or 0) raises at step CRASH_AT; every run waits LINGER s after its last step
(with no save) before it exits.
"""
import os
import sys
import time

import torch

out, steps, every, sleep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
crash_at = int(sys.argv[5]) if len(sys.argv) > 5 else 0
linger = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
os.makedirs(out, exist_ok=True)
path = os.path.join(out, "ckpt.pt")
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(path):
    ck = torch.load(path)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    start = ck["step"]
    print(f"resumed from {path} at step {start}", flush=True)
first = os.environ.get("FABTRAIN_RESTART_COUNT", "0") == "0"
for step in range(start + 1, steps + 1):
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(sleep)
    if step % every == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, path)
        print(f"step {step}: saved {path}", flush=True)
    if first and step == crash_at:
        raise RuntimeError(f"crashed at step {step}")
print(f"done at step {steps}", flush=True)
time.sleep(linger)
