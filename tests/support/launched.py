"""Processes started as node ops start them (spawn, the real launcher), without a cluster around them; and a
program run through the launcher and its progress hook (`launched`): what the hook writes, and what the program
prints, with the hook and without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fabtrain.contract.launcher import SCRIPT, launch_command
from fabtrain.node import atomic, launch, progress
from tests.support import REPO


def make_job_dir(jd: str) -> str:
    """A job directory as a start leaves it: run/ and logs/, and the launcher script."""
    for sub in ("run", "logs"):
        os.makedirs(os.path.join(jd, sub))
    atomic.write(os.path.join(jd, SCRIPT), launch.source())
    return jd


def process_spec(jd: str, name: str, argv: list[str], env: dict | None = None) -> dict:
    """job.json's shape of one trainer process, launched with this interpreter."""
    return {"name": name, "role": "trainer", "rank": 0, "argv": argv, "env": env or {}, "cwd": jd,
            "launch": launch_command(sys.executable, jd, f"{jd}/run/{name}.exit", argv),
            "log": f"{jd}/logs/{name}.log", "run": f"{jd}/run/{name}.json"}


def plain_env() -> dict:
    """This process's environment without fabtrain's variables: what node ops hand to spawn."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FABTRAIN_")}


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hook_folder(jd: Path) -> Path:
    """The launcher's sitecustomize.py and the progress hook's files, in a job directory as node ops writes
    them: a program with this folder first on PYTHONPATH runs under the hook."""
    hook = Path(launch.hook_dir(str(jd)))
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(launch.STACK_HOOK)
    for name, text in progress.sources().items():
        (hook / name).write_text(text)
    return hook


def unlaunched_env() -> dict:
    """This process's environment without fabtrain's, Python's and a rank's variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("FABTRAIN_", "RANK", "LOCAL_RANK", "PYTHON"))}


def launched(tmp_path: Path, argv: list[str], metrics, **env) -> subprocess.CompletedProcess:
    """argv through the real launcher, in a job directory laid out as node ops lays it out."""
    jd = tmp_path / "job"
    hook_folder(jd)
    (jd / "run").mkdir(exist_ok=True)
    (jd / SCRIPT).write_text(launch.source())
    clean = unlaunched_env()
    clean.update(FABTRAIN_METRICS=str(metrics), FABTRAIN_RANK="0", **env)
    return subprocess.run([sys.executable, "-I", "-S", str(jd / SCRIPT), "--exit", str(jd / "run" / "t.exit"),
                           "--", sys.executable, *argv], cwd=REPO, env=clean, capture_output=True, text=True,
                          timeout=280)


def torch_exit_race(done: subprocess.CompletedProcess) -> bool:
    """A torchrun job that ended in torch's own abort at a rank's exit (pytorch/pytorch#190489, docs/progress.md:
    gloo's worker drops its last reference while the interpreter finalizes): a job run without the hook (a
    test's baseline) may end so after it did everything; the hook's exit wait makes it rare under the hook."""
    return done.returncode != 0 and "terminate called without an active exception" in done.stderr \
        and "exitcode  : -6" in done.stderr


def launched_at_once(*runs: tuple) -> list[subprocess.CompletedProcess]:
    """Several `launched` runs at once, each (tmp_path, argv, metrics, env), in their own folders and files;
    their results in the same order. For runs that are compared (with the hook and without it): what one does
    cannot change another's output, and their waits (imports, sleeps) overlap."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(launched, path, argv, metrics, **env) for path, argv, metrics, env in runs]
        return [f.result() for f in futures]
