"""How long does on_failure restart take to bring a job back, against the job's own cold start?

Three real sshd nodes on 127.0.0.x (a pserver node, two trainer nodes) run the
reference workload (word2vec, pserver mode, `--program workload`) or the
stand-in tests/programs/fakejob.py (`--program fake`) with
`on_failure: restart`. Each trial SIGKILLs the last trainer's program and
measures

  restart   the SIGKILL -> every trainer rank's first metrics record of the
            next generation (no `fab` runs meanwhile)
  cold      the job's own cold start, measured in the same run: its first
            processes' start (run records' started_at) -> every trainer's
            first metrics record, for generation 0 (`fab start-*`)
  gen cold  the same for the generation just restarted: what of `restart` is
            the program's own start

target: restart <= backoff + 1.2 x cold. The backoff doubles each restart
(restart_backoff, 2 x, 4 x ...). Prints one line per trial and the ratio
restart / (backoff + cold) (<= 1.2 x cold share meets the target).

    .venv/bin/python bench/restart.py [--trials 3] [--backoff 2] [--program workload|fake]
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where bench/copy.py would shadow the stdlib's copy.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.sshd_job import SshdJob  # noqa: E402

PROGRAMS = {
    "workload": {"pserver": "python -m workload.pserver --checkpoint_every 10",
                 "trainer": "python -m workload.trainer --model word2vec --num_passes 200"},
    "fake": {"pserver": "python tests/programs/fakejob.py", "trainer": "python tests/programs/fakejob.py"},
}
TRAINERS = (("node2", "trainer-0"), ("node3", "trainer-1"))


class Bench(SshdJob):
    def __init__(self, root: Path, program: str, backoff: float, trials: int):
        cmd = PROGRAMS[program]
        job = {"name": "restart", "mode": "pserver", "sgd": "sync",
               "pserver": {"port": 7631, "command": cmd["pserver"]}, "trainer": {"command": cmd["trainer"]},
               "watchdog": {"interval": 1, "hang_timeout": 60, "grace": 3, "on_failure": "restart",
                            "restart_backoff": backoff, "max_restarts": trials}}
        if program == "workload":
            job["data"] = {"dir": str(root / "data"), "input": "sample"}
        super().__init__(root, 3, lambda names: [(names[0], ["pserver"])] + [(n, ["trainer"]) for n in names[1:]], job)
        self.prepare = ("split-data", "deploy", "copy-data") if program == "workload" else ("deploy",)

    def generation_up(self, after: float, timeout: float = 300) -> tuple[float, float]:
        """Wait until every trainer runs a generation started after `after` and wrote its first record;
        (the last first record's ts, the generation's first start)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            starts = {}
            for node in self.ws:
                for f in (self.jd(node) / "run").glob("*.json"):
                    if f.stem != "agent":
                        try:
                            starts[(node, f.stem)] = json.loads(f.read_text())["started_at"]
                        except (OSError, ValueError, KeyError):
                            pass
            if len(starts) == 3 and all(s > after for s in starts.values()):
                firsts = [self.first_record(n, name, starts[(n, name)]) for n, name in TRAINERS]
                if all(firsts):
                    return max(r["ts"] for r in firsts), min(starts.values())
            time.sleep(0.02)
        raise SystemExit(f"no new generation within {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--backoff", type=float, default=2.0)
    ap.add_argument("--program", choices=sorted(PROGRAMS), default="workload")
    args = ap.parse_args()
    b = Bench(Path(tempfile.mkdtemp(prefix="fabtrain-restart-")), args.program, args.backoff, args.trials)
    try:
        b.fab(*b.prepare)
        t_start = time.time()
        out = b.fab("start-pserver", "start-trainers")
        b.job_id = re.search(r"job (\S+): trainer started", out).group(1)
        up, began = b.generation_up(t_start - 60)
        cold = up - began
        print(f"program {args.program}; restart_backoff {args.backoff:g} s (doubling), grace 3 s, interval 1 s; "
              f"{args.trials} restarts")
        print(f"cold start (generation 0): {cold:.3f} s  (first process start -> every trainer's first record)")
        print(f"{'gen':>3}  {'backoff':>7}  {'restart s':>9}  {'gen cold s':>10}  {'target s':>8}  "
              f"{'restart/target':>14}  {'overhead s':>10}")
        for g in range(1, args.trials + 1):
            time.sleep(3.0)  # a few records into the generation
            victim = b.run_record("node3", "trainer-1")["program_pid"]
            t0 = time.time()
            os.kill(victim, signal.SIGKILL)
            up, began = b.generation_up(t0)
            backoff = args.backoff * 2 ** (g - 1)
            took, gen_cold = up - t0, up - began
            target = backoff + 1.2 * cold
            print(f"{g:>3}  {backoff:>7.1f}  {took:>9.3f}  {gen_cold:>10.3f}  {target:>8.3f}  {took / target:>14.2f}  "
                  f"{took - backoff - gen_cold:>10.3f}", flush=True)
        print("overhead = restart - backoff - gen cold: failure seen, teardown, the coordinator's decision, relaunch")
    finally:
        b.close()


if __name__ == "__main__":
    main()
