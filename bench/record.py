"""Run a benchmark and keep its raw output in bench/results/<name>.txt.

    .venv/bin/python bench/record.py NAME [--runs K] [--copied-from COMMIT] -- COMMAND...

The file starts with what the figures depend on: the commit measured (and
whether the tree differed from it), the date, `nproc`, and for each run the
load average before and after (other work on a shared machine shows in every
figure). The output also goes to the terminal as it comes. docs/performance.md and
the README quote these files and nothing else.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def user_env() -> dict[str, str]:
    """The environment the command runs in: this one, as a user's machine has it. A shell that sets
    PYTHONDONTWRITEBYTECODE (a sandbox, a CI image) makes every Python process of fab, node ops, the
    agents and launchers compile its modules from source on each start: a cost a user, whose pip
    install compiled them once, never pays."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def header(command: list[str], runs: int, copied_from: str | None) -> str:
    if copied_from:  # a copy of a clean tree on a machine without its history (the GPU machine)
        commit = copied_from
    else:
        # bench/results/ itself is left out: it is what this run writes.
        dirty = git("status", "--porcelain", "--untracked-files=normal", "--", ".", ":(exclude)bench/results")
        commit = f"{git('rev-parse', 'HEAD')}{' (with uncommitted changes)' if dirty else ''}"
    return "".join([
        f"commit: {commit}\n",
        f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n",
        f"nproc: {os.cpu_count()}\n",
        f"command: {' '.join(command)}   ({runs} run{'s' if runs > 1 else ''})\n",
        "python: bytecode caches written and read, as on a user's machine (PYTHONDONTWRITEBYTECODE unset)\n",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="record.py NAME [--runs K] [--copied-from COMMIT] -- COMMAND...")
    ap.add_argument("name")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--copied-from", metavar="COMMIT",
                    help="the tree is a copy, without git, of this commit's clean tree (checked where it was copied)")
    # Everything after the first -- is the command, its own flags included.
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        ap.error("give the command after --")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.name}.txt"
    worst = 0
    with path.open("w") as out:
        def emit(text: str) -> None:
            out.write(text)
            out.flush()
            sys.stdout.write(text)
            sys.stdout.flush()
        emit(header(command, args.runs, args.copied_from))
        for run in range(1, args.runs + 1):
            emit(f"\n--- run {run} of {args.runs}: load average before {loadavg()}\n")
            t0 = time.time()
            proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=user_env())
            for line in proc.stdout:
                emit(line)
            code = proc.wait()
            worst = worst or code
            emit(f"--- run {run}: exit code {code}, {time.time() - t0:.0f} s, load average after {loadavg()}\n")
    return worst


if __name__ == "__main__":
    sys.exit(main())
