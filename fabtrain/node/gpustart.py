"""Which GPUs a start takes on this node, and the leases (fabtrain/node/gpulease.py) that hold them.

The plan gives each rank of a `gpus: auto` node slots (`CUDA_VISIBLE_DEVICES=auto:0,auto:1`); a node
with a count or a list names physical GPUs. The node's first start of a job (node ops' `start`) leases:
for the slots, the first free GPUs of this node (no compute process, no other job's lease, no health flag),
written in place of the slots into job.json before any process starts; for named GPUs, those the
inventory knows, with a warning where one is flagged or in use. Too few free for the slots refuses the
start in one line naming who holds each busy GPU. The descriptors go to the agent (which hands them to
its keeper and to a restart's next generation) and to every launcher of that start, so the leases live
exactly as long as some process of the job does. Standard library only.
"""
import re

from fabtrain.contract.gpus import holder_text
from fabtrain.node import gpulease
from fabtrain.contract.replies import UserFacing

SLOT_RE = re.compile(r"^auto:(\d+)$")


def wanted(job: dict):
    """(the physical GPUs the node's processes name, how many `auto` slots they have)."""
    named, slots = set(), set()
    for p in job["processes"]:
        for part in (p.get("env") or {}).get("CUDA_VISIBLE_DEVICES", "").split(","):
            m = SLOT_RE.match(part.strip())
            if m:
                slots.add(int(m.group(1)))
            elif part.strip().isdigit():
                named.add(int(part))
    return sorted(named), (max(slots) + 1 if slots else 0)


def place(job: dict, chosen) -> None:
    """Put the leased GPUs in place of the slots in every process's CUDA_VISIBLE_DEVICES (job.json's too)."""
    job["gpus_auto"] = list(chosen)
    for p in job["processes"]:
        env = p.get("env") or {}
        if "CUDA_VISIBLE_DEVICES" in env:
            parts = [SLOT_RE.match(x.strip()) for x in env["CUDA_VISIBLE_DEVICES"].split(",")]
            if any(parts):
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(chosen[int(m.group(1))]) for m in parts if m)


def take(job: dict, earlier, environ=None):
    """({GPU index: descriptor} leased for this job, warnings); UserFacing if too few GPUs are free.

    `earlier`: the job.json this node already wrote for the job (a later `start-trainers`): its GPUs,
    already leased by the job's processes, are placed again and nothing is taken.
    """
    named, count = wanted(job)
    if isinstance(earlier, dict) and "gpu_leases" in earlier:
        if count:
            place(job, earlier.get("gpus_auto") or [])
        job["gpu_leases"] = earlier["gpu_leases"]
        return {}, []
    if not named and not count:
        return {}, []
    from fabtrain.node import gpuinv  # only for a job that asks for GPUs: it brings subprocess (nvidia-smi)

    inv = gpuinv.inventory(environ)
    gpus = {g["index"]: g for g in inv["gpus"]}
    held, warnings = {}, []
    try:
        if count:
            held.update(_take_free(job, gpus, count, named, inv, environ))
            place(job, sorted(held))
        for i in named:
            if i not in gpus:
                continue  # not a GPU this node knows (no driver): nothing to keep others off
            if gpus[i]["health"] or not gpus[i]["free"]:
                warnings.append("the job names %s" % holder_text(gpus[i]))
            got = gpulease.take([i], 1, environ)
            held.update(got or {})
    except OSError as e:
        gpulease.release(held)
        raise UserFacing("cannot lease GPUs: %s; nothing of job %s was started here"
                         % (e.strerror or e, job["job_id"]))
    job["gpu_leases"] = sorted(held)
    return held, warnings


def _take_free(job, gpus, count, named, inv, environ):
    from fabtrain.node import gpuinv

    if not gpus:
        raise UserFacing("gpus: auto cannot tell which GPUs are free: %s; nothing of job %s was started here"
                         % (inv.get("error") or "none found", job["job_id"]))
    free = [i for i in sorted(gpus) if gpus[i]["free"] and not gpus[i]["health"] and i not in named]
    got = gpulease.take(free, count, environ)
    if got is None:  # read again: another start may have leased some since
        now = gpuinv.inventory(environ)["gpus"] or list(gpus.values())
        busy = [holder_text(g) for g in now if not g["free"] or g["health"] or g["index"] in named]
        raise UserFacing("gpus: auto needs %d free GPU%s, %d of %d are free (%s); nothing of job %s was started here"
                         % (count, "" if count == 1 else "s", len(now) - len(busy), len(now), "; ".join(busy),
                            job["job_id"]))
    return got
