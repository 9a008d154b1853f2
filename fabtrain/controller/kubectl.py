"""The job's pods through `kubectl`: what `fab status`, `fab logs` and `fab kill-all` do on a cluster file
with a `kubernetes:` section (the pods `fab export --k8s` rendered).

Plain functions of the Cluster, so a backend can call them: `status`, `logs`,
`kill_all`. Each runs kubectl with the section's --context and --namespace,
selects the job's objects by their labels (fabtrain.io/cluster, and
fabtrain.io/job-id: the newest job unless one is named), and never puts a
value through a shell. kubectl's own credentials (kubeconfig) are its business.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from fabtrain.config.cluster import Cluster
from fabtrain.contract.states import STOP_GRACE
from fabtrain.errors import UserError
from fabtrain.plan.kubernetes import AGENTS_FAILED, LABEL, dns_label

KUBECTL = "kubectl"
# What kill-all deletes, workloads first (their pods go with them); a kind the cluster does not serve
# (no JobSet or training operator installed) is skipped.
KINDS = ("jobsets.jobset.x-k8s.io", "pytorchjobs.kubeflow.org", "jobs.batch", "services", "secrets")
INDEX_KEYS = ("batch.kubernetes.io/job-completion-index", "training.kubeflow.org/replica-index")


def argv(cluster: Cluster, *args: str) -> list[str]:
    spec = cluster.kubernetes
    out = [KUBECTL]
    if spec and spec.context:
        out += ["--context", spec.context]
    if spec and spec.namespace:
        out += ["--namespace", spec.namespace]
    return out + list(args)


def kubectl(cluster: Cluster, *args: str, timeout: float = 60) -> str:
    """kubectl's stdout; its refusal as one line."""
    try:
        out = subprocess.run(argv(cluster, *args), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise UserError(f"kubectl: not found on PATH (cluster.yaml has a kubernetes: section); install your "
                        f"cluster's kubectl (or `make system-deps`)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"kubectl {args[0]}: no answer in {timeout:g} s (is the cluster reachable?)") from None
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}").splitlines()[-1]
        raise UserError(f"kubectl {args[0]}: {said}")
    return out.stdout


def selector(cluster: Cluster, job_id: str | None = None) -> str:
    return f"{LABEL}/cluster={dns_label(cluster.name)}" + (f",{LABEL}/job-id={job_id}" if job_id else "")


@dataclass(frozen=True)
class PodState:
    name: str
    role: str
    index: str
    job_id: str
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    detail: str  # what the pod's container is doing, or how it ended
    failed: bool  # ended by the job's failure (not by a stop, not by a disruption)


def pod_state(item: dict) -> PodState:
    meta, status = item.get("metadata", {}), item.get("status", {})
    labels = meta.get("labels", {})
    keys = {**meta.get("annotations", {}), **labels}
    index = next((keys[k] for k in INDEX_KEYS if k in keys), "?")
    phase = status.get("phase", "Unknown")
    disruption = next((c for c in status.get("conditions", []) if c.get("type") == "DisruptionTarget"
                       and c.get("status") == "True"), None)
    states = [c.get("state", {}) for c in status.get("containerStatuses", [])]
    state = states[0] if states else {}
    code = state.get("terminated", {}).get("exitCode")
    if disruption:
        detail = f"disrupted ({disruption.get('reason', 'DisruptionTarget')}): Kubernetes starts another in its place"
    elif "running" in state:
        detail = "running" + (f" on {item['spec']['nodeName']}" if item.get("spec", {}).get("nodeName") else "")
    elif "waiting" in state:
        detail = f"waiting: {state['waiting'].get('reason', '')}".rstrip(": ")
    elif code is not None:
        meaning = {0: "finished", AGENTS_FAILED: "the job failed", 143: "stopped"}.get(code, state["terminated"].get("reason", "ended"))
        detail = f"exited {code} ({meaning})"
    else:
        detail = phase.lower()
    failed = phase == "Failed" and not disruption and code != 143
    return PodState(name=meta.get("name", "?"), role=labels.get(f"{LABEL}/role", "?"), index=index,
                    job_id=labels.get(f"{LABEL}/job-id", "?"), phase=phase, detail=detail, failed=failed)


def status(cluster: Cluster, job_id: str | None = None) -> list[PodState]:
    """The pods of the job (the newest of the cluster's when none is named), role by role, index by index."""
    listed = json.loads(kubectl(cluster, "get", "pods", "-l", selector(cluster, job_id), "-o", "json"))
    pods = [pod_state(item) for item in listed.get("items", [])]
    if not job_id and pods:
        newest = max(p.job_id for p in pods)  # job ids sort by their start
        pods = [p for p in pods if p.job_id == newest]
    return sorted(pods, key=lambda p: (p.role != "pserver", p.role, int(p.index) if p.index.isdigit() else 0, p.name))


def status_text(cluster: Cluster, pods: list[PodState], job_id: str | None = None) -> tuple[str, bool]:
    """(what `fab status` prints, whether a pod failed)."""
    if not pods:
        where = f" in namespace {cluster.kubernetes.namespace}" if cluster.kubernetes and cluster.kubernetes.namespace else ""
        raise UserError(f"kubectl: no pods of {'job ' + job_id if job_id else 'cluster ' + cluster.name}{where} "
                        f"(selector {selector(cluster, job_id)})")
    lines = [f"job {pods[0].job_id}: {len(pods)} pods (kubectl)"]
    width = max(len(p.name) for p in pods)
    for p in pods:
        lines.append(f"  {p.name:<{width}}  {p.role}-{p.index}  {'FAILED ' if p.failed else ''}{p.detail}")
    return "\n".join(lines), any(p.failed for p in pods)


def logs(cluster: Cluster, job_id: str | None = None, lines: int = 20, follow: bool = False) -> None:
    """Every pod's output (each line already says [node process]), prefixed by kubectl with the pod; streamed."""
    pods = status(cluster, job_id)
    if not pods:
        raise UserError(f"kubectl: no pods of {'job ' + job_id if job_id else 'cluster ' + cluster.name}")
    args = ["logs", "-l", selector(cluster, pods[0].job_id), "--prefix", "--tail", str(lines),
            "--max-log-requests", str(max(5, len(pods)))] + (["--follow"] if follow else [])
    try:
        code = subprocess.run(argv(cluster, *args)).returncode
    except FileNotFoundError:
        raise UserError("kubectl: not found on PATH") from None
    if code != 0:
        raise UserError(f"kubectl logs: exit {code} (see above)")


def kill_all(cluster: Cluster, grace: float = STOP_GRACE) -> list[str]:
    """Delete every object of the cluster's jobs (their pods stop as `fab kill-all` stops processes: SIGTERM,
    the agents' grace, SIGKILL); wait until no pod is left. kubectl's lines, one an object."""
    said = []
    for kind in KINDS:
        try:
            out = kubectl(cluster, "delete", kind, "-l", selector(cluster), "--ignore-not-found", "--wait=false")
        except UserError as e:
            if "the server doesn't have a resource type" in str(e):
                continue
            raise
        said += [line for line in out.splitlines() if line.strip()]
    try:
        kubectl(cluster, "wait", "--for=delete", "pods", "-l", selector(cluster), f"--timeout={int(grace) + 60}s",
                timeout=grace + 90)
    except UserError as e:
        if "no matching resources found" not in str(e):
            raise
    return said
