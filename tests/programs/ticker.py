"""A stand-in training process for lifecycle tests: reports where it runs, then ticks.

Writes one JSON line with its environment to $FABTRAIN_WORKSPACE/env-<role>-<rank>.json,
then prints `tick <unix time>` every 0.1 s without flushing (line buffering comes
from the launcher) and writes a metrics record each tick.
"""
import json
import os
import sys
import time

role, rank = os.environ["FABTRAIN_ROLE"], os.environ["FABTRAIN_RANK"]
# Whole or not there (a test polls for it; a restarted process writes it again): written aside, then renamed.
path = os.path.join(os.environ["FABTRAIN_WORKSPACE"], f"env-{role}-{rank}.json")
with open(f"{path}.{os.getpid()}", "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid()}, f)
os.replace(f"{path}.{os.getpid()}", path)
print(f"{role} {rank} started argv={sys.argv[1:]}")
step = 0
metrics = open(os.environ["FABTRAIN_METRICS"], "a")
while True:
    print(f"tick {time.time():.3f}")
    metrics.write(json.dumps({"ts": time.time(), "role": role, "rank": int(rank), "step": step, "loss": 1.0 / (step + 1)}) + "\n")
    metrics.flush()
    step += 1
    time.sleep(0.1)
