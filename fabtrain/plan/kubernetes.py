"""A job as Kubernetes manifests: a pure function of its Plan, as the Plan is of the Cluster.

`pod_cluster` turns the cluster into one pod per role and node: each pod is a
node of the plan, reached at its stable DNS name, so `make_plan` plans it as
any cluster (MASTER_ADDR, PADDLE_* endpoints and the coordinator's host are
those names). `manifests` renders that plan: a Secret with one job spec (a
template per role that each pod fills in with its completion index,
fabtrain/node/podpart.py: the same size at 4 pods and at 1,000) and the
agents' secret, a headless Service, and an Indexed Job per role; or one
JobSet (gang admission, Kueue); or one Kubeflow PyTorchJob. In every pod
`python3 -m fabtrain.node.pod` starts its part through node ops' start, so the
launcher, the agent (hang rule, job-wide teardown) and the coordinator are
the ones SSH nodes run. Every object's name and labels carry the job id.
Nothing here touches a cluster or a file.
"""
from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, replace

from fabtrain.contract.jobfolder import JOB
from fabtrain.contract.states import STOP_GRACE
from fabtrain.config.cluster import Cluster, JobSpec, Node, PserverSpec, SSHSettings, WatchdogSpec
from fabtrain.config.kubernetes import KubernetesSpec, PodResources, Volume, shm_size
from fabtrain.errors import UserError
from fabtrain.plan.plan import Network, Plan

KINDS = ("job", "jobset", "pytorchjob")
WORKSPACE = "/fabtrain"  # an emptyDir the pod's user owns (fsGroup): the pod is the node
JOB_FILES = "/etc/fabtrain"  # where the Secret (job.json: the job spec; secret: the agents') is mounted
RUNTIME = "$WS/runtime/image"  # the agent runs from the image's own fabtrain (fabtrain.node.pod links it)
POD_IFACE = "eth0"  # a pod's one interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
DNS_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
NAME_MAX = 22  # with "-<job id>" (21) and "-trainer-0-<index>", a pod's hostname stays within 63
LABEL = "fabtrain.io"


def dns_label(name: str) -> str:
    """A cluster name as an RFC 1035 label (Service names must be one): lower case, a letter first."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not label[:1].isalpha():
        label = f"ft-{label}"
    return label[:NAME_MAX].rstrip("-")


def object_name(cluster_name: str, job_id: str) -> str:
    """The name every object of the job starts with: the cluster's, and the job id, so two exports never collide."""
    return f"{dns_label(cluster_name)}-{job_id}"


def pod_address(name: str, kind: str, role: str, index: int) -> str:
    """A pod's stable DNS name inside the namespace.

    An Indexed Job's pod is `<job>-<index>` under the Service named by its
    subdomain; a JobSet's, `<jobset>-<replicated job>-<job index>-<index>`
    under the Service JobSet makes (named as the JobSet); the training
    operator gives each PyTorchJob replica a Service `<name>-master-0` /
    `<name>-worker-<i>`.
    """
    if kind == "pytorchjob":
        return f"{name}-master-0" if index == 0 else f"{name}-worker-{index - 1}"
    prefix, suffix = _address_parts(name, kind, role)
    return f"{prefix}{index}{suffix}"


def _address_parts(name: str, kind: str, role: str) -> tuple[str, str]:
    """What comes before and after the index in the address of a role's pod (an Indexed Job's or a JobSet's)."""
    return (f"{name}-{role}-0-" if kind == "jobset" else f"{name}-{role}-"), f".{name}"


def check_kind(kind: str) -> str:
    """The kind of manifests asked for (--k8s-kind), or one line saying which there are."""
    if kind not in KINDS:
        raise UserError(f"--k8s-kind {kind}: must be one of {', '.join(KINDS)}")
    return kind


