"""What does fabtrain cost on Slurm, against Slurm alone?

On the tests' real Slurm cluster (tests/support/slurm_cluster.py: munged, slurmctld,
three slurmd on this machine), the same 3-rank torch gloo program
(tests/programs/allreduce.py: an all_reduce, then a metrics record every
--period) is run both ways, alternating, --trials times:

  start    fabtrain: `fab start-trainers --no-wait` -> every rank's first
           metrics record (the agents, the launcher and the code snapshot on
           the way)
           baseline: `sbatch` of a bare batch script with one
           `srun sh -c 'RANK=$SLURM_PROCID ... exec python allreduce.py'`
           -> every rank's first metrics record
  stop     fabtrain: `fab kill-all` -> returns, Slurm says CANCELLED and no
           process of the job is left (/proc, the job marker)
           baseline: `scancel` -> the same three conditions

Prints each trial, the medians and fabtrain / baseline. With --auto-ports each
trial also runs fabtrain with `master_port: auto` and `watchdog.port: auto`,
which are drawn inside the allocation (by the job's step tasks, before they start anything).

    .venv/bin/python bench/slurm.py [--trials 3] [--period 0.2] [--auto-ports]
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where bench/copy.py would shadow the stdlib's copy.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.procscan import live_marked, wait_for  # noqa: E402
from tests.support.slurm_cluster import SlurmCluster  # noqa: E402
from tests.support.slurm_job import SlurmJob  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402

RANKS = 3


def first_records(paths: list[Path]) -> bool:
    return all(p.exists() and p.stat().st_size > 0 for p in paths)


def ended(job: SlurmJob, slurm_job: str, marked: list[Path]) -> bool:
    return job.slurm.run("squeue", "-h", "-j", slurm_job, check=False).stdout.strip() == "" and not live_marked(marked)


def fabtrain_trial(job: SlurmJob, period: float, auto: bool = False) -> tuple[float, float]:
    job.configure(f"python allreduce.py --steps 100000 --period {period}",
                  **({"job": {"master_port": "auto"}, "port": "auto"} if auto else {}))
    t0 = time.monotonic()
    job.submit("--no-wait")
    metrics = [job.jd(i) / "metrics" / f"trainer-{i}.jsonl" for i in range(RANKS)]
    assert wait_for(lambda: first_records(metrics), timeout=300, interval=0.02), job.describe()
    started = time.monotonic() - t0
    t0 = time.monotonic()
    job.fab("kill-all", check=True)
    marked = [job.node_ws(i) for i in range(RANKS)]
    assert wait_for(lambda: ended(job, job.slurm_job, marked), timeout=120, interval=0.02)
    return started, time.monotonic() - t0


def baseline_trial(job: SlurmJob, root: Path, period: float) -> tuple[float, float]:
    """The same program through Slurm alone: one srun step, ranks from SLURM_PROCID."""
    out = root / f"bare-{time.monotonic_ns()}"
    out.mkdir()
    port = free_port(["127.0.0.1"])
    program = job.code / "allreduce.py"
    rank_env = (f"RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
                f"FABTRAIN_WORKSPACE={out} FABTRAIN_METRICS={out}/m-$SLURM_PROCID.jsonl "
                f"exec {shlex.quote(sys.executable)} {program} --steps 100000 --period {period}")
    script = out / "bare.sh"
    script.write_text("\n".join(["#!/bin/sh", f"#SBATCH --nodes={RANKS}", "#SBATCH --ntasks-per-node=1",
                                 f"#SBATCH --output={out}/slurm-%j.out",
                                 f"srun sh -c {shlex.quote(rank_env)}", ""]))
    t0 = time.monotonic()
    slurm_job = job.slurm.run("sbatch", "--parsable", str(script)).stdout.strip()
    assert wait_for(lambda: first_records([out / f"m-{r}.jsonl" for r in range(RANKS)]), timeout=300, interval=0.02)
    started = time.monotonic() - t0
    t0 = time.monotonic()
    job.slurm.run("scancel", slurm_job)
    assert wait_for(lambda: ended(job, slurm_job, [out]), timeout=120, interval=0.02)
    return started, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--period", type=float, default=0.2)
    ap.add_argument("--auto-ports", action="store_true", help="also fabtrain with auto ports, drawn in the allocation")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fabtrain-bench-slurm-"))
    slurm = SlurmCluster(root / "slurm").start()
    try:
        job = SlurmJob(root / "project", slurm)
        job.configure("python allreduce.py")
        job.fab("deploy", check=True)
        fab, bare, auto = [], [], []
        for trial in range(args.trials):
            fab.append(fabtrain_trial(job, args.period))
            bare.append(baseline_trial(job, root, args.period))
            line = (f"trial {trial + 1}: start fabtrain {fab[-1][0]:.2f} s, sbatch+srun {bare[-1][0]:.2f} s; "
                    f"stop fab kill-all {fab[-1][1]:.2f} s, scancel {bare[-1][1]:.2f} s")
            if args.auto_ports:
                auto.append(fabtrain_trial(job, args.period, auto=True))
                line += f"; auto ports: start {auto[-1][0]:.2f} s, stop {auto[-1][1]:.2f} s"
            print(line, flush=True)
        for what, i in (("submit -> every rank's first metrics record", 0), ("stop -> nothing left, CANCELLED", 1)):
            b = statistics.median(x[i] for x in bare)
            for name, series in (("fabtrain", fab), ("fabtrain, auto ports", auto)):
                if not series:
                    continue
                f = statistics.median(x[i] for x in series)
                print(f"{what}: {name} {f:.2f} s (median of {args.trials}; "
                      f"{min(x[i] for x in series):.2f}-{max(x[i] for x in series):.2f}), Slurm alone {b:.2f} s "
                      f"({min(x[i] for x in bare):.2f}-{max(x[i] for x in bare):.2f}): {f / b:.2f}x")
    finally:
        slurm.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
