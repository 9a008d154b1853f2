"""Kubernetes pods (`fab export --k8s`): the job as manifests a person applies with `kubectl apply -f`.

fab reaches no pod itself: the pods start their own parts (fabtrain/node/pod.py)
from the manifests. Export writes them (controller/kubeexport.py). Status, logs
and kill-all ask `kubectl` about the pods and objects carrying the job's labels
(controller/kubectl.py); the verbs that need fab on the nodes are refused in one line.
"""
from __future__ import annotations

from typing import Callable

from fabtrain.backends.backend import Backend
from fabtrain.backends.results import Checked, Follow, JobStatus, NodeReplies, Planned, Started, Stopped, Written
from fabtrain.contract.states import KILLERS, STOP_GRACE
from fabtrain.errors import UserError
from fabtrain.remote.session import Session


def _needs_kubectl(verb: str) -> UserError:
    return UserError(f"fab {verb} on a kubernetes: cluster needs kubectl access to its pods, which fabtrain does "
                     f"not have yet: use `kubectl` on the objects `fab export --k8s` wrote")


class KubernetesBackend(Backend):
    NAME = "kubernetes"

    def export(self, session: Session, path: str, kind: str = "job") -> Written:
        """fab export --k8s DIR: one manifest a file, written only from the cluster file (no node is asked)."""
        from fabtrain.controller.kubeexport import export_kubernetes
        return Written([str(written) for written in export_kubernetes(session.cluster, path, kind=kind)])

    def plan(self, session: Session, offline: bool = False) -> Planned:
        raise UserError("fab plan on a kubernetes: cluster: `fab export --k8s DIR` writes what the pods would run")

    def check(self, session: Session, bandwidth: bool = False) -> Checked:
        raise _needs_kubectl("check")

    def deploy(self, session: Session) -> NodeReplies:
        raise UserError("fab deploy on a kubernetes: cluster: the pods run the job's image (job.image); "
                        "build and push it instead")

    def start(self, session: Session, roles: tuple[str, ...], force: bool = False, resume_from: str | None = None,
              no_wait: bool = False, progress: Callable[[str, bool], None] | None = None) -> Started:
        raise UserError("fab start on a kubernetes: cluster: `fab export --k8s DIR`, then `kubectl apply -f DIR`")

    def status(self, session: Session, job: str | None = None) -> JobStatus:
        from fabtrain.controller import kubectl
        text, failed = kubectl.status_text(session.cluster, kubectl.status(session.cluster, job), job)
        return JobStatus(pods=text, pods_failed=failed, problem="status: the job has failed pods")

    def watch(self, session: Session, job: str | None = None) -> Follow:
        raise _needs_kubectl("watch")

    def logs(self, session: Session, lines: int = 20, follow: bool = False, job: str | None = None,
             stacks: bool = False, out=None) -> NodeReplies:
        """kubectl's output goes to this process's own (kubectl streams it)."""
        if stacks:
            raise UserError("--stacks: not for pods yet (the stacks stay in each pod's workspace)")
        from fabtrain.controller import kubectl
        kubectl.logs(session.cluster, job, lines=lines, follow=follow)
        return NodeReplies([])

    def kill_all(self, session: Session, grace: float = STOP_GRACE, by: str = KILLERS[0]) -> Stopped:
        from fabtrain.controller import kubectl
        said = kubectl.kill_all(session.cluster, grace=grace)
        return Stopped(by, place=said or ["no object of this cluster was left to delete"])
