"""cluster.yaml's `kubernetes:` section: where and how `fab export --k8s` places the job's pods.

Each field becomes one part of the manifests (fabtrain/plan/kubernetes.py);
`fab status`, `fab logs` and `fab kill-all` ask the cluster through `kubectl`
when the section is there (fabtrain/kubernetes/kubectl.py). Every mistake is
one line naming the field, as for the rest of the file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from fabtrain.config.checks import INVALID, kind_of, shown, valid

FIELDS = {"namespace", "context", "queue", "priority_class", "image_pull_secrets", "node_selector", "tolerations",
          "ttl_after_finished", "run_as_user", "run_as_group", "volumes", "trainer", "pserver"}
ROLE_FIELDS = {"cpu", "memory", "gpus", "gpu_resource", "shm"}
VOLUME_FIELDS = {"claim", "host_path", "read_only"}
VOLUMES = ("data", "checkpoints")
TOLERATION_FIELDS = {"key", "operator", "value", "effect", "seconds"}
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1123: namespaces, claims, secrets
DNS_SUBDOMAIN_RE = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY_RE = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}$")
LABEL_VALUE_RE = re.compile(rf"^({_NAME})?$")
RESOURCE_RE = re.compile(rf"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/{_NAME}$")  # an extended resource: vendor/name
HOST_PATH_RE = re.compile(r"^/[A-Za-z0-9_./+@%,:=-]*$")
DEFAULT_USER = 1000  # a non-root user and group every image can run as (no passwd entry needed)
# A trainer pod's /dev/shm when kubernetes.trainer.shm is not given: half its memory limit (as Linux sizes a
# tmpfs), else this. A container runtime's own /dev/shm is 64 MiB: DataLoader workers and NCCL fail on it.
DEFAULT_SHM = "8Gi"
SUFFIXES = {"": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
            "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
            "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
            "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60}


@dataclass(frozen=True)
class Volume:
    claim: str | None = None  # a PersistentVolumeClaim's name
    host_path: str | None = None  # a directory on every node (a lab's shared disk, mounted on each)
    read_only: bool = False


@dataclass(frozen=True)
class PodResources:
    cpu: str | None = None
    memory: str | None = None
    gpus: int | None = None  # None: from nodes[].gpus / trainer.per_node when job.trainer.use_gpu
    gpu_resource: str = "nvidia.com/gpu"
    # /dev/shm, a memory emptyDir of this size; "0": none (the container runtime's 64 MiB); None: not given
    # (a trainer pod's is then shm_size's default, a pserver pod has none)
    shm: str | None = None


@dataclass(frozen=True)
class Toleration:
    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    seconds: int | None = None


@dataclass(frozen=True)
class KubernetesSpec:
    namespace: str | None = None  # None: kubectl's current one
    context: str | None = None  # kubectl's --context; None: the current one
    queue: str | None = None  # a Kueue LocalQueue (kueue.x-k8s.io/queue-name)
    priority_class: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    ttl_after_finished: int | None = None  # seconds Kubernetes keeps a finished Job before deleting it
    run_as_user: int = DEFAULT_USER
    run_as_group: int = DEFAULT_USER
    data: Volume | None = None
    checkpoints: Volume | None = None
    trainer: PodResources = PodResources()
    pserver: PodResources = PodResources()


def parse_kubernetes(checks, value: Any) -> KubernetesSpec:
    """kubernetes: {...} -> KubernetesSpec; every mistake recorded on `checks`, naming its field."""
    where = "kubernetes"
    d = checks.mapping(value, where, FIELDS)
    name = lambda key, pattern, what: (checks.string(d[key], f"{where}.{key}", pattern, what)  # noqa: E731
                                       if d.get(key) is not None else None)
    spec = dict(
        namespace=name("namespace", DNS_LABEL_RE, "namespace (lower case, digits, -)"),
        context=name("context", re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:/-]{0,252}$"), "kubectl context"),
        queue=name("queue", DNS_SUBDOMAIN_RE, "Kueue LocalQueue name"),
        priority_class=name("priority_class", DNS_SUBDOMAIN_RE, "PriorityClass name"),
        ttl_after_finished=(checks.integer(d["ttl_after_finished"], f"{where}.ttl_after_finished", 0, 10**8)
                            if d.get("ttl_after_finished") is not None else None),
        run_as_user=checks.integer(d.get("run_as_user", DEFAULT_USER), f"{where}.run_as_user", 1, 2**31 - 1),
        run_as_group=checks.integer(d.get("run_as_group", DEFAULT_USER), f"{where}.run_as_group", 1, 2**31 - 1),
        image_pull_secrets=_names(checks, d.get("image_pull_secrets"), f"{where}.image_pull_secrets"),
        node_selector=_labels(checks, d.get("node_selector"), f"{where}.node_selector"),
        tolerations=_tolerations(checks, d.get("tolerations"), f"{where}.tolerations"),
        trainer=_resources(checks, d.get("trainer"), f"{where}.trainer"),
        pserver=_resources(checks, d.get("pserver"), f"{where}.pserver"),
    )
    volumes = checks.mapping(d.get("volumes"), f"{where}.volumes", set(VOLUMES))
    for key in VOLUMES:
        spec[key] = _volume(checks, volumes[key], f"{where}.volumes.{key}") if key in volumes else None
    if not valid(*spec.values()):
        return INVALID
    return KubernetesSpec(**spec)


def _names(checks, value, where) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        checks.report(where, f"must be a list of Secret names, got {kind_of(value)}")
        return INVALID
    out = tuple(checks.string(v, f"{where}[{i}]", DNS_SUBDOMAIN_RE, "Secret name") for i, v in enumerate(value))
    return out if valid(*out) else INVALID


def _labels(checks, value, where) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        checks.report(where, f"must be a mapping of node labels to values, got {kind_of(value)}")
        return INVALID
    out = []
    for key, v in value.items():
        if not isinstance(key, str) or not LABEL_KEY_RE.match(key):
            checks.report(f"{where}.{key}", f"{shown(key)} is not a label key (e.g. kubernetes.io/arch, gpu-type)")
            return INVALID
        v = "true" if v is True else "false" if v is False else v  # YAML's unquoted true is the label "true"
        text = checks.string(v, f"{where}.{key}", LABEL_VALUE_RE, "label value")
        if text is INVALID:
            return INVALID
        out.append((key, text))
    return tuple(out)


def _tolerations(checks, value, where) -> tuple[Toleration, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        checks.report(where, f"must be a list of tolerations ({{key, operator, value, effect}}), got {kind_of(value)}")
        return INVALID
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        t = checks.mapping(item, at, TOLERATION_FIELDS)
        operator = checks.choice(t.get("operator", "Equal"), f"{at}.operator", ("Equal", "Exists"))
        key = checks.string(t["key"], f"{at}.key", LABEL_KEY_RE, "taint key") if t.get("key") is not None else None
        text = checks.string(t["value"], f"{at}.value", LABEL_VALUE_RE, "taint value") if "value" in t else None
        effect = checks.choice(t["effect"], f"{at}.effect", EFFECTS) if "effect" in t else None
        seconds = checks.integer(t["seconds"], f"{at}.seconds", 0, 10**8) if "seconds" in t else None
        if not valid(operator, key, text, effect, seconds):
            return INVALID
        if operator == "Exists" and text is not None:
            checks.report(f"{at}.value", "must be left out with operator: Exists")
            return INVALID
        if key is None and operator != "Exists":
            checks.report(f"{at}.key", "missing: only operator: Exists may leave out the key (it tolerates every taint)")
            return INVALID
        if seconds is not None and effect != "NoExecute":
            checks.report(f"{at}.seconds", "is only for effect: NoExecute (how long the pod stays on a tainted node)")
            return INVALID
        out.append(Toleration(key=key, operator=operator, value=text, effect=effect, seconds=seconds))
    return tuple(out)


def _quantity(checks, value, where, what):
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not QUANTITY_RE.match(str(value)):
        checks.report(where, f"{shown(value)} is not a Kubernetes quantity ({what})")
        return INVALID
    return str(value)


def quantity_bytes(quantity: str) -> Decimal:
    """A quantity of bytes that QUANTITY_RE took ("64Gi", "1.5G", "512") as a number of bytes."""
    number, suffix = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return Decimal(number) * SUFFIXES[suffix]


def bytes_quantity(count: int, like: str = "") -> str:
    """`count` bytes as a quantity, in the largest suffix that holds it whole: of the binary family (Ki, Mi, ...)
    when `like` is written in it, else of the decimal one (k, M, ...); plain bytes when neither does."""
    binary = [s for s in SUFFIXES if s.endswith("i")]
    decimal = [s for s in SUFFIXES if s and s != "m" and not s.endswith("i")]
    families = (binary, decimal) if like.endswith("i") else (decimal, binary)
    for family in families:
        for suffix in sorted(family, key=SUFFIXES.get, reverse=True):
            whole, rest = divmod(Decimal(count), SUFFIXES[suffix])
            if count and not rest:
                return f"{whole}{suffix}"
    return str(count)


def shm_size(resources: PodResources, role: str) -> str | None:
    """The sizeLimit of a pod's /dev/shm (a memory emptyDir), None for none: `shm` as given ("0": none); not
    given, a trainer pod's is half its memory limit, or DEFAULT_SHM without one, and a pserver pod has none."""
    if resources.shm is not None:
        return resources.shm if quantity_bytes(resources.shm) else None
    if role != "trainer":
        return None
    if resources.memory is None:
        return DEFAULT_SHM
    half = int(quantity_bytes(resources.memory) / 2)
    return bytes_quantity(half, resources.memory) if half else None


