"""A training loop whose exit takes long: after its last step an atexit handler of the program's own (an
upload of its results, a final save) either computes or waits.

    python slow_exit.py STEPS spin|block SECONDS

spin: the handler computes for SECONDS (CPU, no output); block: it waits for SECONDS (no CPU, no output), as an
exit stuck on a lock does. The handler is registered before torch is imported, so it runs after every handler
torch and its importers register (atexit runs the last registered first).
"""
import atexit
import sys
import time

steps, how, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])


def finish():
    print(f"finishing: {how} for {seconds:g} s", flush=True)
    end = time.monotonic() + seconds
    if how == "spin":
        while time.monotonic() < end:
            sum(range(10000))
    else:
        time.sleep(seconds)


atexit.register(finish)

import torch  # noqa: E402 (after the handler: see above)

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    time.sleep(0.05)
print(f"trained {steps} steps", flush=True)
