"""The one interface every place a job runs implements (SkyPilot's `sky/backends/backend.py` shape).

A Backend is chosen once, from the cluster file (`fabtrain.backends.backend_for`): fab's tasks
and the dashboard call its verbs and never ask which place they have. Each verb does what its
task does for that place and returns a typed record of it (results.py); it never prints and never
exits: the tasks say the records (controller/report.py words them), the dashboard serves them.

    plan       Planned    the exact commands the job would run, or the file that would be submitted
    check      Checked    can the job run there
    provision  NodeReplies  the nodes' workspaces (and venvs)
    deploy     NodeReplies  the job's code and fabtrain's node runtime where the nodes read them
    split_data            job.data.input split into one shard per trainer, on this machine
    copy_data  NodeReplies  each trainer's shards to its node
    start      Started    a new job (or its second half in pserver mode)
    status     JobStatus  every process of the job, and the place's word on it
    watch      Follow     the job to follow until it ends, and the place's own line on it
    logs       NodeReplies  the processes' logs, written to `out` as they come
    kill_all   Stopped    stop every process of the job
    export     Written    the job as this place's own files (a batch script, manifests) for a person to submit
    tensorboard           every trainer's metrics as TensorBoard files (controller/export.py's Exported)

What is the same for places whose nodes have workspaces fab reaches (SSH and local nodes, a Slurm
allocation's stand-ins on the shared filesystem) is here; a place that differs overrides it.
"""
from __future__ import annotations

from typing import Callable

from fabtrain.backends.results import Checked, Follow, JobStatus, NodeReplies, Planned, Started, Stopped, Written
from fabtrain.contract.states import KILLERS
from fabtrain.controller import lifecycle, state
from fabtrain.remote.session import Session


class Backend:
    NAME = ""  # what the cluster file names it by (`nodes:`, `scheduler:`, `kubernetes:`)

    # -- verbs each place says for itself ----------------------------------------------------------

    def plan(self, session: Session, offline: bool = False) -> Planned:
        raise NotImplementedError

    def check(self, session: Session, bandwidth: bool = False) -> Checked:
        raise NotImplementedError

    def start(self, session: Session, roles: tuple[str, ...], force: bool = False, resume_from: str | None = None,
              no_wait: bool = False, progress: Callable[[str, bool], None] | None = None) -> Started:
        """progress(line, final): what the start says while it goes on (a job queued, then running)."""
        raise NotImplementedError

    def kill_all(self, session: Session, grace: float, by: str = KILLERS[0]) -> Stopped:
        """`by`: who stops it (one of contract.states.KILLERS), as the job's events and state will say."""
        raise NotImplementedError

    def export(self, session: Session, path: str, **options) -> Written:
        """The job as this place's own files at `path`; a place with none has no such verb."""
        raise NotImplementedError

    # -- verbs over the nodes' workspaces (the same wherever fab reaches them) ----------------------

    def provision(self, session: Session, venv: bool = False, wheelhouse: str | None = None,
                  requirements: list[str] | None = None) -> NodeReplies:
        return NodeReplies(lifecycle.provision(session, venv=venv, wheelhouse=wheelhouse, requirements=requirements),
                           "provision failed on some nodes")

    def deploy(self, session: Session) -> NodeReplies:
        return NodeReplies(lifecycle.deploy(session), "deploy failed on some nodes")

    def split_data(self, session: Session, input: str | None = None, force: bool = False):
        """datacopy.split_data's result: made on this machine, wherever the nodes are."""
        from fabtrain.controller import datacopy
        return datacopy.split_data(session.cluster, input=input, force=force)

    def copy_data(self, session: Session, progress: Callable[[str], None] | None = None,
                  bwlimit: int | None = None) -> NodeReplies:
        from fabtrain.controller import datacopy
        return NodeReplies(datacopy.copy_data(session, progress=progress, bwlimit=bwlimit), "copy-data failed on some nodes")

    def status(self, session: Session, job: str | None = None) -> JobStatus:
        return self.nodes_status(session, lifecycle.status(session, job_id=job, health=True), job)

    def nodes_status(self, session: Session, replies, job: str | None,
                     drawn_ports: Callable[[str], dict] | None = None) -> JobStatus:
        """The nodes' replies and the job's ports; drawn_ports(job_id): {setting: port} of the `auto` ports the
        place drew where the controller did not (a Slurm allocation), as far as it can tell now."""
        lifecycle.require_job(replies, job)
        shown = {r.value.job_id for r in replies if r.ok and r.value.job_id}
        job_id = shown.pop() if len(shown) == 1 else None
        ports = state.recorded_ports(session.cluster.name, job_id) if job_id else None
        if not ports:
            return JobStatus(replies)
        chosen = {k: v for k, v in ports.items() if k != "auto"}
        drawn = drawn_ports(job_id) if drawn_ports and None in chosen.values() else {}
        chosen.update({k: drawn[k] for k, v in chosen.items() if v is None and k in drawn})
        return JobStatus(replies, ports=(chosen, ports["auto"], drawn))

    def watch(self, session: Session, job: str | None = None) -> Follow:
        return Follow(job)

    def tensorboard(self, session: Session, path: str, job: str | None = None):
        from fabtrain.controller.export import export_tensorboard
        return export_tensorboard(session, path, job_id=job)

    def logs(self, session: Session, lines: int = 20, follow: bool = False, job: str | None = None,
             stacks: bool = False, out=None) -> NodeReplies:
        replies = lifecycle.logs(session, lines=lines, follow=follow, job_id=job, stacks=stacks, out=out)
        lifecycle.require_job(replies, job)
        return NodeReplies(replies, "logs: some nodes could not be read")
