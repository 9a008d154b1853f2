"""A Slurm allocation (the cluster file's `scheduler:`): fab submits one batch script and Slurm places it.

Each verb prints what the person asked for; the work is in fabtrain/slurm/
(script.py renders, jobs.py submits, reads Slurm's state and cancels).
Deploy, logs, status's table, watch and the dashboard read the node stand-ins'
workspaces on the shared filesystem as for SSH nodes (the Backend's own
verbs); this adds Slurm's word on the job to them.
"""
from __future__ import annotations

import sys

from invoke import Exit

from fabtrain.backends.backend import Backend, fail_if
from fabtrain.controller import lifecycle, records, report
from fabtrain.errors import UserError
from fabtrain.remote.session import Session
from fabtrain.slurm import jobs


def _roles(session: Session) -> tuple[str, ...]:
    return ("pserver", "trainer") if session.cluster.job.mode == "pserver" else ("trainer",)


class SlurmBackend(Backend):
    NAME = "scheduler"

    def plan(self, session: Session, offline: bool = False) -> None:
        """The batch script as `fab start-trainers` would submit it, the plan's data summarised (an `auto` port as
        the token the allocation fills in; `fab export --slurm` writes it whole)."""
        print(jobs.prepare(session, _roles(session), readable=True)[1], end="")

    def export(self, session: Session, path: str, **options) -> None:
        """fab export --slurm FILE: the batch script, to submit by hand with sbatch."""
        if not session.cluster.scheduler:
            raise UserError("--slurm: cluster.yaml has no scheduler section")
        plan_, script = jobs.prepare(session, _roles(session))
        jobs.make_job_folder(session, plan_.job_id)
        try:
            with open(path, "w") as f:
                f.write(script)
        except OSError as e:
            raise UserError(f"--slurm {path}: {e.strerror}") from None
        print(f"{path}: job {plan_.job_id}, submit with: sbatch {path}")

    def check(self, session: Session, bandwidth: bool = False) -> None:
        """The nodes are not known before the allocation: Slurm's side instead of the network."""
        checks = lifecycle.check(session)
        print(report.check_text(checks) + "\n")
        fail_if(not (self._check_slurm(session) and all(ch.ok for ch in checks)),
                "check: the job cannot run on this Slurm cluster")

    def _check_slurm(self, session: Session) -> bool:
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

    def start(self, session: Session, roles: tuple[str, ...], force: bool = False, resume_from: str | None = None,
              no_wait: bool = False) -> None:
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
            # Ended before a look saw it running: it may have run (a program that fails at once) or not.
            raise Exit(f"job {submitted.job_id}: slurm job {submitted.slurm_job} has already ended {st.state}; "
                       "see `fab status`", code=1)

    def kill_all(self, session: Session, grace: float) -> None:
        """scancel, pending jobs too; each node stops its own processes."""
        cancelled = jobs.cancel_all(session, grace=grace)
        if not cancelled.jobs:
            print("no Slurm job of this cluster is queued or running")
        for st in cancelled.jobs:
            print(st.line())
        if cancelled.left:
            raise Exit(f"kill-all: slurm job {', '.join(cancelled.left)} has not ended yet (see `squeue`)", code=1)

    # -- Slurm's word beside the nodes' ---------------------------------------------------------------

    def waiting_line(self, session: Session, replies, job: str | None) -> str | None:
        if any(r.ok and r.value.job_id for r in replies):
            return None
        return self._status_line(session, replies, job)

    def place_lines(self, session: Session, replies, job: str | None) -> list[str]:
        return [self._status_line(session, replies, job) or "slurm: no job submitted from here"]

    def _status_line(self, session: Session, replies, job_id: str | None) -> str | None:
        """Slurm's state of the job `fab status` shows: its nodes say which Slurm job ran it (a script submitted
        by hand too); before it runs, the controller's state does. None: no Slurm job known."""
        ran = {(r.value.job_id, records.slurm_job(r.value.slurm)) for r in replies
               if r.ok and records.slurm_job(r.value.slurm)}  # as the collector reads it for fab watch
        return jobs.shown_line(session, ran, job_id)

    def drawn_ports(self, session: Session, job_id: str) -> dict:
        return jobs.drawn_ports(session, job_id)

    def job_to_follow(self, session: Session) -> str | None:
        """The job submitted last, though it may still be queued."""
        return jobs.submitted_job(session)

    def scheduler_line(self, session: Session):
        return jobs.ShownLine(session)