def pod_cluster(cluster: Cluster, job_id: str, kind: str = "job") -> Cluster:
    """The cluster whose nodes are the job's pods: `<role>-<index>`, one per role of each node.

    Every pod of a role is alike (one pod template): the GPUs Kubernetes gives
    it are numbered from 0 in the container, however many the node has.
    """
    check_kind(kind)
    job = cluster.job
    if kind == "pytorchjob" and job.mode != "collective":
        raise UserError(f"{cluster.path}: job.mode: --k8s-kind pytorchjob needs collective mode "
                        f"(a PyTorchJob has no parameter servers); use --k8s-kind job")
    name = object_name(cluster.name, job_id)
    roles = ("pserver", "trainer") if job.mode == "pserver" else ("trainer",)
    pods = []
    for role in roles:
        gpus = role_gpus(cluster, role) or None
        for index, node in enumerate(n for n in cluster.nodes if role in n.roles):
            address = pod_address(name, kind, role, index)
            pods.append(Node(name=f"{role}-{index}", host=address.split(".")[0], roles=(role,), workspace=WORKSPACE,
                             python="python3", address=address, ssh=SSHSettings(), gpus=gpus, iface=POD_IFACE))
    return replace(cluster, nodes=tuple(pods))


def pod_network(cluster: Cluster) -> Network:
    """Each pod has its own network namespace: an `auto` port is simply the default one."""
    defaults = {"master_port": JobSpec.master_port, "pserver_port": PserverSpec.port,
                "watchdog_port": WatchdogSpec.port}
    given = {"master_port": cluster.job.master_port, "pserver_port": cluster.job.pserver.port,
             "watchdog_port": cluster.job.watchdog.port}
    return Network(ports={k: given[k] if given[k] is not None else defaults[k] for k in defaults},
                   ifaces={n.name: POD_IFACE for n in cluster.nodes})


def k8s_settings(cluster: Cluster) -> KubernetesSpec:
    return cluster.kubernetes or KubernetesSpec()


def role_resources(cluster: Cluster, role: str) -> PodResources:
    return getattr(k8s_settings(cluster), role)


def role_gpus(cluster: Cluster, role: str) -> int:
    """GPUs a pod of the role asks for: kubernetes.<role>.gpus, else (trainers with job.trainer.use_gpu) the most
    any trainer node names (nodes[].gpus, else trainer.per_node)."""
    given = role_resources(cluster, role).gpus
    if given is not None:
        return given
    job = cluster.job
    if role != "trainer" or not job.trainer.use_gpu:
        return 0
    return max((n.gpus if n.gpus is not None else job.trainer.per_node for n in cluster.trainer_nodes), default=0)


def restarts(cluster: Cluster) -> int:
    """How many times Kubernetes may start a pod (or a JobSet) again: on_failure's restarts, else none."""
    w = cluster.job.watchdog
    return w.max_restarts if w.enabled and w.on_failure == "restart" else 0


@dataclass(frozen=True)
class PodSpec:
    """What the manifests need beyond the plan: the image, the kind, each role's resources, job.env, placement."""
    image: str
    kind: str = "job"
    gpus: tuple[tuple[str, int], ...] = ()  # (role, GPUs a pod)
    env: tuple[tuple[str, str], ...] = ()
    k8s: KubernetesSpec = KubernetesSpec()
    restarts: int = 0  # backoffLimitPerIndex, the JobSet's maxRestarts
    data_dir: str = f"{WORKSPACE}/data"  # where the data volume is mounted: the processes' FABTRAIN_DATA_DIR


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
    k8s = k8s_settings(cluster)
    if k8s.data and job.data.shared and not job.data.dir.startswith("/"):
        raise UserError(f"{cluster.path}: job.data.dir: {job.data.dir!r} must be an absolute path with job.data.shared "
                        f"and kubernetes.volumes.data (the volume is mounted there in every pod)")
    roles = ("pserver", "trainer") if job.mode == "pserver" else ("trainer",)
    gpus = tuple((role, role_gpus(cluster, role)) for role in roles if role_gpus(cluster, role))
    return PodSpec(image=job.image, kind=kind, gpus=gpus, env=job.env, k8s=k8s, restarts=restarts(cluster),
                   data_dir=job.data.dir if job.data.shared else f"{WORKSPACE}/data")


def pod_job_json(plan: Plan, node: str) -> dict:
    """A pod's job.json: the node's, with the agent running from the image's fabtrain."""
    job = plan.job_json(node)
    job["agent"]["cwd"] = RUNTIME
    return job


