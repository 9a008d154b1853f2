"""on_failure restart on three real sshd nodes, with no `fab` running while it restarts.

The stand-in trainer (tests/programs/standin.py) writes a metrics record every
0.2 s; the watchdog runs with interval 1 s, hang_timeout 3 s, grace 2 s,
restart_backoff 1 s, max_restarts 2. The reference workload's test checks that
its step continues from the checkpoint across a restart.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.history import list_jobs
from fabtrain.node import procfs
from fabtrain.remote.session import Session
from tests.support.procscan import live_marked, wait_for
from tests.support.ssh_job import NODES, Job, deployed
from tests.support.sshd import free_port, write_cluster
from tests.support.webhook import Receiver

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

STANDIN = "python tests/programs/standin.py"
BACKOFF = 1.0
RESTART = {"on_failure": "restart", "restart_backoff": BACKOFF, "max_restarts": 2}


@pytest.fixture(scope="module")
def job(sshd, tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("restart"), sshd, STANDIN) as j:
        yield j


@pytest.fixture
def fresh(job, sshd):
    yield job
    for node in sshd.nodes:
        if node.process is None or node.process.poll() is not None:
            sshd.start(node)
    if job.leftovers():
        job.fab("kill-all", "--grace", "1")


def events_of(job: Job, kind: str, generation: int | None = None) -> list[dict]:
    return [e for e in job.events() if e["kind"] == kind and (generation is None or e.get("generation") == generation)]


def program_env(pid: int) -> dict:
    return {k.decode(): v.decode() for k, v in procfs.environ(pid).items()}


def restarted_within(job: Job, t0: float, generation: int, limit: float) -> dict[str, int]:
    """Every node has started generation g, and each trainer wrote its first record of it; {name: pid}."""
    sizes = {(n, f"trainer-{i}"): (job.jd(n) / "metrics" / f"trainer-{i}.jsonl").stat().st_size
             for i, n in enumerate(("node2", "node3"))}
    assert wait_for(lambda: {e["node"] for e in events_of(job, "restarted", generation)} == set(NODES),
                    timeout=limit + 10), job.describe()
    assert wait_for(lambda: all((job.jd(n) / "metrics" / f"{name}.jsonl").stat().st_size > size
                                and job.run(n, name).get("started_at", 0) > t0 for (n, name), size in sizes.items()),
                    timeout=limit + 10, interval=0.02), job.describe()
    took = time.time() - t0
    assert took <= limit, f"generation {generation} running {took:.2f} s after the failure (limit {limit} s)"
    pids = {name: job.program(n, name) for (n, name) in sizes}
    for name, pid in pids.items():
        env = program_env(pid)
        assert env["FABTRAIN_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == str(generation), env
        assert env["FABTRAIN_JOB_ID"] == job.job_id
    return pids


@pytest.fixture
def hook():
    r = Receiver()
    yield r
    r.close()


def test_a_killed_trainer_restarts_the_job_until_max_restarts_is_spent(fresh, hook, monkeypatch):
    job = fresh
    job.start(**RESTART, notify={"webhook": hook.url, "on": ["restart", "failed"]})
    log = job.jd("node3") / "logs" / "trainer-1.log"
    for generation in (1, 2):
        t0 = time.time()
        os.kill(job.program("node3", "trainer-1"), signal.SIGKILL)
        restarted_within(job, t0, generation, BACKOFF * 2 ** (generation - 1) + 5)
        restarting = events_of(job, "restarting", generation)
        assert {e["node"] for e in restarting} == set(NODES)
        assert all("trainer-1 on node3 killed by SIGKILL" in e["reason"] and e["backoff"] == BACKOFF * 2 ** (generation - 1)
                   for e in restarting), restarting
        assert f"==== fabtrain: restart {generation} (FABTRAIN_RESTART_COUNT={generation})" in log.read_text()
        if generation == 1:
            status = job.fab("status")
            assert status.returncode == 0 and "generation 1, 1 restart left" in status.stdout, status.stdout
        job.collect()
    t0 = time.time()
    os.kill(job.program("node2", "trainer-0"), signal.SIGKILL)
    job.wait_gone(t0)
    failed = [e for e in events_of(job, "job_failed") if e["node"] == "node1"]
    assert failed and "max_restarts (2) spent" in failed[-1]["reason"], failed
    assert not events_of(job, "restarting", 3)
    # Every generation's lines stay in the one log file.
    text = log.read_text()
    assert text.count("==== fabtrain: restart") == 2 and text.index("restart 1") < text.index("restart 2")
    out = job.fab("status")
    assert out.returncode == 1 and "max_restarts (2) spent" in out.stdout, out.stdout
    # The agents told the webhook themselves (no fab ran during the restarts): one alert a restart, then the failure.
    assert wait_for(lambda: len(hook.got) >= 3, timeout=10), hook.got
    time.sleep(1)
    alerts = sorted((b["kind"], b["event"].get("generation")) for _, b in hook.got)
    assert alerts == [("failed", None), ("restart", 1), ("restart", 2)], alerts
    # The jobs list counts the restarts once each, not once a node.
    monkeypatch.setenv("FABTRAIN_STATE_DIR", str(job.state))
    session = Session(load_cluster(str(job.path)))
    try:
        (row,) = [j for j in list_jobs(session)["jobs"] if j["job_id"] == job.job_id]
    finally:
        session.close()
    assert row["restarts"] == 2 and row["outcome"] == "failed", row


def test_a_hung_trainer_restarts_the_job_too(fresh):
    job = fresh
    job.start(**RESTART)
    pid = job.program("node2", "trainer-0")
    t0 = time.time()
    os.kill(pid, signal.SIGSTOP)
    restarted_within(job, t0, 1, 3.0 + 2.0 + BACKOFF + 5)  # hang_timeout + grace + backoff + 5
    hang = [e for e in job.events("node2") if e["kind"] == "hang"]
    assert hang and hang[0]["name"] == "trainer-0"
    assert not procfs.alive(pid)
    job.fab("kill-all", "--grace", "1", check=True)


def test_kill_all_during_the_backoff_wins_on_every_node(fresh):
    job = fresh
    backoff = 4
    job.start(**dict(RESTART, restart_backoff=backoff))
    os.kill(job.program("node3", "trainer-1"), signal.SIGKILL)
    assert wait_for(lambda: {e["node"] for e in events_of(job, "restarting", 1)} == set(NODES), timeout=5)
    job.fab("kill-all", "--grace", "1", check=True)
    t0 = time.time()
    # Three backoffs from the kill-all, well past the moment the restart was due: nothing comes back.
    while time.time() - t0 < 3 * backoff:
        assert not live_marked(job.ws.values()), job.describe()
        time.sleep(0.5)
    assert not events_of(job, "restarted"), job.describe()
    out = job.fab("status")
    assert "generation 1" not in out.stdout or "killed" in out.stdout.lower(), out.stdout


def test_an_agent_killed_during_the_backoff_is_started_again_and_its_node_starts_the_generation(fresh):
    """Its keeper starts it again; all the new agent has is its node's `restarting` event (agent/loop.py replay).
    It starts generation 1 once the coordinator's status says so (not held: this job does not elect), with the
    other nodes, and the old generation's trainer is gone."""
    job = fresh
    backoff = 4
    job.start(**dict(RESTART, restart_backoff=backoff))
    old = job.program("node3", "trainer-1")
    agent = job.agent("node3")
    t0 = time.time()
    os.kill(job.program("node2", "trainer-0"), signal.SIGKILL)
    assert wait_for(lambda: {e["node"] for e in events_of(job, "restarting", 1)} == set(NODES), timeout=10), \
        job.describe()
    os.kill(agent, signal.SIGKILL)  # the pid fabtrain shows for node3's agent
    assert wait_for(lambda: "agent_restarted" in job.kinds("node3"), timeout=15), job.describe()
    assert job.agent("node3") != agent
    pids = restarted_within(job, t0, 1, 3 * backoff + 10)
    assert procfs.alive(pids["trainer-1"]) and not procfs.alive(old), job.describe()
    assert not events_of(job, "job_failed"), job.describe()


