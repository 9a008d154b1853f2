"""A stand-in training program for the watchdog's fault-injection tests.

    python tests/programs/fakejob.py [--steps N] [--period S] [faults...]

Role and rank come from FABTRAIN_ROLE / FABTRAIN_RANK. A trainer writes a
metrics record to $FABTRAIN_METRICS every --period seconds and exits 0 after
--steps (0: never); a pserver writes a "served" record every period until it
is stopped. Faults name the process they apply to as <role>-<rank> (or "*"):

    --crash trainer-1:5:3        exit with code 3 at step 5
    --hang trainer-0:4           at step 4 stop writing and sleep (no CPU, no output)
    --child trainer-0            start a child that leaves the process group (setsid) and lives on
    --zombies trainer-0:3        fork 3 children that exit at once and are never reaped
    --worker-zombies trainer-0:2 start a worker (in the group) that ignores SIGTERM and leaves 2 zombies
    --ignore-term pserver-0      ignore SIGTERM
    --burn *:1                   start 1 child (in the group) that keeps a core busy; the process goes on
"""
import json
import os
import signal
import sys
import time

from faults import me, mine, parser, rank, role


def sleep_forever():
    while True:
        time.sleep(3600)


def make_zombies(n):
    for _ in range(n):
        if os.fork() == 0:
            os._exit(0)


def main():
    ap = parser("--crash", "--hang", "--child", "--zombies", "--worker-zombies", "--ignore-term", "--burn")
    ap.add_argument("--steps", type=int, default=0)
    args = ap.parse_args()

    if mine(args.ignore_term) is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mine(args.child) is not None and os.fork() == 0:
        os.setsid()  # out of the job's process group: only the job marker finds it
        print(f"{me} child {os.getpid()} leaves the group", flush=True)
        sleep_forever()
    z = mine(args.zombies)
    if z is not None:
        make_zombies(int(z[0]) if z else 2)
    wz = mine(args.worker_zombies)
    if wz is not None and os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        make_zombies(int(wz[0]) if wz else 2)
        print(f"{me} worker {os.getpid()} holds zombies", flush=True)
        sleep_forever()
    burn = mine(args.burn)
    for _ in range(int(burn[0]) if burn else 1 if burn is not None else 0):
        if os.fork() == 0:
            while True:
                pass
    crash, hang = mine(args.crash), mine(args.hang)

    metrics = open(os.environ["FABTRAIN_METRICS"], "a") if os.environ.get("FABTRAIN_METRICS") else None
    print(f"{me} started pid {os.getpid()} argv {sys.argv[1:]}", flush=True)
    step = 0
    while role != "trainer" or not args.steps or step < args.steps:
        if crash is not None and step >= int(crash[0]):
            print(f"{me} crashing at step {step}", flush=True)
            sys.exit(int(crash[1]) if len(crash) > 1 else 1)
        if hang is not None and step >= int(hang[0] if hang else 0):
            print(f"{me} hanging at step {step}", flush=True)
            sleep_forever()
        rec = {"ts": time.time(), "role": role, "rank": rank, "step": step}
        if role == "trainer":
            rec.update(loss=round(5.0 / (step + 1), 4), samples_per_s=100.0, epoch=0)
        else:
            rec["served"] = step
        if metrics:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        step += 1
        time.sleep(args.period)
    print(f"{me} done after {step} steps", flush=True)


if __name__ == "__main__":
    main()
