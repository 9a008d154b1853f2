"""`fab start-pserver start-trainers` in a fresh workspace, no `fab deploy` first, on sshd nodes: either
everything runs with its agents, or nothing runs and one line says why. fabtrain's own node runtime is
fabtrain's business (a start installs it where it is missing); the project's code is the user's (a start
without it refuses)."""
import json
import re

import pytest

from fabtrain.node.workspace import CODE_IDENTITY
from fabtrain.plan.runtime import runtime_version
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(240)]

NODES = ("node1", "node2")


@pytest.fixture
def fresh(tmp_path, sshd, fab):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("import time\ntime.sleep(120)\n")
    # Auto ports: another test file's job on the same sshd nodes (three files run at once) may hold a fixed one.
    job = {"name": "fresh", "mode": "pserver", "code": str(project),
           "pserver": {"command": "python train.py", "port": "auto"}, "trainer": {"command": "python train.py"},
           "watchdog": {"interval": 0.5, "port": "auto"}}
    path = write_cluster(tmp_path / "cluster.yaml", sshd, job=job,
                         ssh_nodes=[("node1", ["pserver", "trainer"]), ("node2", ["trainer"])])
    workspaces = {n: tmp_path / f"ws-{n}" for n in NODES}
    yield path, workspaces
    fab("kill-all", "--grace", "1", cluster=path)


def test_a_start_with_no_code_deployed_refuses_in_one_line_and_starts_nothing(fab, fresh):
    path, workspaces = fresh
    out = fab("start-pserver", "start-trainers", cluster=path)
    said = out.stdout + out.stderr
    assert out.returncode != 0, said
    for node, ws in workspaces.items():
        if node == "node1":  # the one node with a pserver
            assert re.search(rf"^{node}: FAILED: no code deployed to {ws}/code: run `fab deploy` first; "
                             rf"nothing of job \S+ was started here$", said, re.M), said
        assert not (ws / "jobs").exists() or not any((ws / "jobs").iterdir())
    assert "Traceback" not in said and "warning" not in said
    assert live_marked(workspaces.values()) == []


def test_a_start_whose_node_runtime_is_missing_installs_it_and_runs_every_agent(fab, fresh):
    path, workspaces = fresh
    fab("deploy", cluster=path, check=True)
    for ws in workspaces.values():  # deployed code, but no runtime: as a deploy by another fabtrain left it
        assert (ws / "code" / CODE_IDENTITY).exists()
        runtime = ws / "runtime"
        for f in sorted(runtime.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
    out = fab("start-pserver", "start-trainers", cluster=path, check=True)
    assert "warning" not in out.stdout, out.stdout
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    for node, ws in workspaces.items():
        assert (ws / "runtime" / runtime_version() / "fabtrain" / "node" / "agent" / "loop.py").exists()
        run = ws / "jobs" / job_id / "run" / "agent.json"
        assert wait_for(run.exists, timeout=20), node
        pid = json.loads(run.read_text())["pid"]
        marked = dict(live_marked([ws]))
        assert pid in marked, (node, marked)
    # Every agent met the coordinator: the job is watched, not just running.
    assert wait_for(lambda: all((ws / "jobs" / job_id / "health.json").exists() for ws in workspaces.values()),
                    timeout=30)
    out = fab("status", cluster=path, check=True)
    assert out.stdout.count("agent") >= 2, out.stdout
