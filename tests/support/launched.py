"""Processes started as node ops start them (spawn, the real launcher), without a cluster around them."""
from __future__ import annotations

import os
import sys

from fabtrain.contract.launcher import SCRIPT, launch_command
from fabtrain.node import atomic, launch


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
