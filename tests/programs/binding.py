"""A trainer that says what it was given to run on: its GPUs (CUDA_VISIBLE_DEVICES) and CPUs (its affinity).

    python tests/programs/binding.py

Writes {"node", "gpus", "cpus"} to $FABTRAIN_WORKSPACE/binding-<name>.json and one metrics record, then exits 0.
"""
import json
import os
import time

from faults import me, rank, role

with open(os.path.join(os.environ["FABTRAIN_WORKSPACE"], f"binding-{me}.json"), "w") as f:
    json.dump({"node": os.environ.get("SLURMD_NODENAME"), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "cpus": sorted(os.sched_getaffinity(0))}, f)
with open(os.environ["FABTRAIN_METRICS"], "a") as f:
    f.write(json.dumps({"ts": time.time(), "role": role, "rank": rank, "step": 0, "loss": 1.0}) + "\n")
