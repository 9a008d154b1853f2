"""Partitions as the world makes them: three sshd nodes, each in its own network namespace on a bridge
(tests/support/netns.py), one of them cut off by dropped packets (both ways, one way, 30 % at random) or a link
set down, then healed.

What must hold (docs/partitions.md): a cut-off node stops every process of the job by itself within
its stop bound (fence.py), measured from its lease; under min_nodes the survivors' next generation
starts only after that, on a rendezvous port of its own, and the healed node never comes back into
it; the coordinator's node cut off fails the job everywhere, with one coordinator. After each, /proc
of every namespace holds nothing of the job, and the next job starts. The times are bench/partitions.py's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.dashboard import create_app
from fabtrain.node import procfs
from fabtrain.remote.session import Session
from fabtrain.node.coordination import fence
from tests.support.netns import cut_mid_file, net, root, write_corpus, write_project_with_a_blob  # noqa: F401
from tests.support.procscan import wait_for
from tests.support.partition_job import GRACE, INTERVAL, MASTER_PORT, NODES, PartitionJob, stopped_at
from tests.support.sshd import write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

PEER_TIMEOUT = fence.peer_timeout(INTERVAL)
TOKEN = "t0k3n-for-partitions-0123456789abcdef"
HOST = "127.0.0.1:8265"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Host": HOST}
STOP_BOUND = fence.stop_bound(INTERVAL, GRACE)


def test_a_cut_off_node_under_min_nodes_stops_before_the_smaller_generation_starts(fab, root, net):
    # node3's trainer takes its whole grace to die (it ignores SIGTERM), as a trainer saving a checkpoint does:
    # a backoff of 2 s alone would start the smaller world while it still runs.
    # max_rejoins 0: the healed node is kept out (tests/sshd/test_elastic_rejoin_netns.py takes it back)
    job = PartitionJob(fab, root, net, trainer_args="--ignore-term trainer-2", on_failure="restart",
                       restart_backoff=2, max_restarts=2, min_nodes=2, max_rejoins=0)
    try:
        old_pid = job.run_record("node3", "trainer-2")["program_pid"]
        cut = net.cut("node3", "drop")  # every packet in and out of node3 dropped: TCP just stops
        # The survivors' generation 1: started, on a port of its own, as a world of 2.
        assert wait_for(lambda: job.events("node1", "restarted") and job.events("node2", "restarted"),
                        timeout=fence.fence_wait(INTERVAL, GRACE) + 20), job.describe()
        new = [job.run_record(n, f"trainer-{i}") for i, n in ((0, "node1"), (1, "node2"))]
        started = min(r["started_at"] for r in new)
        pid = new[0]["program_pid"]  # its own environment once it has exec'd (named at the fork)
        assert wait_for(lambda: b"MASTER_PORT" in procfs.environ(pid), timeout=10), (pid, job.describe())
        env = {k.decode(): v.decode() for k, v in procfs.environ(pid).items()}
        assert (env["MASTER_PORT"], env["WORLD_SIZE"], env["FABTRAIN_RESTART_COUNT"]) == (
            str(MASTER_PORT + 1), "2", "1"), env
        # node3 fenced itself: its trainer ended, by its own agent, before generation 1 started.
        assert wait_for(lambda: stopped_at(job, "node3", "trainer-2"), timeout=STOP_BOUND + 5), job.describe()
        assert procfs.stat(old_pid) is None
        gone = stopped_at(job, "node3", "trainer-2")
        lease = job.health("node3")["coordinator"]["lease"]
        assert gone < started, f"node3's trainer ended {gone - started:.2f} s after generation 1 started"
        assert gone - lease <= STOP_BOUND, f"node3 stopped {gone - lease:.2f} s after its lease (bound {STOP_BOUND})"
        (fenced,) = [e for e in job.events("node3", "peer_lost") if e.get("peer") == "node1"]
        assert "fences itself" in fenced["reason"] and fenced["ts"] - lease >= fence.fence_after(INTERVAL) - 0.1
        (left,) = job.events("node1", "node_left")
        assert left["peer"] == "node3" and left["world_size"] == 2, left
        assert cut < gone
        # Healed: node3 neither rejoins nor reports; nothing of the job runs there.
        net.heal("node3")
        # Its agent is still there when the link comes back (it waits for the coordinator's word on its failure,
        # 2 peer_timeouts + grace): its next beat is refused as fenced, once, and the agent is told so and ends.
        assert wait_for(lambda: job.events("node1", "fenced") and job.events("node3", "fenced"),
                        timeout=3 * PEER_TIMEOUT), job.describe()
        (refused,) = job.events("node1", "fenced")
        assert refused["peer"] == "node3" and "it left the job at generation 0" in refused["reason"], refused
        (told,) = job.events("node3", "fenced")
        assert told["reason"].startswith("fenced out of the job: node3 left the job at generation 0"), told
        assert wait_for(lambda: not job.job_pids("node3"), timeout=3 * PEER_TIMEOUT + GRACE + 5), job.describe()
        assert not job.events("node3", "restarted"), job.describe()
        # Running again once every survivor's beat said it started generation 1 (its agent writes health a beat on).
        assert wait_for(lambda: job.health("node1")["job"]["status"] == "running", timeout=4 * INTERVAL + 5), \
            job.health("node1")["job"]
        assert job.health("node1")["job"]["out"] == ["node3"], job.health("node1")["job"]
        status = job.fab("status")
        assert "without node3" in status.stdout, status.stdout
    finally:
        job.end()


@pytest.mark.parametrize("how", ["link", "drop-out"])
def test_a_cut_off_node_in_a_plain_job_fails_it_naming_the_node_and_stops_by_itself(fab, root, net, how):
    job = PartitionJob(fab, root, net)
    try:
        # link: its switch port dead, the node runs on, unreachable. drop-out: one way, what it sends is lost (it
        # still hears the others, but no TCP connection of its own gets an answer through).
        cut = net.cut("node3", how)
        assert wait_for(lambda: job.events("node1", "job_failed"), timeout=PEER_TIMEOUT + 5), job.describe()
        failed = job.events("node1", "job_failed")[0]
        assert "node node3 lost" in failed["reason"], failed
        assert failed["ts"] - cut <= PEER_TIMEOUT + 2, f"failed {failed['ts'] - cut:.1f} s after the cut"
        assert wait_for(lambda: stopped_at(job, "node3", "trainer-2"), timeout=STOP_BOUND + 5), job.describe()
        lease = job.health("node3")["coordinator"]["lease"]
        assert stopped_at(job, "node3", "trainer-2") - lease <= STOP_BOUND
        assert wait_for(lambda: not any(job.job_pids(n) for n in ("node1", "node2")), timeout=GRACE + 10), \
            job.describe()
        net.heal("node3")
        assert wait_for(lambda: not job.job_pids("node3"), timeout=3 * PEER_TIMEOUT + GRACE + 5), job.describe()
        status = job.fab("status")
        assert "node3" in status.stdout and "running" not in status.stdout.split("node3", 1)[1].split("\n")[0], \
            status.stdout
        assert job.fab("kill-all").returncode == 0
    finally:
        job.end()


def test_the_coordinators_node_cut_off_fails_the_job_everywhere_with_one_coordinator(fab, root, net):
    job = PartitionJob(fab, root, net)
    try:
        net.cut("node1", "drop")
        assert wait_for(lambda: all(stopped_at(job, n, f"trainer-{i}") for i, n in enumerate(NODES)),
                        timeout=STOP_BOUND + 5), job.describe()
        for i, n in ((1, "node2"), (2, "node3")):
            (lost,) = [e for e in job.events(n, "peer_lost") if e.get("peer") == "node1"]
            assert "fences itself" in lost["reason"], lost
            lease = job.health(n)["coordinator"]["lease"]
            assert stopped_at(job, n, f"trainer-{i}") - lease <= STOP_BOUND
        assert "lost" in job.events("node1", "job_failed")[0]["reason"]
        # No election: exactly one coordinator, node1's, ever. Its agent's last health says it hosted it, and only
        # a coordinator writes its board to the job folder (coordinator.json): none on node2 or node3.
        hosted = [n for n in NODES if (job.health(n).get("coordinator") or {}).get("hosted_here")]
        assert hosted == ["node1"], {n: job.health(n).get("coordinator") for n in NODES}
        boards = [n for n in NODES if (job.jd(n) / "coordinator.json").exists()]
        assert boards == ["node1"], boards
    finally:
        job.end()
    # The next job starts as usual on the same nodes.
    PartitionJob(fab, root, net).end()


def test_the_controller_cut_off_leaves_the_job_running_and_kill_all_names_the_node(fab, root, net):
    job = PartitionJob(fab, root, net)
    session = Session(load_cluster(str(job.path)))
    collector = Collector(session, job_id=job.job_id)
    dashboard = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                            "TESTING": True}).test_client()
    try:
        net.cut("node2", "controller")  # the laptop off the VPN for node2 only: the nodes still reach each other
        t0 = time.monotonic()
        status = job.fab("status", timeout=60)
        assert time.monotonic() - t0 < 30, "fab status waited past its timeouts"
        assert status.returncode != 0 and "node2" in status.stdout + status.stderr, status.stdout + status.stderr
        for args in (("logs",), ("watch", "--timeout", "4")):
            t0 = time.monotonic()
            said = job.fab(*args, timeout=60)
            assert time.monotonic() - t0 < 40 and "node2" in said.stdout + said.stderr, (args, said.stdout + said.stderr)
        assert not job.events("node1", "job_failed"), job.describe()  # the job goes on untouched
        # The dashboard's collector: a poll answers within its timeout, node2 shown unreachable, the others up.
        t0 = time.monotonic()
        collector.poll()
        assert time.monotonic() - t0 < 40, "the dashboard's poll waited past its timeouts"
        nodes = {n["name"]: n for n in dashboard.get("/api/cluster", headers=AUTH).get_json()["nodes"]}
        assert nodes["node2"]["up"] is False and nodes["node2"]["down"] in ("unreachable", "no reply"), nodes["node2"]
        assert nodes["node1"]["up"] and nodes["node3"]["up"], nodes
        assert {p["name"]: p["state"] for p in nodes["node1"]["processes"]}["trainer-0"] == "running", nodes
        killed = job.fab("kill-all", "--grace", "1", timeout=90)
        said = killed.stdout + killed.stderr
        assert killed.returncode != 0 and "node2" in said, said
        # node2's agent lost its coordinator (node1's agent went with kill-all): it fenced itself.
        assert wait_for(lambda: stopped_at(job, "node2", "trainer-1"), timeout=STOP_BOUND + 5), job.describe()
        net.heal("node2")
        collector.poll()  # healed: the dashboard reaches node2 again, and sees what its agent did
        node2 = {n["name"]: n for n in dashboard.get("/api/cluster", headers=AUTH).get_json()["nodes"]}["node2"]
        assert node2["up"] is True and node2["job_id"] == job.job_id, node2
        assert {p["name"]: p["state"] for p in node2["processes"]}["trainer-1"] != "running", node2
        again = job.fab("kill-all", "--grace", "1")
        assert again.returncode == 0, again.stdout + again.stderr
        assert wait_for(lambda: not any(job.job_pids(n) for n in NODES), timeout=20), job.describe()
    finally:
        session.close()
        job.end()


def test_copy_data_over_a_capped_link_cut_mid_file_ends_naming_the_node_and_resumes(fab, tmp_path, net):
    """node3's link capped (tbf) and lossy, then set down mid-file: copy-data ends within ssh's keepalive
    naming node3 (no hang until TCP gives up), leaves no half-written shard where a trainer reads, and the
    next copy-data resumes from the partial file and verifies every shard."""
    import hashlib
    import os

    from tests.conftest import FAB

    corpus = write_corpus(tmp_path / "corpus.txt")
    path = write_cluster(tmp_path / "c.yaml", net, ssh_nodes=[(n, ["trainer"]) for n in NODES],
                         job={"mode": "collective", "trainer": {"command": "true"},
                              "data": {"dir": str(tmp_path / "prepared"), "input": str(corpus)},
                              "watchdog": {"enabled": False}})
    fab("split-data", cluster=path, check=True)
    data = tmp_path / "ws-node3" / "data"
    net.cap("node3", "1mbit")
    net.cut("node3", "loss", 5)
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(tmp_path / "state")}
    # rsync writes a shard under a temp name (.train.txt-00002.XXXXXX) until it is whole
    proc, out, took = cut_mid_file(net, [FAB, "copy-data"], env, data, ".train.txt-")
    assert proc.returncode != 0 and "node3" in out, out
    assert took < 40, f"copy-data ended {took:.0f} s after the cut"
    assert not (data / "train.txt-00002").exists(), "a half-written shard where a trainer reads"
    net.heal("node3")
    manifest = json.loads((tmp_path / "prepared" / "MANIFEST.json").read_text())
    again = fab("copy-data", cluster=path, check=True)
    for i, n in enumerate(NODES):
        shard = tmp_path / f"ws-{n}" / "data" / f"train.txt-{i:05d}"
        assert hashlib.sha256(shard.read_bytes()).hexdigest() == manifest["files"][shard.name]["sha256"]
    assert re.search(r"^node3: .*verified", again.stdout, re.M), again.stdout


def test_thirty_percent_loss_on_a_node_is_no_failure_while_beats_get_through_and_a_hang_is_still_a_hang(fab, root, net):
    hang_timeout = 6
    job = PartitionJob(fab, root, net, hang_timeout=hang_timeout)
    try:
        net.cut("node3", "loss", 30)  # 30 % of what node3 sends and of what it receives, dropped at random
        time.sleep(15)
        assert not any(job.events(n, "job_failed") or job.events(n, "peer_lost") for n in NODES), job.describe()
        assert all(job.run_record(n, f"trainer-{i}").get("program_pid") in job.job_pids(n)
                   for i, n in enumerate(NODES)), job.describe()
        # Still lossy: node3's trainer stops stepping (SIGSTOP), and that is a hang, named, not a lost node.
        pid = job.run_record("node3", "trainer-2")["program_pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        assert wait_for(lambda: job.events("node3", "hang"), timeout=hang_timeout + 10), job.describe()
        assert job.events("node3", "hang")[0]["ts"] - stopped < hang_timeout + 4, job.describe()
        failed = wait_for(lambda: job.events("node1", "job_failed"), timeout=2 * PEER_TIMEOUT)
        assert failed, job.describe()
        assert "trainer-2 on node3 hung" in failed[0]["reason"] and "lost" not in failed[0]["reason"], failed
        assert not any(job.events(n, "peer_lost") for n in NODES), job.describe()
        net.heal("node3")
        assert wait_for(lambda: not any(job.job_pids(n) for n in NODES), timeout=GRACE + 15), job.describe()
    finally:
        job.end()


def test_a_node_whose_beats_connection_is_blocked_stays_in_the_job_on_its_pulses(fab, root, net):
    """node3's TCP to the coordinator's port dropped, its datagrams not (coordination/pulse.py): the
    connection the beats ride is gone for three times fence_after, and neither node3 fences nor the
    coordinator loses it; healed, node3's beats come on a new connection and the job goes on."""
    job = PartitionJob(fab, root, net)
    try:
        pid = job.run_record("node3", "trainer-2")["program_pid"]
        answered = job.health("node3")["coordinator"].get("pulses", 0)
        net.cut("node3", "tcp-port", port=7180)
        assert wait_for(lambda: not job.health("node3")["coordinator"]["connected"], timeout=3 * PEER_TIMEOUT), \
            job.describe()
        time.sleep(3 * fence.fence_after(INTERVAL))
        assert job.health("node3")["coordinator"]["pulses"] > answered, job.describe()
        assert not any(job.events(n, "job_failed") or job.events(n, "peer_lost") for n in NODES), job.describe()
        assert pid in job.job_pids("node3"), job.describe()
        net.heal("node3")
        assert wait_for(lambda: job.health("node3")["coordinator"]["connected"], timeout=3 * PEER_TIMEOUT), \
            job.describe()
        assert all(job.health(n)["job"]["status"] == "running" for n in NODES), job.describe()
        assert pid in job.job_pids("node3"), job.describe()
        assert not any(job.events(n, "job_failed") or job.events(n, "peer_lost") for n in NODES), job.describe()
    finally:
        job.end()