def test_a_node_gone_at_restart_time_fails_the_job_naming_it(fresh, sshd):
    job = fresh
    job.start(**RESTART)
    node3 = next(n for n in sshd.nodes if n.name == "node3")
    keeper = (job.health("node3") or {}).get("agent", {}).get("keeper_pid")
    agent = job.agent("node3")
    sshd.stop(node3)
    for pid in (keeper, agent):
        if pid:
            os.kill(pid, signal.SIGKILL)
    os.kill(job.program("node2", "trainer-0"), signal.SIGKILL)
    assert wait_for(lambda: any(e["node"] == "node1" for e in events_of(job, "job_failed")), timeout=30), job.describe()
    reason = [e for e in events_of(job, "job_failed") if e["node"] == "node1"][-1]["reason"]
    assert "node3" in reason, reason
    # Nodes 1 and 2 are torn down by their agents; node3 has none left (kill-all, once its sshd is back).
    assert wait_for(lambda: not live_marked([job.ws["node1"], job.ws["node2"]]), timeout=15), job.describe()
    assert not events_of(job, "restarted", 2)


def test_the_reference_workload_continues_from_its_checkpoint_after_a_restart(fab, tmp_path, sshd):
    pserver_port = free_port([n.address for n in sshd.nodes])
    path = write_cluster(tmp_path / "c.yaml", sshd,
                         ssh_nodes=[("node1", ["pserver"]), ("node2", ["trainer"]), ("node3", ["trainer"])],
                         job={"name": "w2v", "mode": "pserver", "sgd": "sync",
                              "pserver": {"port": pserver_port, "command": "python -m workload.pserver --checkpoint_every 10"},
                              "trainer": {"command": "python -m workload.trainer --model word2vec --num_passes 50"},
                              "data": {"dir": str(tmp_path / "data"), "input": "sample"},
                              "watchdog": {"hang_timeout": 60, "grace": 3, "on_failure": "restart",
                                           "restart_backoff": 1, "max_restarts": 1}})
    ws = {f"node{i}": tmp_path / f"ws-node{i}" for i in (1, 2, 3)}
    out = fab("split-data", "deploy", "copy-data", "start-pserver", "start-trainers", cluster=path, check=True)
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)

    def records(node, name):
        p = ws[node] / "jobs" / job_id / "metrics" / f"{name}.jsonl"
        lines = p.read_text().splitlines() if p.exists() else []
        return [r for r in map(json.loads, lines) if isinstance(r.get("step"), int)]

    assert wait_for(lambda: (records("node2", "trainer-0") or [{"step": 0}])[-1]["step"] >= 30, timeout=120)
    before = len(records("node2", "trainer-0"))
    run = json.loads((ws["node3"] / "jobs" / job_id / "run" / "trainer-1.json").read_text())
    os.kill(run["program_pid"], signal.SIGKILL)
    assert wait_for(lambda: len(records("node2", "trainer-0")) > before + 2 and
                    json.loads((ws["node2"] / "jobs" / job_id / "run" / "trainer-0.json").read_text())
                    .get("started_at", 0) > run["started_at"], timeout=90)
    started = json.loads((ws["node2"] / "jobs" / job_id / "run" / "trainer-0.json").read_text())["started_at"]
    after = [r for r in records("node2", "trainer-0") if r.get("ts", 0) > started]
    assert after[0]["step"] >= 10, after[:3]  # the first step of generation 1 continues from the checkpoint
    ps_log = (ws["node1"] / "jobs" / job_id / "logs" / "pserver-0.log").read_text()
    assert "resumed from" in ps_log.split("==== fabtrain: restart 1")[-1], ps_log[-2000:]
    fab("kill-all", cluster=path, check=True)
    assert live_marked(list(ws.values())) == []
