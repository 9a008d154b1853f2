"""The one interface every place a job runs implements (SkyPilot's `sky/backends/backend.py` shape).

A Backend is chosen once, from the cluster file (`fabtrain.backends.backend_for`): fab's tasks
and the dashboard call its verbs and never ask which place they have. Each verb does what its
task does for that place, and prints what the person asked for, as the task would:

    plan      the exact commands the job would run, or the file that would be submitted
    check     can the job run there
    deploy    the job's code and fabtrain's node runtime where the nodes read them
    start     a new job (or its second half in pserver mode)
    status    every process of the job; exit 1 if one failed
    watch     follow the job until it ends: its exit code
    logs      the processes' logs
    kill_all  stop every process of the job
    export    the job as this place's own files (a batch script, manifests) for a person to submit

What is the same for places whose nodes have workspaces fab reaches (SSH and local nodes, a Slurm
allocation's stand-ins on the shared filesystem) is here; a place that differs overrides it.
"""
from __future__ import annotations

import sys

from typing import Callable

from invoke import Exit

from fabtrain.controller import lifecycle, report, state
from fabtrain.remote.session import Session


def fail_if(failed, message, code=1):
    if failed:
        raise Exit(message, code=code)


def replies_text(replies, ok_text):
    lines = [f"{r.node}: {ok_text(r.value)}" if r.ok else report.failed_line(r) for r in replies]
    return "\n".join(lines), any(not r.ok for r in replies)


class Backend:
    NAME = ""  # what the cluster file names it by (`nodes:`, `scheduler:`, `kubernetes:`)

    # -- verbs each place says for itself ----------------------------------------------------------

    def plan(self, session: Session, offline: bool = False) -> None:
        raise NotImplementedError

    def check(self, session: Session, bandwidth: bool = False) -> None:
        raise NotImplementedError

    def start(self, session: Session, roles: tuple[str, ...], force: bool = False, resume_from: str | None = None,
              no_wait: bool = False) -> None:
        raise NotImplementedError

    def kill_all(self, session: Session, grace: float) -> None:
        raise NotImplementedError

    def export(self, session: Session, path: str, **options) -> None:
        """The job as this place's own files at `path`; a place with none has no such verb."""
        raise NotImplementedError

    # -- verbs over the nodes' workspaces (the same wherever fab reaches them) ----------------------

    def deploy(self, session: Session) -> None:
        replies = lifecycle.deploy(session)
        text, failed = replies_text(replies, lambda v: f"code {report.code_text(v['code'])} synced ({v.get('files', 0)} files sent)")
        print(text)
        fail_if(failed, "deploy failed on some nodes")

    def status(self, session: Session, job: str | None = None) -> None:
        replies = lifecycle.status(session, job_id=job, health=True)
        waiting = self.waiting_line(session, replies, job)
        if waiting:  # submitted, and no node has it yet
            print(waiting)
            return
        lifecycle.require_job(replies, job)
        text, failed = report.status_text(replies)
        print(text)
        shown = {r.value.job_id for r in replies if r.ok and r.value.job_id}
        job_id = shown.pop() if len(shown) == 1 else None
        ports = state.recorded_ports(session.cluster.name, job_id) if job_id else None
        if ports:
            chosen = {k: v for k, v in ports.items() if k != "auto"}
            drawn = self.drawn_ports(session, job_id) if None in chosen.values() else {}
            chosen.update({k: drawn[k] for k, v in chosen.items() if v is None and k in drawn})
            print(report.ports_text(chosen, ports["auto"], drawn=drawn))
        for line in self.place_lines(session, replies, job):
            print(line)
        fail_if(failed, "status: the job has failed processes or unreachable nodes")

    def watch(self, session: Session, interval: float = 1.0, timeout: float | None = None,
              job: str | None = None) -> int:
        from fabtrain.controller.watch import watch as follow
        return follow(session, interval=interval, timeout=timeout, job_id=job or self.job_to_follow(session),
                      scheduler_line=self.scheduler_line(session))

    def logs(self, session: Session, lines: int = 20, follow: bool = False, job: str | None = None,
             stacks: bool = False) -> None:
        replies = lifecycle.logs(session, lines=lines, follow=follow, job_id=job, stacks=stacks)
        lifecycle.require_job(replies, job)
        for r in replies:
            if not r.ok:
                print(report.failed_line(r), file=sys.stderr)
        fail_if(any(not r.ok for r in replies), "logs: some nodes could not be read")

    # -- what a place adds to the shared verbs --------------------------------------------------------

    def waiting_line(self, session: Session, replies, job: str | None) -> str | None:
        """fab status's line for a job that no node has yet but the place still holds (queued), or None."""
        return None

    def place_lines(self, session: Session, replies, job: str | None) -> list[str]:
        """The place's own word on the job, under fab status's table."""
        return []

    def drawn_ports(self, session: Session, job_id: str) -> dict:
        """{setting: port} of the `auto` ports the place drew where the controller did not (a Slurm
        allocation), as far as it can tell now; {}: none."""
        return {}

    def job_to_follow(self, session: Session) -> str | None:
        """The job fab watch follows when none is named: None, the one the nodes run."""
        return None

    def scheduler_line(self, session: Session) -> Callable | None:
        """callable(snapshot) -> the place's own line on the job, for fab watch and the dashboard; None: none."""
        return None
