"""What `job.watchdog.min_nodes` (go on without a lost node) asks of a cluster, checked with the rest of cluster.yaml.

A smaller generation gets its world through the environment
(fabtrain/node/coordination/elastic.py renumbers it), so whatever fixes the
world's size on the command line at start is refused here, in one line. A
torchrun command gets each generation's --nnodes, --node-rank, --master-addr
and --master-port as torchrun's own PET_ variables (plan.torchrun_env, renumbered
the same way), so those flags, and a rendezvous of its own, are refused in it.
"""
from __future__ import annotations

import os
import shlex
import string
from typing import Callable

from fabtrain.config.launcher import is_torchrun
from fabtrain.errors import UserError

# Placeholders whose value depends on which nodes are in the job: a smaller generation cannot change them.
WORLD_PLACEHOLDERS = ("world_size", "num_gradient_servers", "rank", "trainer_id", "node_rank", "nnodes", "master_addr")


# torchrun's flags that fix its world or its rendezvous: under min_nodes each generation's come from fabtrain.
TORCHRUN_FIXED = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-backend", "--rdzv-endpoint",
                  "--rdzv-id", "--rdzv-conf", "--standalone")


def torchrun_world_flag(command: str) -> str | None:
    """The first of torchrun's own flags in `command` (up to its script: a .py, or the module after -m)
    that fixes its world at start, or None."""
    argv = shlex.split(command)
    words = argv[1:] if os.path.basename(argv[0]) == "torchrun" else argv[3:]
    for i, word in enumerate(words):
        if word.endswith(".py") or (i and words[i - 1] in ("-m", "--module")):
            return None
        flag = word.split("=")[0].replace("_", "-")
        if flag in TORCHRUN_FIXED:
            return flag
    return None


def elastic_settings(parser, w: dict, defaults) -> dict:
    """job.watchdog's min_nodes and max_rejoins, parsed (one line naming the key where one is wrong)."""
    return {"min_nodes": parser.integer(w["min_nodes"], "job.watchdog.min_nodes", 1, 1 << 20)
            if w.get("min_nodes") is not None else None,
            "max_rejoins": parser.integer(w.get("max_rejoins", defaults.max_rejoins), "job.watchdog.max_rejoins", 0, 1000)}


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
    if m > trainer_nodes and trainer_nodes:  # none at all: check_roles or check_spares says so
        raise fail(where, f"is {m}, but the cluster has {trainer_nodes} trainer node{'s' if trainer_nodes != 1 else ''}")
    if is_torchrun(job.trainer.command):
        fixed = torchrun_world_flag(job.trainer.command)
        if fixed:
            raise fail("job.trainer.command", f"{fixed} is fixed at start, but with job.watchdog.min_nodes fabtrain "
                                              f"gives torchrun each generation's --nnodes, --node-rank, --master-addr "
                                              f"and --master-port: leave {fixed} out")
    for field, command in (("job.trainer.command", job.trainer.command), ("job.pserver.command", job.pserver.command)):
        used = [f for _, f, _, _ in string.Formatter().parse(command) if f in WORLD_PLACEHOLDERS]
        if used:
            raise fail(field, f"{{{used[0]}}} is fixed at start, but with job.watchdog.min_nodes a generation "
                              f"may run on fewer nodes: read it from the environment instead")


def check_spares(cluster, fail: Callable[[str, str], UserError]) -> None:
    """`spare: true` on a node: a trainer node that runs nothing until it takes a lost node's place (min_nodes's
    mechanism: the board's stand_in, coordination/elastic.py). One line naming the node's key where it cannot be."""
    spares = [(i, n) for i, n in enumerate(cluster.nodes) if n.spare]
    if not spares:
        return
    i, node = spares[0]
    where = f"nodes[{i}].spare"
    if cluster.job.watchdog.min_nodes is None:
        raise fail(where, "needs job.watchdog.min_nodes: a spare takes the place of a trainer node that left the job")
    if cluster.kubernetes is not None or cluster.job.launcher == "mpirun":
        raise fail(where, "is for nodes: clusters whose agents start every rank; Kubernetes starts its pods and "
                          "mpirun its ranks themselves")
    for i, node in spares:
        where = f"nodes[{i}].spare"
        if i == 0:
            raise fail(where, f"{node.name} is the first node: the agents' coordinator lives there, so it is in the "
                              f"job from the start and cannot be a spare")
        if tuple(node.roles) != ("trainer",):
            raise fail(where, f"{node.name} has the roles {', '.join(node.roles)}: a spare has the trainer role only "
                              f"(it stands in for a trainer node)")
    if not cluster.trainer_nodes:
        raise fail(where, "every trainer node is a spare: at least one must run from the start")
