"""The next generation: an agent starts its own node's processes of the job again (on_failure restart).

The coordinator decided the restart; the policy said when (teardown done,
backoff over). This starts the job.json specs that ran here through the one
starter node ops uses (fabtrain/node/spawn.py), with FABTRAIN_RESTART_COUNT
and TORCHELASTIC_RESTART_COUNT set to the generation. Logs are appended to,
after a marker line, so one file keeps every generation; the previous
generation's exit records are removed first (the launcher writes a new one).
Under `min_nodes` the coordinator's status names the nodes that left (`out`):
each process starts with its world renumbered without them
(coordination/elastic.py), and a node that is itself out starts nothing.
Every generation gets its own MASTER_PORT (the start's + the generation; the
same place renumbers it), so no generation reuses another's rendezvous.
"""
from __future__ import annotations

import collections
import os
import time

from fabtrain.node import gpulease
from fabtrain.node.coordination.elastic import renumbered
from fabtrain.node.spawn import clear_exit, expand, name_programs, spawn

from . import checkpoints
from .supervisor import ProcessContext

PROGRAM_WAIT = 3.0  # as node ops: seconds to wait for each launcher to fork its program


def marker(generation: int, cause: str | None) -> str:
    """The line each log gets where a generation begins."""
    return "==== fabtrain: restart %d (FABTRAIN_RESTART_COUNT=%d) at %s: %s ====\n" % (
        generation, generation, time.strftime("%Y-%m-%d %H:%M:%S"), cause or "job failed")


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


# What a relaunch started: the new process contexts, the launchers to reap, the names, one line per failure.
# (collections, not typing.NamedTuple: importing typing is ~5 ms of every agent's start)
Generation = collections.namedtuple("Generation", "contexts launchers names errors")


def relaunch(contexts: list, job: dict, job_dir: str, workspace: str, generation: int, cause: str | None,
             out=()) -> Generation:
    """Start again what ran here as `generation`, in the world without the nodes in `out`."""
    specs = {p["name"]: dict(p, env=renumbered(job, p, out, generation)) for p in job.get("processes", [])}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FABTRAIN_")}
    fresh, started, errors = [], [], []
    for old in contexts:
        spec = specs[old.name]
        if not old.started or job["node"] in out:  # not started last time (left to fab), or this node left the job
            fresh.append(ProcessContext(spec, job_dir, workspace))
            continue
        clear_exit(job_dir, old.name)
        log = expand(spec["log"], workspace)
        try:
            with open(log, "a") as f:
                f.write(marker(generation, cause))
        except OSError:
            pass
        ctx = ProcessContext(spec, job_dir, workspace, records_from=_size(old.metrics_path))
        # what the generation before left of it: its last step, its checkpoints, what it loaded (checkpoints.py)
        ctx.generation, ctx.before = generation, checkpoints.summary(old)
        fresh.append(ctx)
        try:
            started.append(spawn(spec, workspace, base_env, generation, leases=gpulease.inherited()))
        except OSError as e:
            errors.append("cannot start %s: %s: %s" % (old.name, spec["launch"][0], e.strerror))
    name_programs(started, workspace, specs, time.time() + PROGRAM_WAIT)
    return Generation(fresh, [p for p, _ in started], [r["name"] for _, r in started], errors)
