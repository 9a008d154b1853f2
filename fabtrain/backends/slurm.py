"""A Slurm allocation (the cluster file's `scheduler:`): fab submits one batch script and Slurm places it.

Each verb returns what happened (results.py); the work is in fabtrain/slurm/
(script.py renders, jobs.py submits, reads Slurm's state and cancels).
Deploy, logs, status's table, watch and the dashboard read the node stand-ins'
workspaces on the shared filesystem as for SSH nodes (the Backend's own
verbs); this adds Slurm's word on the job to them.
"""
from __future__ import annotations

from typing import Callable

from fabtrain.backends.backend import Backend
from fabtrain.backends.results import Checked, Follow, JobStatus, Planned, Started, Stopped, Written
from fabtrain.contract.states import KILLERS
from fabtrain.controller import lifecycle, records
from fabtrain.errors import UserError
from fabtrain.remote.session import Session
from fabtrain.slurm import jobs


def _roles(session: Session) -> tuple[str, ...]:
    return ("pserver", "trainer") if session.cluster.job.mode == "pserver" else ("trainer",)


class SlurmBackend(Backend):
    NAME = "scheduler"

    def plan(self, session: Session, offline: bool = False) -> Planned:
        """The batch script as `fab start-trainers` would submit it, the plan's data summarised (an `auto` port as
        the token the allocation fills in; `fab export --slurm` writes it whole)."""
        return Planned(script=jobs.prepare(session, _roles(session), readable=True)[1])

    def export(self, session: Session, path: str, **options) -> Written:
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
        return Written([f"{path}: job {plan_.job_id}, submit with: sbatch {path}"])

    def check(self, session: Session, bandwidth: bool = False) -> Checked:
        """The nodes are not known before the allocation: Slurm's side instead of the network. The stand-ins
        are the login node's view of the shared workspace: its GPUs are not the allocation's."""
        checks = lifecycle.check(session, stand_ins=True)
        place, ok = self._check_slurm(session)
        return Checked(checks, place=place, place_ok=ok, problem="check: the job cannot run on this Slurm cluster")

    def _check_slurm(self, session: Session) -> tuple[list[str], bool]:
        problems = jobs.check_tools(session)
        problems += [] if problems else jobs.check_resources(session)
        nodes = None if problems else jobs.check_nodes(session)
        problems += nodes.problems if nodes else []
        spec = session.cluster.scheduler
        lines = [f"slurm: {spec.nodes} nodes, partition {spec.partition or '(default)'}, "
                 f"commands {jobs.SlurmCommands(session).where()}: " + ("ok" if not problems else "PROBLEMS")]
        lines += [f"  {p}" for p in problems]
        if nodes and not problems:
            lines.append(f"  {nodes.said}")
        return lines, not problems

    def start(self, session: Session, roles: tuple[str, ...], force: bool = False, resume_from: str | None = None,
              no_wait: bool = False, progress: Callable[[str, bool], None] | None = None) -> Started:
        """progress(line, final) hears the submission, then Slurm's state of the job until it runs or ends."""
        show = progress or (lambda line, final: None)
        submitted = jobs.submit(session, roles, resume_from=resume_from, force=force)
        show(jobs.describe(submitted), True)
        if submitted.slurm_job is None or no_wait:
            return Started(submitted.job_id, roles)
        st = jobs.wait_for_allocation(session, submitted.slurm_job, show)
        if st.ended and st.state != "COMPLETED":
            # Ended before a look saw it running: it may have run (a program that fails at once) or not.
            return Started(submitted.job_id, roles, problem=f"job {submitted.job_id}: slurm job {submitted.slurm_job} "
                                                             f"has already ended {st.state}; see `fab status`")
        return Started(submitted.job_id, roles)

    def kill_all(self, session: Session, grace: float, by: str = KILLERS[0]) -> Stopped:
        """scancel, pending jobs too; each node stops its own processes."""
        cancelled = jobs.cancel_all(session, grace=grace, by=by)
        place = [st.line() for st in cancelled.jobs] or ["no Slurm job of this cluster is queued or running"]
        left = f"kill-all: slurm job {', '.join(cancelled.left)} has not ended yet (see `squeue`)"
        return Stopped(by, place=place, problem=left if cancelled.left else None)

    # -- Slurm's word beside the nodes' ---------------------------------------------------------------

    def status(self, session: Session, job: str | None = None) -> JobStatus:
        replies = lifecycle.status(session, job_id=job, health=True)
        line = self._status_line(session, replies, job)
        if line and not any(r.ok and r.value.job_id for r in replies):  # submitted, and no node has it yet
            return JobStatus(replies, waiting=line)
        shown = self.nodes_status(session, replies, job, drawn_ports=lambda job_id: jobs.drawn_ports(session, job_id))
        shown.place = [line or "slurm: no job submitted from here"]
        return shown

    def _status_line(self, session: Session, replies, job_id: str | None) -> str | None:
        """Slurm's state of the job `fab status` shows: its nodes say which Slurm job ran it (a script submitted
        by hand too); before it runs, the controller's state does. None: no Slurm job known."""
        ran = {(r.value.job_id, records.slurm_job(r.value.slurm)) for r in replies
               if r.ok and records.slurm_job(r.value.slurm)}  # as the collector reads it for fab watch
        return jobs.shown_line(session, ran, job_id)

    def watch(self, session: Session, job: str | None = None) -> Follow:
        """Unnamed, the job submitted last, though it may still be queued; Slurm's state under it."""
        return Follow(job or jobs.submitted_job(session), jobs.ShownLine(session))