def pod_addressing(name: str, kind: str, counts: dict[str, int]) -> dict:
    """{role: {"count", "address": [prefix, offset, suffix], "first"?}}: how a pod names its peers (node/podpart.py)."""
    pods = {}
    for role, count in counts.items():
        if kind == "pytorchjob":
            pods[role] = {"count": count, "address": [f"{name}-worker-", -1, ""], "first": f"{name}-master-0"}
        else:
            prefix, suffix = _address_parts(name, kind, role)
            pods[role] = {"count": count, "address": [prefix, 0, suffix]}
    return pods


class _Unlike(Exception):
    """Two pods' parts that no expression of the index turns one into the other."""


class _Parts:
    """The job spec the Secret holds: per role, one template every pod of the role fills in with its index.

    Built from the parts of pods 0 and 1 of each role (a value that differs is
    a linear expression of the index: a number, a digit run in a string, a
    peer's address), with every list of all the pods written as one `each`
    piece; then checked against the plan's own part of each pod (every pod
    up to CHECK_ALL of a role, else a spread of them), so a template never
    says anything the plan does not.
    """
    CHECK_ALL = 64

    def __init__(self, plan: Plan, pods: dict):
        self.plan, self.pods = plan, pods
        alternatives = []
        for role, spec in pods.items():
            prefix, _, suffix = spec["address"]
            alternatives.append(f"(?P<{role}>{re.escape(prefix)}\\d+{re.escape(suffix)}"
                                + (f"|{re.escape(spec['first'])}" if spec.get("first") else "") + ")")
        self.address_re = re.compile("|".join(alternatives))

    def index_of(self, role: str, text: str) -> int | None:
        spec = self.pods[role]
        if text == spec.get("first"):
            return 0
        prefix, offset, suffix = spec["address"]
        j = int(text[len(prefix):len(text) - len(suffix)]) - offset
        return j if 0 <= j < spec["count"] else None

    def atoms(self, text: str) -> list:
        """A string as pieces: ("t", literal), ("n", number), ("a", role, pod index)."""
        out, at = [], 0
        for m in self.address_re.finditer(text):
            j = self.index_of(m.lastgroup, m.group())
            if j is None:
                continue
            out += self._literal(text[at:m.start()]) + [("a", m.lastgroup, j)]
            at = m.end()
        return out + self._literal(text[at:])

    @staticmethod
    def _literal(text: str) -> list:
        return [("n", int(t)) if t.isdigit() and (t == "0" or t[0] != "0") else ("t", t)
                for t in re.split(r"(\d+)", text) if t]

    def each(self, text: str):
        """A string that lists every pod of a role (after a prefix) as one `each` piece, else None."""
        m = self.address_re.search(text)
        if not m or "," not in text[m.start():]:
            return None
        role, items = m.lastgroup, text[m.start():].split(",")
        spec = self.pods[role]
        first = [i for i in items if self._split(role, i)[0] == 0]
        suffixes = [self._split(role, i)[1] for i in first]
        if None in suffixes or not suffixes:
            return None
        from fabtrain.contract.podpart import address
        if items != [address(self.pods, role, j) + s for j in range(spec["count"]) for s in suffixes]:
            return None
        return {"@": ([text[:m.start()]] if m.start() else []) + [{"each": [role, suffixes]}]}

    def _split(self, role: str, item: str):
        m = self.address_re.match(item)
        if not m or m.lastgroup != role or not re.fullmatch(r"(:\d+)?", item[m.end():]):
            return None, None
        return self.index_of(role, m.group()), item[m.end():]

    def unify(self, a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                raise _Unlike(f"fields {sorted(a.keys() ^ b.keys())}")
            return {k: self.unify(a[k], b[k]) for k in a}
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                raise _Unlike(f"{len(a)} and {len(b)} items")
            return [self.unify(x, y) for x, y in zip(a, b)]
        if isinstance(a, bool) or isinstance(b, bool) or type(a) is not type(b):
            if a != b:
                raise _Unlike(f"{a!r} and {b!r}")
            return a
        if isinstance(a, int):
            return a if a == b else {"@int": [b - a, a - (b - a) * self.at]}
        if isinstance(a, str):
            return self.string(a, b)
        if a != b:
            raise _Unlike(f"{a!r} and {b!r}")
        return a

    def string(self, a: str, b: str):
        if a == b:
            return self.each(a) or a
        x, y = self.atoms(a), self.atoms(b)
        if len(x) != len(y) or any(p[0] != q[0] for p, q in zip(x, y)):
            raise _Unlike(f"{a!r} and {b!r}")
        pieces = []
        for p, q in zip(x, y):
            if p[0] == "t":
                if p != q:
                    raise _Unlike(f"{a!r} and {b!r}")
                piece = p[1]
            elif p[0] == "n":
                piece = str(p[1]) if p == q else {"i": [q[1] - p[1], p[1] - (q[1] - p[1]) * self.at]}
            else:
                if p[1] != q[1]:
                    raise _Unlike(f"{a!r} and {b!r}")
                piece = {"addr": [p[1], q[2] - p[2], p[2] - (q[2] - p[2]) * self.at]}
            if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
                pieces[-1] += piece
            else:
                pieces.append(piece)
        return {"@": pieces}

    def template(self, role: str) -> dict:
        """{"first": pod 0's template, "rest": every other pod's}: pod 0 holds what one pod of a role holds (the
        coordinator, the rendezvous), the others are alike."""
        count = self.pods[role]["count"]
        first = self.unified(role, 0, 0)
        if count == 1:
            return {"first": first}
        template = {"first": first, "rest": self.unified(role, 1, 2 if count > 2 else 1)}
        self.check(role, template)
        return template

    def unified(self, role: str, a: int, b: int):
        """The template that gives pods a and b of the role their parts (their indexes' expressions)."""
        parts = []
        for j in (a, b):
            job = pod_job_json(self.plan, f"{role}-{j}")
            job["watchdog"].get("coordinator", {}).pop("secret", None)
            job.pop("nodes")
            parts.append(job)
        self.at = a  # b is a + 1, or a itself: every expression is A * index + B
        try:
            template = self.unify(*parts)
        except _Unlike as e:
            raise RuntimeError(f"the {role} pods' parts of the plan differ in more than their index: {e}") from None
        template["nodes"] = {"@nodes": list(self.pods)}
        return template

    def check(self, role: str, template: dict) -> None:
        from fabtrain.contract.podpart import part
        count = self.pods[role]["count"]
        spread = range(count) if count <= self.CHECK_ALL else sorted({0, 1, 2, count // 3, count // 2, count - 2, count - 1})
        spec = {"pods": self.pods, "parts": {role: template}}
        for j in spread:
            want = pod_job_json(self.plan, f"{role}-{j}")
            if part(spec, role, j, want["watchdog"].get("coordinator", {}).get("secret")) != want:
                raise RuntimeError(f"the template of the {role} pods does not give pod {j} its part of the plan")


def job_spec(plan: Plan, pods: dict) -> dict:
    """What the Secret's job.json holds: the pods' addressing and one template a role (no secret)."""
    parts = _Parts(plan, pods)
    return {"job_id": plan.job_id, "pods": pods, "parts": {role: parts.template(role) for role in pods}}


def manifests(plan: Plan, spec: PodSpec, pods: dict | None = None) -> list[dict]:
    """Every object of the job, in the order `kubectl apply -f DIR` should create them.

    pods: how the pods name each other (pod_addressing); the tests give one that
    reaches local processes.
    """
    name = object_name(plan.cluster, plan.job_id)
    roles = list(dict.fromkeys(n.processes[0].role for n in plan.nodes if n.processes))
    pods = pods or pod_addressing(name, spec.kind, {role: len(_pods(plan, role)) for role in roles})
    secret_value = plan.watchdog.get("coordinator", {}).get("secret")
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": _metadata(plan, spec, f"{name}-job"), "type": "Opaque",
              # The agents' secret: a Secret, never a ConfigMap. One job spec for every pod.
              "stringData": {JOB: json.dumps(job_spec(plan, pods), separators=(",", ":"), sort_keys=True)}
              | ({"secret": secret_value} if secret_value else {})}
    if spec.kind == "pytorchjob":
        return [secret, _pytorchjob(plan, spec, name)]
    if spec.kind == "jobset":
        return [secret, _jobset(plan, spec, name, roles)]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(plan, spec, name),
               # Headless, and published before readiness: the pods find each other while they start.
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {f"{LABEL}/job-id": plan.job_id}}}
    return [secret, service] + [_indexed_job(plan, spec, name, role) for role in roles]


