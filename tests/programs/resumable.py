"""A trainer that checkpoints every step and resumes from its checkpoint, as a requeued job's programs do.

    python tests/programs/resumable.py [--period S] [--steps N]

Each step: a metrics record, then $FABTRAIN_CHECKPOINT_DIR/<name>.json {"step"}. At its start it appends
{"restart_count", "from_step"} to $FABTRAIN_CHECKPOINT_DIR/<name>.starts.jsonl (FABTRAIN_RESTART_COUNT and
the step it resumed from). It exits 0 after step N-1.
"""
import json
import os
import sys
import time

from faults import me, parser, rank, role


def main():
    ap = parser()
    ap.add_argument("--steps", type=int, default=1000000)
    args = ap.parse_args()
    folder = os.environ["FABTRAIN_CHECKPOINT_DIR"]
    os.makedirs(folder, exist_ok=True)
    checkpoint = os.path.join(folder, f"{me}.json")
    try:
        with open(checkpoint) as f:
            step = json.load(f)["step"] + 1
    except (OSError, ValueError):
        step = 0
    with open(os.path.join(folder, f"{me}.starts.jsonl"), "a") as f:
        f.write(json.dumps({"restart_count": os.environ.get("FABTRAIN_RESTART_COUNT"), "from_step": step}) + "\n")
    metrics = open(os.environ["FABTRAIN_METRICS"], "a")
    while step < args.steps:
        print(f"{me} step {step}", flush=True)
        metrics.write(json.dumps({"ts": time.time(), "role": role, "rank": rank, "step": step,
                                  "loss": round(5.0 / (step + 1), 4)}) + "\n")
        metrics.flush()
        tmp = checkpoint + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step}, f)
        os.replace(tmp, checkpoint)
        step += 1
        time.sleep(args.period)
    return 0


if __name__ == "__main__":
    sys.exit(main())