def test_deploy_over_a_capped_link_cut_mid_file_ends_naming_the_node_and_the_next_deploy_completes(fab, tmp_path, net):
    """The project's code to node3 over a capped (tbf) link set down mid-file: `fab deploy` ends within ssh's
    keepalive naming node3, no half-written file is under its final name, and once healed the next deploy ships
    it whole."""
    import hashlib
    import os

    from tests.conftest import FAB

    blob = write_project_with_a_blob(tmp_path / "project")
    path = write_cluster(tmp_path / "c.yaml", net, ssh_nodes=[(n, ["trainer"]) for n in NODES],
                         job={"mode": "collective", "code": "project", "trainer": {"command": "python train.py"},
                              "watchdog": {"enabled": False}})
    ws3 = tmp_path / "ws-node3"
    net.cap("node3", "1mbit")
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(tmp_path / "state")}
    try:  # rsync writes the file under a temp name (.weights.bin.XXXXXX) until it is whole
        proc, out, took = cut_mid_file(net, [FAB, "deploy"], env, ws3, ".weights.bin.")
    finally:
        net.heal("node3")
    assert proc.returncode != 0 and "node3" in out, out
    assert took < 40, f"deploy ended {took:.0f} s after the cut"
    assert all(p.read_bytes() == blob for p in ws3.rglob("weights.bin")), "a half-written file under its name"
    again = fab("deploy", cluster=path, check=True)
    shipped = [p for p in ws3.rglob("weights.bin") if "code" in p.parts]
    assert shipped and all(hashlib.sha256(p.read_bytes()).digest() == hashlib.sha256(blob).digest()
                           for p in shipped), (shipped, again.stdout)
