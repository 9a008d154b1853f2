"""What does `job.launcher: mpirun` cost over the same mpirun run by hand?

3 real sshd nodes on 127.0.0.x, one rank each, running tests/programs/mpi_allreduce.c
(built here with mpicc: one MPI_Allreduce, then exit). In one run, alternating:

  fabtrain   `fab start-trainers` (a port probe of every node, then node ops' start:
             each node's job.json and agent, and mpirun on the first) -> the command
             returns; -> every rank's exit code recorded; -> nothing of the job
             left, agents included
  by hand    the same mpirun command line fabtrain ran (same hostfile, ssh config and
             MCA settings, the program directly instead of through fabtrain's rank
             starter and launcher), started on this machine -> mpirun exits

Both check the allreduce's sum on every rank. Prints each trial, the medians and
the ratio fabtrain / by hand.

    .venv/bin/python bench/mpi.py [--trials 5]
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where bench/copy.py would shadow the stdlib's copy.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.sshd_job import FAB, SshdJob  # noqa: E402
from fabtrain.plan.mpirun import ALLOW_ROOT  # noqa: E402
from tests.support.procscan import live_marked, wait_for  # noqa: E402


def by_hand_argv(job: SshdJob, binary: Path) -> list[str]:
    """fabtrain's mpirun command line of the last job, with the program in place of fabtrain's rank starter."""
    first = job.names[0]
    spec = next(p for p in json.loads((job.jd(first) / "job.json").read_text())["processes"] if p["name"] == "mpirun-0")
    argv = [a.replace("$WS", str(job.ws[first])) for a in spec["argv"]]
    return argv[:argv.index("python3")] + [str(binary), "0"]


def run_fabtrain(job: SshdJob) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    out = subprocess.run([FAB, "start-trainers"], cwd=REPO, env=job.env, capture_output=True, text=True, timeout=300)
    returned = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"fab start-trainers failed:\n{out.stdout}\n{out.stderr}")
    job.job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    exits = [job.jd(n) / "run" / f"trainer-{r}.exit" for r, n in enumerate(job.names)]
    if not wait_for(lambda: all(f.exists() for f in exits), timeout=120, interval=0.01):
        raise SystemExit("fabtrain: the ranks did not all end within 120 s")
    ended = time.perf_counter() - t0
    if not wait_for(lambda: not live_marked(job.ws.values()), timeout=120, interval=0.01):
        raise SystemExit("fabtrain: the job's processes did not all go within 120 s")
    gone = time.perf_counter() - t0
    codes = [f.read_text().strip() for f in exits]
    logs = [(job.jd(n) / "logs" / f"trainer-{r}.log").read_text() for r, n in enumerate(job.names)]
    if codes != ["0"] * 3 or not all(f"rank {r} of 3: allreduce sum 6" in log for r, log in enumerate(logs)):
        raise SystemExit(f"fabtrain: wrong result: exits {codes}\n" + "\n".join(logs))
    return returned, ended, gone


def run_by_hand(argv: list[str]) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(argv, env={**os.environ, **ALLOW_ROOT}, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    if out.returncode or sorted(re.findall(r"allreduce sum (\d+)", out.stdout)) != ["6"] * 3:
        raise SystemExit(f"by hand: mpirun failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fabtrain-bench-mpi-"))
    binary = root / "mpi_allreduce"
    subprocess.run(["mpicc", "-O1", "-o", str(binary), str(REPO / "tests/programs/mpi_allreduce.c")], check=True)
    job = SshdJob(root / "job", 3, lambda names: [(n, ["trainer"]) for n in names],
                  {"mode": "collective", "launcher": "mpirun", "trainer": {"command": f"{binary} 0"},
                   "watchdog": {"grace": 1}})
    try:
        job.fab("deploy")
        run_fabtrain(job)  # warm-up, and the command line to run by hand
        argv = by_hand_argv(job, binary)
        print("by hand:", " ".join(argv[:argv.index("-np")]), "... -np 3", binary.name, "0")
        run_by_hand(argv)  # warm-up
        returned, ended, gone, hand = [], [], [], []
        for trial in range(args.trials):
            r, e, g = run_fabtrain(job)
            h = run_by_hand(argv)
            returned.append(r), ended.append(e), gone.append(g), hand.append(h)
            print(f"trial {trial + 1}: fabtrain start-trainers returned {r:.3f} s, ranks ended {e:.3f} s, "
                  f"nothing left {g:.3f} s; by hand {h:.3f} s")
        mr, me, mg, mh = (statistics.median(x) for x in (returned, ended, gone, hand))
        print(f"median: fabtrain start-trainers returned {mr:.3f} s, ranks ended {me:.3f} s, nothing left {mg:.3f} s; "
              f"by hand {mh:.3f} s")
        print(f"ratio fabtrain / by hand: ranks ended {me / mh:.2f}x, nothing left {mg / mh:.2f}x")
    finally:
        job.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
