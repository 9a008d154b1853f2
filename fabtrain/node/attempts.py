"""Slurm attempts: a requeued job (SLURM_RESTART_COUNT > 0) is the next attempt of the same fabtrain job.

Slurm runs a requeued batch script again with the same job id, so every node
finds its job folder as the last attempt left it. `begin` makes that folder
the start of a new attempt before node ops' start runs there: what belongs to
one attempt (its events, the coordinator's state, health, run records and
exit files, the `killed` mark, metrics) moves to ``attempts/<K>/`` of the job
folder, so the agents and the coordinator start fresh and nothing of the old
attempt's end is read as the new one's. The checkpoints, the code snapshot
and the logs (a marker line between attempts) stay: the programs resume from
FABTRAIN_CHECKPOINT_DIR, started with FABTRAIN_RESTART_COUNT and
TORCHELASTIC_RESTART_COUNT set to the attempt. The new events.jsonl begins
with an `attempt` event ("attempt 2 of 4: requeued after preemption"); past
`scheduler.requeue` attempts, with a `job_failed` one that says so.

Why the last attempt ended: Slurm's own line in the job's output
(``*** JOB 7 ON n1 CANCELLED AT ... DUE TO PREEMPTION ***``), or the batch
shell's ``requeue-cause-<K>`` file when it requeued for the time limit itself.
Standard library only.
"""
import os
import time

from fabtrain.contract.events import EventKind
from fabtrain.contract import jobfolder
from fabtrain.contract.jobfolder import JobFolder, SlurmFolder
from fabtrain.contract.slurm import DUE_RE, NODE_FAILURE_RE
from fabtrain.node import atomic
from fabtrain.node.killevents import append_events
from fabtrain.node.workspace import make_private_dirs

PER_ATTEMPT = (jobfolder.EVENTS, jobfolder.COORDINATOR, jobfolder.HEALTH, jobfolder.KILLED, jobfolder.RUN,
               jobfolder.METRICS)
CAUSES = {"PREEMPTION": "requeued after preemption (preempted by Slurm)",
          "JOB REQUEUE": "requeued by scontrol requeue",
          "NODE FAILURE": "requeued after a node failed (NODE_FAIL)",
          "TIME LIMIT": "requeued at the time limit"}


def attempt_of(environ):
    """The Slurm attempt this is, from 1 (SLURM_RESTART_COUNT + 1)."""
    count = environ.get("SLURM_RESTART_COUNT", "")
    return int(count) + 1 if count.isdigit() else 1


def cause(folder, slurm_job, attempt):
    """Why the last attempt ended, as `attempt` says it."""
    try:
        with open(SlurmFolder(folder).cause(attempt)) as f:
            said = f.read().strip()
        if said:
            return "requeued at the " + said
    except OSError:
        pass
    found, lost = None, None
    try:
        with open(SlurmFolder(folder).output(slurm_job), errors="replace") as f:
            for text in f:
                m = DUE_RE.search(text) or NODE_FAILURE_RE.search(text)
                if m and m.re is DUE_RE:
                    found = m
                elif m:
                    lost = m.group(1)
    except OSError:
        pass
    if found is None:
        return "requeued by Slurm"
    if found.group(2) == "NODE FAILURE" and lost:
        return "requeued after node %s failed (NODE_FAIL)" % lost
    return CAUSES.get(found.group(2), "requeued by Slurm (%s)" % found.group(2).lower())




def line(attempt, allowed, why):
    return "attempt %d of %d: %s" % (attempt, allowed, why)


def begin(jd, node, attempt, allowed, why):
    """Make the job folder `jd` the start of `attempt` (of `allowed`); the line said, or None for a first
    attempt. Past `allowed`, the job fails here and the caller starts nothing (refused: True)."""
    if attempt <= 1:
        return None, False
    if os.path.isdir(jd):
        archive = os.path.join(JobFolder(jd).attempts, str(attempt - 1))
        make_private_dirs(JobFolder(jd).attempts, archive)
        for name in PER_ATTEMPT:
            try:
                os.replace(os.path.join(jd, name), os.path.join(archive, name))
            except FileNotFoundError:
                pass
    else:
        make_private_dirs(jd)
    said = line(attempt, allowed, why)
    events = [{"ts": round(time.time(), 3), "node": node, "kind": EventKind.ATTEMPT.value, "attempt": attempt,
               "attempts": allowed, "reason": said}]
    refused = attempt > allowed
    if refused:
        events.append({"ts": round(time.time(), 3), "node": node, "kind": EventKind.JOB_FAILED.value,
                       "origin": node,
                       "reason": "Slurm started attempt %d, but scheduler.requeue allows %d attempts (%s)"
                                 % (attempt, allowed, why)})
    append_events(JobFolder(jd).events, events)
    logs = JobFolder(jd).logs
    for entry in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        try:
            with open(os.path.join(logs, entry), "a") as f:
                f.write("==== fabtrain: %s (FABTRAIN_RESTART_COUNT=%d) at %s ====\n"
                        % (said, attempt - 1, time.strftime("%Y-%m-%d %H:%M:%S")))
        except OSError:
            pass
    return said, refused


def record(folder, attempt, allowed, said):
    """The attempt now running, for the controller (every node writes the same, atomically)."""
    atomic.write_json(SlurmFolder(folder).attempt, {"attempt": attempt, "attempts": allowed, "line": said})


def restarts_before(job, attempt):
    """Each process of the job starts with FABTRAIN_RESTART_COUNT (and torchrun's) counting the attempts
    before this one (spawn.prepare adds the agents' own generations to it)."""
    for proc in job["processes"]:
        proc["restarts_before"] = attempt - 1
