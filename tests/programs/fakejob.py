"""A stand-in training program for the watchdog's fault-injection tests.

    python tests/programs/fakejob.py [--steps N] [--period S] [--warmup S] [faults...]

Role and rank come from FABTRAIN_ROLE / FABTRAIN_RANK. A trainer writes a
metrics record to $FABTRAIN_METRICS every --period seconds and exits 0 after
--steps (0: never), its first one after --warmup seconds (loading, say); a pserver writes a "served" record every period until it
is stopped. Faults name the process they apply to as <role>-<rank> (or "*"):

    --crash trainer-1:5:3        exit with code 3 at step 5
    --hang trainer-0:4           at step 4 stop writing and sleep (no CPU, no output)
    --child trainer-0            start a child that leaves the process group (setsid) and lives on
    --zombies trainer-0:3        fork 3 children that exit at once and are never reaped
    --worker-zombies trainer-0:2 start a worker (in the group) that ignores SIGTERM and leaves 2 zombies
    --ignore-term pserver-0      ignore SIGTERM
    --spin trainer-1:4           at step 4 stop writing and spin in Python (spin_forever), a thread asleep beside it
    --slow trainer-1:2           take 2 times the period between records (a straggler)
    --block trainer-1:4          at step 4 stop writing and block in recv() on a socket no one writes (wait_for_peer)
    --burn *:1                   start 1 child (in the group) that keeps a core busy; the process goes on
"""
import json
import os
import signal
import socket
import sys
import threading
import time

from faults import me, mine, parser, rank, role


def sleep_forever():
    while True:
        time.sleep(3600)


def spin_forever():
    threading.Thread(target=sleep_forever, daemon=True).start()
    n = 0
    while True:
        n += 1


def wait_for_peer():
    a, b = socket.socketpair()
    a.recv(1)


def make_zombies(n):
    for _ in range(n):
        if os.fork() == 0:
            os._exit(0)


def main():
    ap = parser("--crash", "--hang", "--child", "--zombies", "--worker-zombies", "--ignore-term", "--spin", "--block",
                "--slow", "--burn")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=0.0)
    ap.add_argument("--silent-start", action="store_true", help="print nothing before the first step")
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
    stuck = [(f, mine(spec)) for f, spec in ((spin_forever, args.spin), (wait_for_peer, args.block))]
    stuck = [(f, int(a[0]) if a else 0) for f, a in stuck if a is not None]

    metrics = open(os.environ["FABTRAIN_METRICS"], "a") if os.environ.get("FABTRAIN_METRICS") else None
    if not args.silent_start:  # a printed line is a sign of life: the job is running, not starting
        print(f"{me} started pid {os.getpid()} argv {sys.argv[1:]}", flush=True)
    time.sleep(args.warmup)
    step = 0
    while role != "trainer" or not args.steps or step < args.steps:
        if crash is not None and step >= int(crash[0]):
            print(f"{me} crashing at step {step}", flush=True)
            sys.exit(int(crash[1]) if len(crash) > 1 else 1)
        if hang is not None and step >= int(hang[0] if hang else 0):
            print(f"{me} hanging at step {step}", flush=True)
            sleep_forever()
        for f, at in stuck:
            if step >= at:
                print(f"{me} stuck in {f.__name__} at step {step}", flush=True)
                f()
        rec = {"ts": time.time(), "role": role, "rank": rank, "step": step}
        if role == "trainer":
            rec.update(loss=round(5.0 / (step + 1), 4), samples_per_s=100.0, epoch=0)
        else:
            rec["served"] = step
        if metrics:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        step += 1
        slow = mine(args.slow)
        time.sleep(args.period * (float(slow[0]) if slow else 2.0) if slow is not None else args.period)
    print(f"{me} done after {step} steps", flush=True)


if __name__ == "__main__":
    main()
