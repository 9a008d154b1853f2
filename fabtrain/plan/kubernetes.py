"""A job as Kubernetes manifests: a pure function of its Plan, as the Plan is of the Cluster.

`pod_cluster` turns the cluster into one pod per role and node: each pod is a
node of the plan, reached at its stable DNS name, so `make_plan` plans it as
any cluster (MASTER_ADDR, PADDLE_* endpoints and the coordinator's host are
those names). `manifests` renders that plan: a Secret with each pod's
job.json, a headless Service, and an Indexed Job per role (the pod's part is
picked by its completion index), or one Kubeflow PyTorchJob. In every pod
`python3 -m fabtrain.node.pod` starts its part through node ops' start, so the
launcher, the agent (hang rule, job-wide teardown) and the coordinator are
the ones SSH nodes run. Nothing here touches a cluster or a file.
"""
from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, replace

from fabtrain.contract.states import STOP_GRACE
from fabtrain.config.cluster import Cluster, JobSpec, Node, PserverSpec, SSHSettings, WatchdogSpec
from fabtrain.errors import UserError
from fabtrain.plan.plan import Network, Plan

KINDS = ("job", "pytorchjob")
WORKSPACE = "~/.fabtrain/pod"  # in the container's own file system: the pod is the node
JOB_FILES = "/etc/fabtrain"  # where the Secret with each pod's job.json is mounted
RUNTIME = "$WS/runtime/image"  # the agent runs from the image's own fabtrain (fabtrain.node.pod links it)
POD_IFACE = "eth0"  # a pod's one interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
NAME_MAX = 40  # room for "-trainer-<index>" in a pod's hostname (63)
LABEL = "fabtrain.io"


def dns_label(name: str) -> str:
    """A cluster name as an RFC 1035 label (Service names must be one): lower case, a letter first."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not label[:1].isalpha():
        label = f"ft-{label}"
    return label[:NAME_MAX].rstrip("-")


def pod_address(name: str, kind: str, role: str, index: int) -> str:
    """A pod's stable DNS name inside the namespace.

    An Indexed Job's pod is `<job>-<index>` under the Service named by its
    subdomain; the training operator gives each PyTorchJob replica a Service
    `<name>-master-0` / `<name>-worker-<i>`.
    """
    if kind == "pytorchjob":
        return f"{name}-master-0" if index == 0 else f"{name}-worker-{index - 1}"
    return f"{name}-{role}-{index}.{name}"


def check_kind(kind: str) -> str:
    """The kind of manifests asked for (--k8s-kind), or one line saying which there are."""
    if kind not in KINDS:
        raise UserError(f"--k8s-kind {kind}: must be one of {', '.join(KINDS)}")
    return kind


def pod_cluster(cluster: Cluster, kind: str = "job") -> Cluster:
    """The cluster whose nodes are the job's pods: `<role>-<index>`, one per role of each node."""
    check_kind(kind)
    job = cluster.job
    if kind == "pytorchjob" and job.mode != "collective":
        raise UserError(f"{cluster.path}: job.mode: --k8s-kind pytorchjob needs collective mode "
                        f"(a PyTorchJob has no parameter servers); use --k8s-kind job")
    name = dns_label(cluster.name)
    roles = ("pserver", "trainer") if job.mode == "pserver" else ("trainer",)
    pods = []
    for role in roles:
        for index, node in enumerate(n for n in cluster.nodes if role in n.roles):
            address = pod_address(name, kind, role, index)
            pods.append(Node(name=f"{role}-{index}", host=address.split(".")[0], roles=(role,), workspace=WORKSPACE,
                             python="python3", address=address, ssh=SSHSettings(), gpus=node.gpus, iface=POD_IFACE))
    return replace(cluster, nodes=tuple(pods))


def pod_network(cluster: Cluster) -> Network:
    """Each pod has its own network namespace: an `auto` port is simply the default one."""
    defaults = {"master_port": JobSpec.master_port, "pserver_port": PserverSpec.port,
                "watchdog_port": WatchdogSpec.port}
    given = {"master_port": cluster.job.master_port, "pserver_port": cluster.job.pserver.port,
             "watchdog_port": cluster.job.watchdog.port}
    return Network(ports={k: given[k] if given[k] is not None else defaults[k] for k in defaults},
                   ifaces={n.name: POD_IFACE for n in cluster.nodes})


@dataclass(frozen=True)
class PodSpec:
    """What the manifests need beyond the plan: the image, the kind, GPUs a pod by role, job.env."""
    image: str
    kind: str = "job"
    gpus: tuple[tuple[str, int], ...] = ()  # (role, nvidia.com/gpu a pod)
    env: tuple[tuple[str, str], ...] = ()


