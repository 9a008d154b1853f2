"""Who starts the trainers: what `job.launcher: mpirun` asks of a cluster, checked with the rest of
cluster.yaml, and whether a trainer's command is torchrun's (the one test of it: the plan adds
torchrun's flags, or under job.watchdog.min_nodes its PET_ variables, each generation's; mpirun refuses it).

One `mpirun` on the first trainer node starts every rank over SSH, from a
hostfile of the trainer nodes' addresses (`slots` = job.trainer.per_node).
"""
from __future__ import annotations

import os
import shlex
from typing import Callable

from fabtrain.errors import UserError


def is_torchrun(command: str) -> bool:
    argv = shlex.split(command)
    if not argv:
        return False
    if os.path.basename(argv[0]) == "torchrun":
        return True
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] == "torch.distributed.run"


def check_launcher(cluster, fail: Callable[[str, str], UserError]) -> None:
    job = cluster.job
    if job.launcher != "mpirun":
        return
    if cluster.scheduler is not None:
        raise fail("job.launcher", "mpirun is not run inside a Slurm allocation: its ranks would start outside "
                                   "fabtrain's agents (no hang rule, no teardown); use launcher: fabtrain, which "
                                   "starts every rank under them")
    if job.mode != "collective":
        raise fail("job.launcher", "mpirun starts the ranks of a collective job: set job.mode: collective")
    if is_torchrun(job.trainer.command):
        raise fail("job.launcher", "mpirun and torchrun both start the ranks: give a command without torchrun")
    if job.watchdog.on_failure == "restart":
        raise fail("job.watchdog.on_failure", "restart is not possible with job.launcher: mpirun (mpirun starts the "
                                              "ranks, once); use kill-job or keep")
    seen: dict[str, str] = {}
    for n in cluster.trainer_nodes:
        if n.is_local:
            raise fail(f"nodes.{n.name}.host", "job.launcher: mpirun reaches every trainer node over SSH: "
                                               "give its address, not local")
        if n.address in seen:
            raise fail(f"nodes.{n.name}.address", f"same address as node {seen[n.address]!r}: mpirun's hostfile "
                                                  f"needs one address a trainer node")
        seen[n.address] = n.name
