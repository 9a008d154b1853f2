"""A stand-in training program for the dashboard's browser test.

Knows nothing of fabtrain but its environment, as a real workload: a trainer
appends a metrics record to $FABTRAIN_METRICS every 0.2 s and logs every
fifth step; a pserver logs a heartbeat. Exits 0 by itself after --seconds
(so it can never be left behind for long).
"""
import json
import math
import os
import random
import sys
import time


def main() -> int:
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 300.0
    role = os.environ.get("FABTRAIN_ROLE", "trainer")
    rank = int(os.environ.get("FABTRAIN_RANK", "0"))
    end = time.time() + seconds
    if role == "pserver":
        print(f"pserver {rank} listening on port {os.environ.get('PADDLE_PORT', '?')}", flush=True)
        while time.time() < end:
            time.sleep(1.0)
            print(f"pserver {rank}: {len(os.environ.get('PADDLE_INIT_PSERVERS', '').split(','))} pservers, waiting for gradients", flush=True)
        return 0
    rng = random.Random(rank)
    path = os.environ["FABTRAIN_METRICS"]
    print(f"trainer {rank} of {os.environ.get('WORLD_SIZE', '?')}: writing metrics to {path}", flush=True)
    step = 0
    with open(path, "a") as f:
        while time.time() < end:
            loss = 6.0 * math.exp(-step / 60) + 1.0 + 0.15 * rng.random() + 0.05 * rank
            sps = 900 + 80 * math.sin(step / 7 + rank) + 20 * rng.random()
            f.write(json.dumps({"ts": time.time(), "role": role, "rank": rank, "step": step, "epoch": step // 100,
                                "loss": loss, "samples_per_s": sps, "lr": 0.01}) + "\n")
            f.flush()
            if step % 5 == 0:
                print(f"step {step} epoch {step // 100} loss {loss:.4f} samples/s {sps:.1f}", flush=True)
            step += 1
            time.sleep(0.2)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
