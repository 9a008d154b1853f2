"""`fab export --k8s DIR`: the job of cluster.yaml as manifests a lab can `kubectl apply -f DIR`.

The manifests are rendered by fabtrain.plan.kubernetes from the plan of the
job's pods; this writes them, one object a file, numbered in the order they
must be created. The Secret holds the agents' secret: its file is 0600.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import yaml

from fabtrain.config.cluster import Cluster
from fabtrain.errors import UserError
from fabtrain.plan import kubernetes
from fabtrain.plan.plan import make_plan, new_job_id


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):  # a manifest says everything where it is used, no &anchors
        return True


def _text(dumper, value):
    # A pod's job.json as the block of lines it is, not one escaped string.
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)


def manifest_text(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1 << 16)


def render(cluster: Cluster, kind: str = "job", job_id: str | None = None, secret: str | None = None) -> list[dict]:
    spec = kubernetes.pod_spec(cluster, kind)  # says a missing job.image before anything else
    job_id = job_id or new_job_id()
    pods = kubernetes.pod_cluster(cluster, job_id, kind)
    plan = make_plan(pods, job_id, secret=secret or secrets.token_hex(16), network=kubernetes.pod_network(pods))
    return kubernetes.manifests(plan, spec)


def export_kubernetes(cluster: Cluster, out_dir: str, kind: str = "job") -> list[Path]:
    # What was typed first, then what the cluster file lacks.
    kubernetes.check_kind(kind)
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--k8s {out_dir}: exists and is not a directory")
    docs = render(cluster, kind)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.glob("*.yaml"))
    if stale:
        raise UserError(f"--k8s {out_dir}: already holds manifests ({', '.join(stale[:3])}); "
                        f"`kubectl apply -f` would apply them too: give an empty or new directory")
    written = []
    for i, doc in enumerate(docs):
        path = out / f"{i:02d}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(manifest_text(doc))
        written.append(path)
    return written
