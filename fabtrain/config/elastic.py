"""What `job.watchdog.min_nodes` (go on without a lost node) asks of a cluster, checked with the rest of cluster.yaml.

A smaller generation gets its world through the environment
(fabtrain/node/coordination/elastic.py renumbers it), so whatever fixes the
world's size on the command line at start is refused here, in one line.
"""
from __future__ import annotations

import string
from typing import Callable

from fabtrain.config.launcher import is_torchrun
from fabtrain.errors import UserError

# Placeholders whose value depends on which nodes are in the job: a smaller generation cannot change them.
WORLD_PLACEHOLDERS = ("world_size", "num_gradient_servers", "rank", "trainer_id", "node_rank", "nnodes", "master_addr")


def check_min_nodes(cluster, fail: Callable[[str, str], UserError]) -> None:
    job = cluster.job
    m = job.watchdog.min_nodes
    if m is None:
        return
    where = "job.watchdog.min_nodes"
    if not job.watchdog.enabled:
        raise fail(where, "needs the watchdog: its agents restart the job on fewer nodes (job.watchdog.enabled: true)")
    if job.watchdog.on_failure != "restart":
        raise fail(where, "needs job.watchdog.on_failure: restart (the job goes on as a restart on fewer nodes)")
    if cluster.scheduler is not None:
        raise fail(where, "is for nodes: and dist_ips: clusters; Slurm ends the whole step when a node is lost")
    trainer_nodes = len(cluster.trainer_nodes)
    if m > trainer_nodes:
        raise fail(where, f"is {m}, but the cluster has {trainer_nodes} trainer node{'s' if trainer_nodes != 1 else ''}")
    if is_torchrun(job.trainer.command):
        raise fail(where, "not with a torchrun command: its --nnodes and --node-rank are fixed at start; "
                          "run the script itself (it gets RANK and WORLD_SIZE from fabtrain)")
    for field, command in (("job.trainer.command", job.trainer.command), ("job.pserver.command", job.pserver.command)):
        used = [f for _, f, _, _ in string.Formatter().parse(command) if f in WORLD_PLACEHOLDERS]
        if used:
            raise fail(field, f"{{{used[0]}}} is fixed at start, but with job.watchdog.min_nodes a generation "
                              f"may run on fewer nodes: read it from the environment instead")
