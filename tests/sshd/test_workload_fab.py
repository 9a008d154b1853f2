"""The reference workload through fab on real sshd nodes: data copied, training
progresses, kill-all checkpoints, and start-pserver --resume-from continues the run."""
import json
import re
import time

import pytest

from tests.support.procscan import live_marked
from tests.support.sshd import free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]


def metrics(ws, job_id, name):
    path = ws / "jobs" / job_id / "metrics" / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def wait_for_step(ws, job_id, name, step, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        recs = [r for r in metrics(ws, job_id, name) if isinstance(r.get("step"), int)]
        if recs and recs[-1]["step"] >= step:
            return recs
        time.sleep(0.5)
    raise AssertionError(f"{name} did not reach step {step}: {(ws / 'jobs' / job_id / 'logs' / (name + '.log')).read_text()[-1500:]}")


def test_word2vec_trains_over_ssh_and_resumes_after_kill_all(fab, tmp_path, sshd):
    pserver_port = free_port([n.address for n in sshd.nodes])
    path = write_cluster(tmp_path / "c.yaml", sshd,
                         ssh_nodes=[("node1", ["pserver"]), ("node2", ["trainer"]), ("node3", ["trainer"])],
                         job={"name": "w2v", "mode": "pserver", "sgd": "sync",
                              "pserver": {"port": pserver_port, "command": "python -m workload.pserver --checkpoint_every 20"},
                              "trainer": {"command": "python -m workload.trainer --model word2vec --num_passes 50"},
                              "data": {"dir": str(tmp_path / "data"), "input": "sample"},
                              "watchdog": {"hang_timeout": 60}})
    ps_ws, t0_ws, t1_ws = (tmp_path / f"ws-node{i}" for i in (1, 2, 3))
    out = fab("split-data", "deploy", "copy-data", "start-pserver", "start-trainers", cluster=path, check=True)
    first = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    recs = wait_for_step(t0_ws, first, "trainer-0", 80)
    assert recs[-1]["loss"] < recs[0]["loss"]  # it learns
    wait_for_step(t1_ws, first, "trainer-1", 80)

    out = fab("kill-all", cluster=path, check=True)
    assert live_marked([ps_ws, t0_ws, t1_ws]) == []
    assert list((ps_ws / "jobs" / first / "checkpoints").glob("**/*")), "the pserver checkpointed"

    out = fab("start-pserver", f"--resume-from={first}", "start-trainers", cluster=path, check=True)
    second = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    assert second != first
    recs = wait_for_step(t0_ws, second, "trainer-0", 1)
    ps_log = (ps_ws / "jobs" / second / "logs" / "pserver-0.log").read_text()
    assert "resumed from" in ps_log, ps_log[-1500:]
    resumed_at = recs[0]["step"]
    assert resumed_at >= 20  # continues the run, not from step 0
    fab("kill-all", cluster=path, check=True)
    assert live_marked([ps_ws, t0_ws, t1_ws]) == []