def _shm(checks, value, where, memory):
    """`shm`: a quantity of bytes, 0 for none, and no more than the pod's memory limit (its pages count against it:
    the container would be killed for memory before /dev/shm was full)."""
    shm = _quantity(checks, value, where, "bytes, e.g. 16Gi; 0: no /dev/shm volume")
    if shm is INVALID or memory is None or memory is INVALID:
        return shm
    if quantity_bytes(shm) > quantity_bytes(memory):
        checks.report(where, f"{shown(value)} is more than the pod's memory limit ({memory}): /dev/shm's pages count "
                             f"against it; give at most {memory}, or 0 for none")
        return INVALID
    return shm


def _resources(checks, value, where) -> PodResources:
    r = checks.mapping(value, where, ROLE_FIELDS)
    memory = _quantity(checks, r["memory"], f"{where}.memory", "bytes, e.g. 64Gi") if "memory" in r else None
    spec = dict(
        cpu=_quantity(checks, r["cpu"], f"{where}.cpu", 'cores, e.g. 8 or "500m"') if "cpu" in r else None,
        memory=memory,
        shm=_shm(checks, r["shm"], f"{where}.shm", memory) if "shm" in r else None,
        gpus=checks.integer(r["gpus"], f"{where}.gpus", 0, 1024) if "gpus" in r else None,
        gpu_resource=(checks.string(r["gpu_resource"], f"{where}.gpu_resource", RESOURCE_RE,
                                    "extended resource name (vendor/name, e.g. nvidia.com/gpu, amd.com/gpu)")
                      if "gpu_resource" in r else PodResources.gpu_resource),
    )
    return PodResources(**spec) if valid(*spec.values()) else INVALID


def _volume(checks, value, where) -> Volume:
    v = checks.mapping(value, where, VOLUME_FIELDS)
    if ("claim" in v) == ("host_path" in v):
        checks.report(where, "give exactly one of claim (a PersistentVolumeClaim's name) or host_path "
                             "(a directory on every node)")
        return INVALID
    claim = checks.string(v["claim"], f"{where}.claim", DNS_SUBDOMAIN_RE, "claim name") if "claim" in v else None
    host_path = (checks.string(v["host_path"], f"{where}.host_path", HOST_PATH_RE, "absolute path")
                 if "host_path" in v else None)
    read_only = checks.boolean(v.get("read_only", False), f"{where}.read_only")
    if not valid(claim, host_path, read_only):
        return INVALID
    return Volume(claim=claim, host_path=host_path, read_only=read_only)