def _labels(plan: Plan, role: str | None = None) -> dict:
    labels = {f"{LABEL}/cluster": dns_label(plan.cluster), f"{LABEL}/job-id": plan.job_id}
    return labels | ({f"{LABEL}/role": role} if role else {})


def _metadata(plan: Plan, spec: PodSpec, name: str, role: str | None = None, queue: bool = False) -> dict:
    meta = {"name": name}
    if spec.k8s.namespace:
        meta["namespace"] = spec.k8s.namespace
    labels = _labels(plan, role)
    if queue and spec.k8s.queue:
        labels["kueue.x-k8s.io/queue-name"] = spec.k8s.queue  # Kueue admits the whole object, or nothing of it
    return meta | {"labels": labels}


def _pods(plan: Plan, role: str) -> list:
    return [n for n in plan.nodes if n.processes and n.processes[0].role == role]


def _volume_source(volume: Volume) -> dict:
    if volume.claim:
        return {"persistentVolumeClaim": {"claimName": volume.claim, "readOnly": volume.read_only}}
    return {"hostPath": {"path": volume.host_path, "type": "Directory"}}


def _resources(spec: PodSpec, role: str) -> dict:
    r = getattr(spec.k8s, role)
    # Requests and limits alike: a pod of a training job is Guaranteed (evicted last) when it names CPU and memory.
    asked = {k: v for k, v in (("cpu", r.cpu), ("memory", r.memory)) if v is not None}
    gpus = dict(spec.gpus).get(role, 0)
    if gpus:
        asked[r.gpu_resource] = str(gpus)  # a Quantity, as the API writes it
    return {"requests": dict(asked), "limits": dict(asked)} if asked else {}