def pod_spec(cluster: Cluster, kind: str = "job") -> PodSpec:
    job = cluster.job
    if not job.image:
        raise UserError(f"{cluster.path}: job.image: missing; fab export --k8s needs the container image "
                        f"(python3, fabtrain and your job.code in it)")
    if job.launcher == "mpirun":
        raise UserError(f"{cluster.path}: job.launcher: mpirun is not exported to Kubernetes (pods have no SSH "
                        f"between them); export with job.launcher: fabtrain, or run MPI jobs with the MPI Operator")
    if job.watchdog.enabled and job.watchdog.min_nodes:
        raise UserError(f"{cluster.path}: job.watchdog.min_nodes is not exported to Kubernetes (going on without a "
                        f"lost node is built for SSH nodes, not pods); remove it for --k8s")
    gpus = max((n.gpus if n.gpus is not None else job.trainer.per_node for n in cluster.trainer_nodes), default=0)
    return PodSpec(image=job.image, kind=kind, gpus=(("trainer", gpus),) if job.trainer.use_gpu and gpus else (),
                   env=job.env)


def pod_job_json(plan: Plan, node: str) -> dict:
    """A pod's job.json: the node's, with the agent running from the image's fabtrain."""
    job = plan.job_json(node)
    job["agent"]["cwd"] = RUNTIME
    return job


def manifests(plan: Plan, spec: PodSpec) -> list[dict]:
    """Every object of the job, in the order `kubectl apply -f DIR` should create them."""
    name = dns_label(plan.cluster)
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": f"{name}-job", "labels": _labels(plan, name)}, "type": "Opaque",
              # job.json holds the coordinator's secret: a Secret, never a ConfigMap.
              "stringData": {f"{n.node}.json": json.dumps(pod_job_json(plan, n.node), indent=1, sort_keys=True)
                             for n in plan.nodes}}
    if spec.kind == "pytorchjob":
        return [secret, _pytorchjob(plan, spec, name)]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": _labels(plan, name)},
               # Headless, and published before readiness: the pods find each other while they start.
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {f"{LABEL}/cluster": name}}}
    roles = list(dict.fromkeys(n.processes[0].role for n in plan.nodes if n.processes))
    return [secret, service] + [_indexed_job(plan, spec, name, role) for role in roles]


def _labels(plan: Plan, name: str, role: str | None = None) -> dict:
    labels = {f"{LABEL}/cluster": name, f"{LABEL}/job-id": plan.job_id}
    return labels | ({f"{LABEL}/role": role} if role else {})


def _pods(plan: Plan, role: str) -> list:
    return [n for n in plan.nodes if n.processes and n.processes[0].role == role]


def _pod_template(plan: Plan, spec: PodSpec, name: str, role: str, index_env: str, container: str) -> dict:
    ports = sorted({p for u in plan.listens if u.node in {n.node for n in _pods(plan, role)} for p in u.ports})
    gpus = dict(spec.gpus).get(role, 0)
    box = {"name": container, "image": spec.image,
           "command": ["python3", "-m", "fabtrain.node.pod", JOB_FILES, role, "--index-env", index_env],
           "volumeMounts": [{"name": "job", "mountPath": JOB_FILES, "readOnly": True}]}
    if spec.env:
        box["env"] = [{"name": k, "value": v} for k, v in spec.env]
    if ports:
        box["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in ports]
    if gpus:
        box["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}  # a Quantity, as the API writes it
    pod = {"restartPolicy": "Never", "containers": [box],
           # fabtrain.node.pod stops the pod's processes on SIGTERM: the agents' grace, and time to report.
           "terminationGracePeriodSeconds": math.ceil(plan.watchdog.get("grace", STOP_GRACE)) + 10,
           "volumes": [{"name": "job", "secret": {"secretName": f"{name}-job", "defaultMode": 0o400}}]}
    return {"metadata": {"labels": _labels(plan, name, role)}, "spec": pod}


def _indexed_job(plan: Plan, spec: PodSpec, name: str, role: str) -> dict:
    count = len(_pods(plan, role))
    template = _pod_template(plan, spec, name, role, "JOB_COMPLETION_INDEX", role)
    template["spec"]["subdomain"] = name  # with the Service: <job>-<index>.<name> resolves to the pod
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{name}-{role}", "labels": _labels(plan, name, role)},
            "spec": {"completionMode": "Indexed", "completions": count, "parallelism": count,
                     # A pod that fails ends its Job; the agents have already torn the whole job down.
                     "backoffLimit": 0,
                     "podFailurePolicy": {"rules": [{"action": "FailJob",
                                                     "onExitCodes": {"operator": "NotIn", "values": [0]}}]},
                     "template": template}}


def _pytorchjob(plan: Plan, spec: PodSpec, name: str) -> dict:
    template = _pod_template(plan, spec, name, "trainer", "RANK", "pytorch")
    # The operator sets MASTER_PORT from this port; the plan's is the same one.
    template["spec"]["containers"][0]["ports"] = [{"containerPort": plan.ports["master_port"],
                                                   "name": "pytorchjob-port", "protocol": "TCP"}]
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if len(plan.nodes) > 1:
        replicas["Worker"] = {"replicas": len(plan.nodes) - 1, "restartPolicy": "Never", "template": copy.deepcopy(template)}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "labels": _labels(plan, name)},
            "spec": {"runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"}, "pytorchReplicaSpecs": replicas}}
