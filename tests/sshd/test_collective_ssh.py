"""Collective mode: unchanged user scripts (torch DDP, PaddlePaddle DataParallel)
train across real SSH nodes with the environment fabtrain gives them."""
import json
import re
import time

import pytest

from tests.conftest import require_import
from tests.support.sshd import free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]


def run_to_completion(fab, path, workspaces, timeout=150):
    out = fab("deploy", "start-trainers", cluster=path, check=True)
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    exits = {}
    deadline = time.time() + timeout
    while time.time() < deadline:
        exits = {f: f.read_text().strip() for ws in workspaces for f in (ws / "jobs" / job_id / "run").glob("trainer-*.exit")}
        runs = [f for ws in workspaces for f in (ws / "jobs" / job_id / "run").glob("trainer-*.json")]
        if runs and len(exits) == len(runs):
            break
        time.sleep(0.5)
    return job_id, exits


def logs_of(workspaces, job_id):
    return "\n".join(f.read_text()[-2000:] for ws in workspaces for f in (ws / "jobs" / job_id / "logs").glob("*.log"))


def test_plain_torch_ddp_script_trains_across_ssh_nodes(fab, tmp_path, sshd):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"])],
                         job={"mode": "collective", "master_port": free_port([n.address for n in sshd.nodes]),
                              "trainer": {"per_node": 1, "command": f"python tests/programs/ddp_min.py {out_dir}"},
                              "watchdog": {"enabled": False}})
    workspaces = [tmp_path / "ws-node1", tmp_path / "ws-node2"]
    job_id, exits = run_to_completion(fab, path, workspaces)
    assert sorted(exits.values()) == ["0", "0"], logs_of(workspaces, job_id)
    results = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in results] == [2, 2]
    assert results[0]["weights"] == results[1]["weights"]  # all-reduced gradients: identical models
    assert results[0]["loss"] < 1.0


def test_torchrun_command_runs_once_per_node(fab, tmp_path, sshd):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node2", ["trainer"]), ("node3", ["trainer"])],
                         job={"mode": "collective", "master_port": free_port([n.address for n in sshd.nodes]),
                              "trainer": {"per_node": 2, "command": f"torchrun --max-restarts=0 tests/programs/ddp_min.py {out_dir}"},
                              "watchdog": {"enabled": False}})
    workspaces = [tmp_path / "ws-node2", tmp_path / "ws-node3"]
    job_id, exits = run_to_completion(fab, path, workspaces, timeout=200)
    assert sorted(exits.values()) == ["0", "0"], logs_of(workspaces, job_id)
    results = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(4)]
    assert {r["world"] for r in results} == {4}
    assert sorted(r["local_rank"] for r in results) == [0, 0, 1, 1]
    assert all(r["weights"] == results[0]["weights"] for r in results)


def test_paddlepaddle_data_parallel_script_trains_across_ssh_nodes(fab, tmp_path, sshd):
    require_import("paddle", "paddlepaddle", "installed by `make test` (requirements-test.txt)")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node3", ["trainer"])],
                         job={"mode": "collective", "master_port": free_port([n.address for n in sshd.nodes]),
                              "trainer": {"per_node": 1, "command": f"python tests/programs/paddle_dp.py {out_dir}"},
                              "watchdog": {"enabled": False}})
    workspaces = [tmp_path / "ws-node1", tmp_path / "ws-node3"]
    job_id, exits = run_to_completion(fab, path, workspaces, timeout=200)
    assert sorted(exits.values()) == ["0", "0"], logs_of(workspaces, job_id)
    results = [json.loads((out_dir / f"paddle-rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in results] == [2, 2]
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        assert a == pytest.approx(b, abs=1e-6)


def test_program_written_for_mpirun_runs_unchanged_under_the_default_launcher(fab, tmp_path, sshd):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"]),
                                                              ("node3", ["trainer"])],
                         job={"mode": "collective", "master_port": free_port([n.address for n in sshd.nodes]),
                              "trainer": {"per_node": 2, "command": f"python tests/programs/ompi_train.py {out_dir}"},
                              "watchdog": {"enabled": False}})
    workspaces = [tmp_path / f"ws-node{i}" for i in (1, 2, 3)]
    job_id, exits = run_to_completion(fab, path, workspaces)
    assert sorted(exits.values()) == ["0"] * 6, logs_of(workspaces, job_id)
    places = [json.loads((out_dir / f"ompi-rank-{r}.json").read_text()) for r in range(6)]
    assert [p["fabtrain_rank"] for p in places] == [str(r) for r in range(6)]
    assert {p["size"] for p in places} == {6} and {p["local_size"] for p in places} == {2}
    assert [p["local_rank"] for p in places] == [0, 1, 0, 1, 0, 1]
