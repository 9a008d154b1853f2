"""The backend seam: one Backend per place a job runs, chosen once from the cluster file; fab's tasks
and the dashboard call its verbs and never ask which place they have."""
from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest

from fabtrain import backends
from fabtrain.backends.backend import Backend
from fabtrain.config.cluster import parse_cluster
from fabtrain.errors import UserError
from fabtrain.remote.session import Session
from tests.support import REPO

JOB = {"mode": "collective", "trainer": {"command": "python train.py"}}


def test_the_cluster_file_chooses_the_backend_once():
    nodes = parse_cluster({"cluster": {"name": "lab"}, "job": JOB,
                           "nodes": [{"name": "a", "host": "local", "roles": ["trainer"]}]}, "cluster.yaml")
    slurm = parse_cluster({"cluster": {"name": "lab"}, "job": JOB,
                           "scheduler": {"kind": "slurm", "nodes": 2}}, "cluster.yaml")
    assert backends.backend_for(nodes).NAME == "nodes"
    assert backends.backend_for(slurm).NAME == "scheduler"
    assert backends.backend_for(SimpleNamespace(scheduler=None, kubernetes={"namespace": "ml"})).NAME == "kubernetes"
    assert all(isinstance(b, Backend) for b in (backends.NODES, backends.SLURM, backends.KUBERNETES))


# status, logs and kill-all ask kubectl (tests/local/test_kubernetes_pods.py, against a stand-in kubectl).
@pytest.mark.parametrize("verb, call", [
    ("watch", lambda b, s: b.watch(s)),
    ("check", lambda b, s: b.check(s)),
])
def test_the_kubernetes_backend_refuses_what_needs_kubectl_in_one_line(verb, call):
    session = Session(parse_cluster({"cluster": {"name": "lab"}, "job": JOB,
                                     "nodes": [{"name": "a", "host": "local", "roles": ["trainer"]}]}, "cluster.yaml"))
    with pytest.raises(UserError) as e:
        call(backends.KUBERNETES, session)
    assert str(e.value).startswith(f"fab {verb} on a kubernetes: cluster needs kubectl"), str(e.value)
    assert "\n" not in str(e.value)


def _scheduler_reads(path) -> list[str]:
    """Where a module asks which place it has: `.scheduler` read, or fabtrain.slurm imported."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "scheduler":
            found.append(f"{path.name}:{node.lineno}: .scheduler")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fabtrain.slurm"):
            found.append(f"{path.name}:{node.lineno}: from {node.module}")
    return found


def test_the_tasks_and_the_dashboard_never_branch_on_the_scheduler(tmp_path):
    files = [REPO / "fabtrain" / "tasks.py", *sorted((REPO / "fabtrain" / "dashboard").glob("*.py"))]
    assert [hit for f in files for hit in _scheduler_reads(f)] == []
    branching = tmp_path / "tasks.py"  # the check finds what it is for
    branching.write_text("def status(s):\n    if s.cluster.scheduler:\n        from fabtrain.slurm import jobs\n")
    assert len(_scheduler_reads(branching)) == 2
