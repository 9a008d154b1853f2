"""Run history, TensorBoard export and the agents' alerts, on real sshd nodes.

Two jobs on two nodes: the first stopped with `fab kill-all`, the second
failed by a trainer killed with SIGKILL while no `fab` runs (its alert must
come from the agents alone). Then /api/jobs, /api/jobs/<id> and `fab export
--tensorboard` read both back from the nodes.
"""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port, write_cluster
from tests.support.webhook import Receiver

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

FAKE = "python tests/programs/fakejob.py --period 0.1"
TOKEN = "t" * 32


@pytest.fixture
def two_jobs(tmp_path, sshd):
    hook = Receiver()
    path = tmp_path / "cluster.yaml"
    write_cluster(path, sshd, ssh_nodes=[("node1", ["pserver", "trainer"]), ("node2", ["trainer"])], job={
        "name": "hist", "pserver": {"port": free_port([n.address for n in sshd.nodes]), "command": FAKE},
        "trainer": {"command": FAKE},
        # auto: free_port above would hand the pserver's first port out again (fab check and start refuse that)
        "watchdog": {"interval": 0.5, "grace": 1, "port": "auto",
                     "notify": {"webhook": hook.url, "on": ["failed", "hang", "restart", "finished"]}}})
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(tmp_path / "state")}
    ws = {n: tmp_path / f"ws-{n}" for n in ("node1", "node2")}

    def fab(*args, check=True):
        out = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert (out.returncode == 0) == check, f"fab {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out

    yield path, env, ws, fab, hook
    if live_marked(ws.values()):
        subprocess.run([FAB, "kill-all", "--grace", "1"], cwd=REPO, env=env, capture_output=True, timeout=120)
    hook.close()


def start(fab, ws):
    out = fab("start-pserver", "start-trainers")
    job_id = out.stdout.split("job ", 1)[1].split(":", 1)[0]
    metrics = [ws[n] / "jobs" / job_id / "metrics" / f"trainer-{i}.jsonl" for i, n in enumerate(("node1", "node2"))]
    assert wait_for(lambda: all(m.exists() and len(m.read_text().splitlines()) >= 5 for m in metrics), timeout=30)
    return job_id


def no_fab_running(cluster: Path) -> bool:
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if p.info["cmdline"] and FAB in p.info["cmdline"][:2] and \
                    (p.info["environ"] or {}).get("FABTRAIN_CLUSTER") == str(cluster):
                return False
        except (psutil.Error, TypeError):
            continue
    return True


def test_history_export_and_one_alert_per_failure(two_jobs, tmp_path):
    cluster, env, ws, fab, hook = two_jobs
    fab("deploy")
    killed = start(fab, ws)
    fab("kill-all", "--grace", "1")
    assert not hook.got, hook.got  # kill-all is the user's own act: no alert

    failed = start(fab, ws)
    assert failed != killed
    assert no_fab_running(cluster)  # what follows is the agents' doing alone
    hook.got.clear()
    pid = json.loads((ws["node2"] / "jobs" / failed / "run" / "trainer-1.json").read_text())["program_pid"]
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: hook.got, timeout=5.0), "no alert within 5 s of the failure"
    # Every agent has written job_failed and is gone (an agent's alerts go out before it exits): still one alert.
    assert wait_for(lambda: not live_marked(ws.values()), timeout=20)
    assert len(hook.got) == 1, hook.got
    at, body = hook.got[0]
    assert at - t0 < 5.0
    assert body["kind"] == "failed" and body["job_id"] == failed and body["node"] == "node1"
    assert "trainer-1 on node2 killed by SIGKILL" in body["text"] and body["event"]["kind"] == "job_failed"

    # The history, through the dashboard's API.
    from fabtrain.controller.history import History
    from fabtrain.dashboard import create_app
    from fabtrain.remote.session import get_session

    os.environ["FABTRAIN_STATE_DIR"] = env["FABTRAIN_STATE_DIR"]
    try:
        session = get_session(str(cluster))
        app = create_app({"COLLECTOR": object(), "DASHBOARD_TOKEN": TOKEN, "HISTORY": History(session, ttl=0)})
        client = app.test_client()
        headers = {"Authorization": f"Bearer {TOKEN}", "Host": "127.0.0.1"}
        assert client.get("/api/jobs", headers={"Host": "127.0.0.1"}).status_code == 401
        jobs = {j["job_id"]: j for j in client.get("/api/jobs", headers=headers).get_json()["jobs"]}
        assert jobs[killed]["outcome"] == "killed" and jobs[killed]["reason"] == "stopped by fab kill-all"
        assert jobs[failed]["outcome"] == "failed" and "trainer-1 on node2 killed by SIGKILL" in jobs[failed]["reason"]
        for j in (jobs[killed], jobs[failed]):
            assert j["started"] and j["duration"] > 0 and j["restarts"] == 0 and j["loss"] > 0
            assert set(j["trainers"]) == {"trainer-0", "trainer-1"} and j["samples_per_s"] == 200.0
            assert j["command"][:2] == ["python", "tests/programs/fakejob.py"] and j["nodes"] == ["node1", "node2"]
        detail = client.get(f"/api/jobs/{killed}", headers=headers).get_json()
        steps = detail["series"]["trainer-1"]["step"]
        assert len(steps) >= 5 and steps == list(range(len(steps)))
        assert len(detail["series"]["trainer-1"]["ts"]) == len(steps) and detail["series"]["trainer-1"]["loss"][0] > 0
        assert any(e["kind"] == "killed" for e in detail["events"])
        assert detail["logs"]["node2"]["trainer-1"]
        assert client.get("/api/jobs/20000101-000000-beef", headers=headers).status_code == 404
        assert client.get("/api/jobs/..%2f", headers=headers).status_code in (400, 404)
        cached = json.loads((Path(env["FABTRAIN_STATE_DIR"]) / "test.jobs.json").read_text())
        assert set(cached["nodes"]) == {"node1", "node2"}
    finally:
        os.environ.pop("FABTRAIN_STATE_DIR", None)

    # TensorBoard files, read back with TensorBoard's own reader.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = fab("export", "--tensorboard", str(tmp_path / "tb"))
    assert f"/{failed}/trainer-1:" in out.stdout and f"/{killed}/trainer-0:" in out.stdout
    for job_id in (killed, failed):
        for i, node in enumerate(("node1", "node2")):
            records = [json.loads(x) for x in
                       (ws[node] / "jobs" / job_id / "metrics" / f"trainer-{i}.jsonl").read_text().splitlines()]
            ea = EventAccumulator(str(tmp_path / "tb" / job_id / f"trainer-{i}"))
            ea.Reload()
            loss = ea.Scalars("train/loss")
            assert [s.step for s in loss] == [r["step"] for r in records]
            assert [round(s.value, 4) for s in loss] == [r["loss"] for r in records]
            assert abs(loss[0].wall_time - records[0]["ts"]) < 1e-3
            assert [s.value for s in ea.Scalars("train/samples_per_s")] == [100.0] * len(records)
    only = fab("export", "--tensorboard", str(tmp_path / "tb2"), "--job", failed)
    assert killed not in only.stdout and (tmp_path / "tb2" / failed / "trainer-0").is_dir()
    bad = fab("export", "--tensorboard", str(tmp_path / "tb3"), "--job", "20000101-000000-beef", check=False)
    assert bad.returncode == 2 and "no job 20000101-000000-beef on any node" in bad.stderr and "Traceback" not in bad.stderr
