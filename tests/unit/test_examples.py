"""Every shipped cluster file parses, and means what its comments say."""

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.plan.plan import make_plan

import yaml

from tests.support import REPO
FILES = ["cluster.yaml", "cluster.ssh.yaml", *sorted(str(p.relative_to(REPO)) for p in (REPO / "examples").glob("*/cluster.yaml"))]


@pytest.mark.parametrize("name", FILES)
def test_shipped_cluster_files_parse_and_plan(name, tmp_path, monkeypatch):
    doc = yaml.safe_load((REPO / name).read_text())
    # Key files named in examples need not exist on the test machine.
    for where in [doc["cluster"].get("ssh", {})] + list(doc.get("nodes", [])):
        where.pop("key", None)
    cluster = parse_cluster(doc, name)
    plan = make_plan(cluster, "J")
    assert any(p.role == "trainer" for n in plan.nodes for p in n.processes)


def test_default_cluster_is_local_with_one_pserver_and_two_trainers():
    cluster = parse_cluster(yaml.safe_load((REPO / "cluster.yaml").read_text()), "cluster.yaml")
    assert all(n.is_local for n in cluster.nodes)
    assert cluster.pserver_count == 1 and cluster.trainer_count == 2


def test_paddle_v2_example_runs_paddle_unchanged():
    cluster = parse_cluster(yaml.safe_load((REPO / "examples/paddle-v2-pserver/cluster.yaml").read_text()), "x")
    plan = make_plan(cluster, "J")
    trainer2 = next(p for n in plan.nodes for p in n.processes if p.name == "trainer-2")
    assert trainer2.argv[:2] == ("paddle", "train") and "--trainer_id=2" in trainer2.argv
    assert "--pservers=192.168.1.10,192.168.1.11" in trainer2.argv


def test_every_example_is_a_project_a_user_copies():
    projects = sorted(p for p in (REPO / "examples").iterdir() if p.is_dir())
    assert [p.name for p in projects] == ["paddle-dataparallel", "paddle-v2-pserver", "paddlex-dist-ips", "torchrun-ddp"]
    for p in projects:
        assert (p / "fabfile.py").read_text().strip().endswith("from fabtrain.tasks import *  # noqa: F401,F403")
        cluster = parse_cluster(yaml.safe_load((p / "cluster.yaml").read_text()), str(p / "cluster.yaml"))
        assert cluster.code_dir() == p  # job.code: the folder that holds cluster.yaml
        for n in make_plan(cluster, "J").nodes:
            for proc in n.processes:
                script = next((a.split("=", 1)[-1] for a in proc.argv if a.endswith(".py")), None)
                if script:  # a script the command names is shipped with the project
                    assert (p / script).is_file(), (p.name, script)
