"""The Slurm side of fab's tasks (fabtrain/tasks.py calls these when cluster.yaml has `scheduler:`).

Each prints what the person asked for; the work is in jobs.py. Everything
else (deploy, logs, watch, dashboard, history, export --tensorboard) needs
nothing of its own: the node stand-ins' workspaces are on the shared
filesystem and fab reads them as for SSH nodes.
"""
from __future__ import annotations

import sys

from invoke import Exit

from fabtrain.errors import UserError
from fabtrain.remote.session import Session
from fabtrain.slurm import jobs


def plan(session: Session) -> None:
    """The batch script as `fab start-trainers` would submit it, the plan's data summarised (ports drawn again at
    submit; `fab export --slurm` writes it whole)."""
    roles = ("pserver", "trainer") if session.cluster.job.mode == "pserver" else ("trainer",)
    print(jobs.prepare(session, roles, readable=True)[1], end="")


def export_script(session: Session, path: str) -> None:
    """fab export --slurm FILE: the batch script, to submit by hand with sbatch."""
    roles = ("pserver", "trainer") if session.cluster.job.mode == "pserver" else ("trainer",)
    plan_, script = jobs.prepare(session, roles)
    jobs.make_job_folder(session, plan_.job_id)
    try:
        with open(path, "w") as f:
            f.write(script)
    except OSError as e:
        raise UserError(f"--slurm {path}: {e.strerror}") from None
    print(f"{path}: job {plan_.job_id}, submit with: sbatch {path}")


def start(session: Session, roles: tuple[str, ...], no_wait: bool = False, resume_from: str | None = None,
          force: bool = False) -> None:
    submitted = jobs.submit(session, roles, resume_from=resume_from, force=force)
    print(jobs.describe(submitted), flush=True)
    if submitted.slurm_job is None or no_wait:
        return
    live = sys.stdout.isatty()

    def show(line: str, final: bool) -> None:
        if live:
            print(f"\r\033[K{line}", end="\n" if final else "", flush=True)
        else:
            print(line, flush=True)

    st = jobs.wait_for_allocation(session, submitted.slurm_job, show)
    if st.ended and st.state != "COMPLETED":
        raise Exit(f"job {submitted.job_id}: slurm job {submitted.slurm_job} ended {st.state} before it ran; "
                   "see `fab status`", code=1)


def status_line(session: Session, replies, job_id: str | None = None) -> str | None:
    """Slurm's state of the job `fab status` shows: its nodes say which Slurm job ran it (a script submitted
    by hand too); before it runs, the controller's state does. None: no Slurm job known."""
    ran = {(r.value["job_id"], r.value["slurm"]["job_id"]) for r in replies
           if r.ok and isinstance(r.value.get("slurm"), dict) and r.value["slurm"].get("job_id")}
    return jobs.shown_line(session, ran, job_id)


def kill_all(session: Session, grace: float) -> None:
    cancelled = jobs.cancel_all(session, grace=grace)
    if not cancelled.jobs:
        print("no Slurm job of this cluster is queued or running")
    for st in cancelled.jobs:
        print(st.line())
    if cancelled.left:
        raise Exit(f"kill-all: slurm job {', '.join(cancelled.left)} has not ended yet (see `squeue`)", code=1)


def check(session: Session) -> bool:
    problems = jobs.check_tools(session)
    problems += [] if problems else jobs.check_resources(session)
    nodes = None if problems else jobs.check_nodes(session)
    problems += nodes.problems if nodes else []
    spec = session.cluster.scheduler
    print(f"slurm: {spec.nodes} nodes, partition {spec.partition or '(default)'}, "
          f"commands {jobs.SlurmCommands(session).where()}: " + ("ok" if not problems else "PROBLEMS"))
    for p in problems:
        print(f"  {p}")
    if nodes and not problems:
        print(f"  {nodes.said}")
    return not problems