def _pod_template(plan: Plan, spec: PodSpec, role: str, index_env: str, container: str) -> dict:
    k8s = spec.k8s
    name = object_name(plan.cluster, plan.job_id)
    role_pods = {n.node for n in _pods(plan, role)}
    ports = sorted({p for u in plan.listens if u.node in role_pods and not u.udp for p in u.ports})
    mounts = [{"name": "job", "mountPath": JOB_FILES, "readOnly": True},
              {"name": "workspace", "mountPath": WORKSPACE}]
    volumes = [{"name": "job", "secret": {"secretName": f"{name}-job",
                                          # root:fsGroup 0440: the pod's own (non-root) user reads it, no one else.
                                          "defaultMode": 0o440}},
               {"name": "workspace", "emptyDir": {}}]
    shm = shm_size(getattr(k8s, role), role)
    if shm:  # NCCL and DataLoader workers share memory through /dev/shm; a container's default is 64 MiB
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
    for key, path in (("data", spec.data_dir), ("checkpoints", f"{WORKSPACE}/jobs/{plan.job_id}/checkpoints")):
        volume = getattr(k8s, key)
        if volume:
            mounts.append({"name": key, "mountPath": path} | ({"readOnly": True} if volume.read_only else {}))
            volumes.append({"name": key} | _volume_source(volume))
    box = {"name": container, "image": spec.image,
           "command": ["python3", "-m", "fabtrain.node.pod", JOB_FILES, role, "--index-env", index_env],
           "volumeMounts": mounts,
           "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    if spec.env:
        box["env"] = [{"name": k, "value": v} for k, v in spec.env]
    if ports:
        box["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in ports]
    resources = _resources(spec, role)
    if resources:
        box["resources"] = resources
    pod = {"restartPolicy": "Never", "containers": [box],
           # fabtrain.node.pod stops the pod's processes on SIGTERM: the agents' grace, and time to report.
           "terminationGracePeriodSeconds": math.ceil(plan.watchdog.get("grace", STOP_GRACE)) + 10,
           "securityContext": {"runAsNonRoot": True, "runAsUser": k8s.run_as_user, "runAsGroup": k8s.run_as_group,
                               "fsGroup": k8s.run_as_group, "seccompProfile": {"type": "RuntimeDefault"}},
           "volumes": volumes}
    if k8s.node_selector:
        pod["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod["tolerations"] = [_toleration(t) for t in k8s.tolerations]
    if k8s.priority_class:
        pod["priorityClassName"] = k8s.priority_class
    if k8s.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in k8s.image_pull_secrets]
    return {"metadata": {"labels": _labels(plan, role)}, "spec": pod}


def _toleration(t) -> dict:
    out = {"key": t.key, "operator": t.operator, "value": t.value, "effect": t.effect, "tolerationSeconds": t.seconds}
    return {k: v for k, v in out.items() if v is not None}


# The pod's exit code 1 is the agents' verdict: the job failed, after the restarts on_failure allowed.
AGENTS_FAILED = 1


def _job_spec(plan: Plan, spec: PodSpec, role: str, template: dict) -> dict:
    """An Indexed Job's spec: one pod an index; a disruption (eviction, drain, preemption) is not a failure."""
    count = len(_pods(plan, role))
    out = {"completionMode": "Indexed", "completions": count, "parallelism": count,
           # Another pod in place of a lost one, as often as on_failure restarts; an index out of tries ends the Job.
           "backoffLimitPerIndex": spec.restarts, "maxFailedIndexes": 0,
           "podFailurePolicy": {"rules": [
               # Evicted, drained, preempted: Kubernetes starts the pod again, and it counts for nothing.
               {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
               # The agents have already restarted the job as on_failure says: no second round of restarts.
               {"action": "FailJob", "onExitCodes": {"containerName": template["spec"]["containers"][0]["name"],
                                                     "operator": "In", "values": [AGENTS_FAILED]}},
           ]},
           "template": template}
    if spec.k8s.ttl_after_finished is not None:
        out["ttlSecondsAfterFinished"] = spec.k8s.ttl_after_finished
    return out


def _indexed_job(plan: Plan, spec: PodSpec, name: str, role: str) -> dict:
    template = _pod_template(plan, spec, role, "JOB_COMPLETION_INDEX", role)
    template["spec"]["subdomain"] = name  # with the Service: <job>-<index>.<name> resolves to the pod
    job = _job_spec(plan, spec, role, template)
    if spec.k8s.queue:
        job["suspend"] = True  # Kueue unsuspends it when the queue admits it
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _metadata(plan, spec, f"{name}-{role}", role, queue=True), "spec": job}


def _jobset(plan: Plan, spec: PodSpec, name: str, roles: list[str]) -> dict:
    """One JobSet: every role's pods admitted together (Kueue), restarted together (maxRestarts)."""
    replicated = []
    for role in roles:
        template = _pod_template(plan, spec, role, "JOB_COMPLETION_INDEX", role)
        job = _job_spec(plan, spec, role, template)
        job.pop("ttlSecondsAfterFinished", None)  # the JobSet's own, below
        replicated.append({"name": role, "replicas": 1,
                           "template": {"metadata": {"labels": _labels(plan, role)}, "spec": job}})
    body = {"network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": spec.restarts, "rules": [
                # The agents' verdict (a pod's FailJob): the job failed after its restarts in place.
                {"name": "agents-failed", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "replicatedJobs": replicated}
    if spec.k8s.ttl_after_finished is not None:
        body["ttlSecondsAfterFinished"] = spec.k8s.ttl_after_finished
    if spec.k8s.queue:
        body["suspend"] = True
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _metadata(plan, spec, name, queue=True), "spec": body}


def _pytorchjob(plan: Plan, spec: PodSpec, name: str) -> dict:
    template = _pod_template(plan, spec, "trainer", "RANK", "pytorch")
    # The operator sets MASTER_PORT from this port; the plan's is the same one.
    template["spec"]["containers"][0]["ports"] = [{"containerPort": plan.ports["master_port"],
                                                   "name": "pytorchjob-port", "protocol": "TCP"}]
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if len(plan.nodes) > 1:
        replicas["Worker"] = {"replicas": len(plan.nodes) - 1, "restartPolicy": "Never", "template": copy.deepcopy(template)}
    policy = {"backoffLimit": spec.restarts, "cleanPodPolicy": "None"}
    if spec.k8s.ttl_after_finished is not None:
        policy["ttlSecondsAfterFinished"] = spec.k8s.ttl_after_finished
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": _metadata(plan, spec, name, queue=True), "spec": {"runPolicy": policy,
                                                                          "pytorchReplicaSpecs": replicas}}
