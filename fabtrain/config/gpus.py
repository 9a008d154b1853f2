"""A node's GPUs in cluster.yaml: a count (`gpus: 4`, indices 0..3), the physical indices (`gpus: [2, 3]`),
or `auto`: the node's free GPUs, chosen and leased by node ops' start (fabtrain/node/gpustart.py).

With `job.trainer.use_gpu`, local rank r of a node sees `gpus_per_rank` of its GPUs in CUDA_VISIBLE_DEVICES:
the r-th group of the node's list. Where a node's list is given, the groups must fit in it; a bare count
keeps the older wrap-around (local rank mod count), so existing files mean what they meant.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from fabtrain.config.checks import INVALID, kind_of, reported, valid

MAX_GPU_INDEX = 1023
AUTO = "auto"
AUTO_SLOT = "auto:%d"  # CUDA_VISIBLE_DEVICES of an auto node's rank, until node ops' start puts the GPUs it leased


@reported
def parse_gpus(checks, value: Any, where: str) -> tuple[int | None, tuple[int, ...] | None, bool]:
    """(count, physical indices or None for 0..count-1, auto); a mistake is reported on its line (INVALID)."""
    if value == AUTO:
        return None, None, True
    if isinstance(value, list):
        if not value:
            raise checks.fail(where, "must list at least one GPU index, like [2, 3]")
        ids = tuple(checks.integer(v, f"{where}[{i}]", 0, MAX_GPU_INDEX) for i, v in enumerate(value))
        if not valid(*ids):
            return INVALID
        if len(set(ids)) != len(ids):
            twice = next(i for i in ids if ids.count(i) > 1)
            raise checks.fail(where, f"lists GPU {twice} twice")
        return len(ids), ids, False
    if isinstance(value, bool) or not isinstance(value, int):
        raise checks.fail(where, "must be a number of GPUs, a list of GPU indices like [2, 3] or auto, "
                                 f"got {kind_of(value)}")
    count = checks.integer(value, where, 0, MAX_GPU_INDEX + 1)
    return (count, None, False) if valid(count) else INVALID


def per_node_given(doc: Any) -> bool:
    """Whether the file sets job.trainer.per_node (else it defaults to what the nodes' GPUs fit)."""
    job = doc.get("job") if isinstance(doc, dict) else None
    trainer = job.get("trainer") if isinstance(job, dict) else None
    return isinstance(trainer, dict) and "per_node" in trainer


def fit_gpus(cluster, given: bool, fail):
    """The cluster with per_node set to what fits when not given; a listed node too small is refused."""
    trainer = cluster.job.trainer
    if not trainer.use_gpu:
        return cluster
    sized = [n for n in cluster.trainer_nodes if n.gpus]
    if not given and sized:
        fits = max(1, min(n.gpus // trainer.gpus_per_rank for n in sized))
        cluster = dataclasses.replace(
            cluster, job=dataclasses.replace(cluster.job, trainer=dataclasses.replace(trainer, per_node=fits)))
        trainer = cluster.job.trainer
    for i, n in enumerate(cluster.nodes):
        # A spare (not sized above: the world is the trainer nodes') must hold a slot's ranks, as a count or a list.
        have = len(n.gpu_ids) if n.gpu_ids is not None else n.gpus if n.spare else None
        if (n in cluster.trainer_nodes or n.spare) and have is not None:
            need = trainer.per_node * trainer.gpus_per_rank
            if need > have:
                raise fail("job.trainer.per_node",
                           f"{trainer.per_node} ranks x {trainer.gpus_per_rank} GPUs need {need} GPUs, "
                           f"node {n.name} {'lists' if n.gpu_ids is not None else 'has'} {have}")
    return cluster


def visible_devices(node, local_rank: int, gpus_per_rank: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for `local_rank` on `node`: its group of the node's GPUs; None: node's GPUs unknown.

    On a `gpus: auto` node the group is of slots (`auto:0,auto:1`): node ops' start leases that many free
    GPUs and writes their indices in place of the slots into job.json, before any process starts."""
    first = local_rank * gpus_per_rank
    if node.gpu_auto:
        return ",".join(AUTO_SLOT % (first + k) for k in range(gpus_per_rank))
    if not node.gpus:
        return None
    ids = node.gpu_ids if node.gpu_ids is not None else tuple(range(node.gpus))
    return ",".join(str(ids[(first + k) % len(ids)]) for k in range(gpus_per_rank))
