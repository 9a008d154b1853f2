"""A stand-in trainer for the watchdog's fault tests: a loop that prints a line and appends a metrics record every 0.2 s,
with a child `sleep`. Faults name the process they apply to as <role>-<rank> (or "*"):

    python tests/programs/standin.py [--period S] [faults...]

    --escape trainer-1           a child runs `env -i setsid sleep 1000 &` (its own session, no environment);
                                 its pid goes to $FABTRAIN_WORKSPACE/escaped-<name>.pid
    --spin trainer-0:5           from step 5 on: 100% CPU, no metrics, no output
    --chatter trainer-0:5        from step 5 on: print `waiting...` every period, no metrics
    --fill-disk trainer-0:3      at step 3: write $FABTRAIN_CHECKPOINT_DIR/fill until the disk is full (ENOSPC kills it)
    --silent-start trainer-0:S   sleep S seconds, silent, before the first record

Its child sleep's pid goes to $FABTRAIN_WORKSPACE/child-<name>.pid.
"""
import json
import os
import subprocess
import sys
import time

from faults import me, mine, parser, rank, role

ws = os.environ.get("FABTRAIN_WORKSPACE", ".")


def at(spec, default=0):
    values = mine(spec)
    return None if values is None else (float(values[0]) if values else default)


def main():
    ap = parser("--escape", "--spin", "--chatter", "--fill-disk", "--silent-start")
    args = ap.parse_args()

    child = subprocess.Popen(["sleep", "1000"])
    with open(os.path.join(ws, f"child-{me}.pid"), "w") as f:
        f.write(str(child.pid))
    if mine(args.escape) is not None:
        pidfile = os.path.join(ws, f"escaped-{me}.pid")
        subprocess.run(["sh", "-c", f"env -i setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}"])
    silent = at(args.silent_start)
    if silent:
        time.sleep(silent)
    spin, chatter, fill = at(args.spin), at(args.chatter), at(args.fill_disk)
    metrics = open(os.environ["FABTRAIN_METRICS"], "a")
    print(f"{me} started pid {os.getpid()} child {child.pid}", flush=True)
    step = 0
    while True:
        if spin is not None and step >= spin:
            while True:
                pass
        if chatter is not None and step >= chatter:
            print("waiting...", flush=True)
            time.sleep(args.period)
            continue
        if fill is not None and step >= fill:
            os.makedirs(os.environ["FABTRAIN_CHECKPOINT_DIR"], exist_ok=True)
            with open(os.path.join(os.environ["FABTRAIN_CHECKPOINT_DIR"], "fill"), "wb") as f:
                while True:  # OSError: [Errno 28] No space left on device
                    f.write(b"\0" * (1 << 16))
                    f.flush()
        print(f"{me} step {step}", flush=True)
        metrics.write(json.dumps({"ts": time.time(), "role": role, "rank": rank, "step": step,
                                  "loss": round(5.0 / (step + 1), 4)}) + "\n")
        metrics.flush()
        step += 1
        time.sleep(args.period)


if __name__ == "__main__":
    sys.exit(main())
