"""The next generation: an agent starts its own node's processes of the job again (on_failure restart).

The coordinator decided the restart; the policy said when (teardown done,
backoff over). This starts the job.json specs that ran here through the one
starter node ops uses (fabtrain/node/spawn.py), with FABTRAIN_RESTART_COUNT
and TORCHELASTIC_RESTART_COUNT set to the generation. Logs are appended to,
after a marker line, so one file keeps every generation; the previous
generation's exit records are removed first (the launcher writes a new one).
Under `min_nodes` the coordinator's status names the nodes that left (`out`):
each process starts with its world renumbered without them
(coordination/elastic.py), and a node that is itself out starts nothing. A
spare starts its processes, never started before, once the status's
`stand_in` puts it in a lost node's slot.
Every generation gets its own MASTER_PORT (the start's + the generation; the
same place renumbers it), so no generation reuses another's rendezvous.
Each restarted process gets FABTRAIN_RESUME_FROM: the newest checkpoint its
family saved in the generations before (checkpoints.resume_path), or, where
the coordinator fell back from a damaged one (on_bad_checkpoint previous, its
status's `resume_from`), the checkpoint before it; unset where none is known.
"""
from __future__ import annotations

import collections
import os
import time

from fabtrain.contract import checkpoints as words
from fabtrain.contract.jobfolder import LOAD
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


def _remove(path: str | None) -> None:
    try:
        if path:
            os.unlink(path)
    except OSError:
        pass


# What a relaunch started: the new process contexts, the launchers to reap, the names, one line per failure.
# (collections, not typing.NamedTuple: importing typing is ~5 ms of every agent's start)
Generation = collections.namedtuple("Generation", "contexts launchers names errors")


def resume_env(ctx, env: dict, fallback: dict | None) -> dict:
    """`env` with FABTRAIN_RESUME_FROM for the restarted process `ctx` (its `before` from checkpoints.summary):
    the fallback's checkpoint for a trainer, or a process whose own newest is the damaged file; else its
    family's newest (the damaged file left out). Kept in ctx.before (`pointed`, `fallback`, `damaged`)."""
    before = ctx.before
    if fallback:
        damaged = fallback.get("instead_of")
        if damaged and damaged not in before["damaged"]:
            before["damaged"].append(damaged)
        if ctx.role == "trainer" or checkpoints.resume_path(dict(before, damaged=())) == damaged:
            before["fallback"] = fallback
    path = before["fallback"]["path"] if before.get("fallback") else checkpoints.resume_path(before)
    if not path:
        return env
    before["pointed"] = path
    return dict(env, **{words.RESUME_ENV: path})


def restarted(generation: int, names: list, fallback: dict | None) -> tuple:
    """The `restarted` event's (reason, fields): `generation 3: started trainer-0`, and the checkpoint it falls
    back to (`; generation 3 resumes from out/ckpt-1000.pt, the checkpoint before ...`)."""
    said = "generation %d: started %s" % (generation, ", ".join(names) or "nothing")
    if fallback:
        return "%s; %s" % (said, fallback.get("text")), {"generation": generation, "resume_from": fallback}
    return said, {"generation": generation}


def relaunch(contexts: list, job: dict, job_dir: str, workspace: str, generation: int, cause: str | None,
             status: dict, fallback: dict | None = None) -> Generation:
    """Start again what ran here as `generation`, in the world of the coordinator's `status` (without the nodes
    in its `out`, a spare in the slot of a node that left where its `stand_in` says). `fallback`: the
    coordinator's `resume_from` for this generation (on_bad_checkpoint previous), else None."""
    out, stand_in = status.get("out") or (), status.get("stand_in") or {}
    specs = {p["name"]: dict(p, env=renumbered(job, p, out, generation, stand_in)) for p in job.get("processes", [])}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FABTRAIN_")}
    fresh, started, errors = [], [], []
    for old in contexts:
        spec = specs[old.name]
        # Not started last time (left to fab) and no spare in a slot now, or this node left the job: nothing here.
        if (not old.started and job["node"] not in stand_in) or job["node"] in out:
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
        spec = dict(spec, env=resume_env(ctx, spec["env"], fallback))
        _remove(old.metrics_path and old.metrics_path + LOAD)  # the hook's loads: each generation's own
        fresh.append(ctx)
        try:
            started.append(spawn(spec, workspace, base_env, generation, leases=gpulease.inherited()))
        except OSError as e:
            errors.append("cannot start %s: %s: %s" % (old.name, spec["launch"][0], e.strerror))
    name_programs(started, workspace, specs, time.time() + PROGRAM_WAIT)
    return Generation(fresh, [p for p, _ in started], [r["name"] for _, r in started], errors)
