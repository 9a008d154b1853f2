"""fabtrain.controller.streaming: one open collect loop per node, over local and real SSH nodes."""
from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from fabtrain.controller.streaming import StreamingCollector
from tests.support.synthetic import SyntheticJob
from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.remote import rpc
from fabtrain.controller.series import TRAINERS
from fabtrain.remote.session import Session
from tests.support.sshd import write_cluster

pytestmark = pytest.mark.timeout(90)
JOB = "20261122-030000-beef"


def loops(sshd) -> list[psutil.Process]:
    """The node-side collect loops of this test's nodes running on this machine (local and sshd nodes alike):
    below this process (a local node) or below one of its sshd daemons, not another test's running beside it."""
    roots = {os.getpid()} | {n.process.pid for n in sshd.nodes if n.process is not None}
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) > 2 and cmd[1] == "-c" and cmd[2] == rpc.LAUNCHER:
            try:
                if roots & {q.pid for q in p.parents()}:
                    found.append(p)
            except psutil.Error:  # gone meanwhile
                continue
    return found


def wait_until(predicate, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def ssh_world(sshd, tmp_path):
    path = write_cluster(tmp_path / "cluster.yaml", sshd, name="stream", local_nodes=[("node0", ["trainer"])],
                         ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"])], job={"mode": "collective"})
    cluster = load_cluster(path)
    job = SyntheticJob(JOB, {n.name: (n.workspace, [f"trainer-{i}"]) for i, n in enumerate(cluster.nodes)}).start()
    for i, n in enumerate(cluster.nodes):
        job.metrics(n.name, f"trainer-{i}", range(20000))  # ~2.4 MB: several 1 MiB reads to catch up
        job.log(n.name, f"trainer-{i}", [f"line {k}" for k in range(50)])
        job.health(n.name, cpu=10.0 * i)
    job.event("node1", kind="hang", role="trainer", rank=1, reason="test")
    session = Session(cluster)
    yield {"cluster": cluster, "job": job, "session": session, "sshd": sshd}
    job.close()
    session.close()


def test_it_sees_what_the_plain_collector_sees_and_catches_up_fast(ssh_world):
    before = {p.pid for p in loops(ssh_world["sshd"])}
    plain = Collector(ssh_world["session"])
    for _ in range(4):
        plain.poll()
    stream = StreamingCollector(ssh_world["session"])
    stream.start(interval=5.0)  # a long interval: catching up must not wait for it
    try:
        assert wait_until(lambda: all(p.records == 20000 for p in stream.progress.values()) and len(stream.progress) == 3)
        # One loop per node, kept open (the plain collector's one-shot calls may take a moment to exit).
        assert wait_until(lambda: len({p.pid for p in loops(ssh_world["sshd"])} - before) == 3, timeout=5)
        with stream.lock:
            assert {n: v.up for n, v in stream.nodes.items()} == {"node0": True, "node1": True, "node2": True}
            assert [p["state"] for v in stream.nodes.values() for p in v.processes] == ["running"] * 3
            assert stream.nodes["node2"].health["host"]["cpu_percent"] == 20.0
            assert [e["kind"] for e in stream.events] == ["hang"]
            assert stream.series.export(TRAINERS) == plain.series.export(TRAINERS)
            assert len(stream.series.export(TRAINERS)[("trainer-1", "loss")]) > 10
        assert stream.follow_log("node1", "trainer-1").lines == []
        assert wait_until(lambda: stream.follow_log("node1", "trainer-1").lines[-1:] == ["line 49"], timeout=12)
    finally:
        stream.stop()
    # The node-side loops see their stdin close and exit: nothing left behind.
    assert wait_until(lambda: not ({p.pid for p in loops(ssh_world["sshd"])} - before), timeout=10)


def test_a_lost_node_is_marked_down_and_reconnected(ssh_world):
    sshd = ssh_world["sshd"]
    node1 = next(n for n in sshd.nodes if n.name == "node1")
    stream = StreamingCollector(ssh_world["session"])
    try:
        stream.poll_node("node1")
        assert stream.nodes["node1"].up is True
        # The channel dies under the collector: the next poll opens a new one, the node stays up.
        channel = stream._channels["node1"]
        channel.stream.chan.close()
        stream.poll_node("node1")
        assert stream.nodes["node1"].up is True and stream._channels["node1"] is not channel
        # sshd gone and the connection with it: unreachable with the transport's reason.
        sshd.stop(node1)
        ssh_world["session"].transport(ssh_world["cluster"].node("node1")).close()
        stream._channels.pop("node1").close()
        stream.poll_node("node1")
        view = stream.nodes["node1"]
        assert view.up is False and "unreachable: connection refused" in view.error
    finally:
        sshd.start(node1)
        stream.stop()


def test_the_node_side_loop_exits_when_idle_or_orphaned(tmp_path, monkeypatch):
    monkeypatch.setattr(rpc, "IDLE_EXIT", 1)
    ws = tmp_path / "ws"
    (ws / "jobs").mkdir(parents=True)
    from fabtrain.config.cluster import parse_cluster

    cluster = parse_cluster({"cluster": {"name": "idle", "python": sys.executable},
                             "nodes": [{"name": "n0", "host": "local", "roles": ["trainer"], "workspace": str(ws)}],
                             "job": {"mode": "collective"}}, str(tmp_path / "c.yaml"))
    stream = StreamingCollector(Session(cluster))
    stream.poll_node("n0")
    assert stream.nodes["n0"].up is True and stream.nodes["n0"].job_id is None
    proc = stream._channels["n0"].stream.proc
    assert proc.wait(10) == 0  # no request for IDLE_EXIT seconds: the loop ends by itself
    stream.poll_node("n0")  # the dead channel is replaced at once
    assert stream.nodes["n0"].up is True and stream._channels["n0"].stream.proc is not proc
    stream.stop()
