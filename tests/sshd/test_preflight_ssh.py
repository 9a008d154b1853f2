"""The network preflight on real sshd nodes: taken ports named and refused before
anything starts, `auto` ports, interface pinning, two jobs side by side, bandwidth."""
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from fabtrain.node import netcheck
from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

TICKER = "python tests/programs/ticker.py"
NODES = [("node1", ["pserver", "trainer"]), ("node2", ["trainer"]), ("node3", ["trainer"])]


def make_cluster(root: Path, sshd, job: dict, name="net", nodes=NODES) -> tuple[Path, list[Path]]:
    root.mkdir(parents=True, exist_ok=True)
    job = {"name": "net", "trainer": {"command": TICKER}, **job}
    path = write_cluster(root / "cluster.yaml", sshd, ssh_nodes=nodes, job=job, name=name)
    return path, [root / f"ws-{n}" for n, _ in nodes]


def kill_all(path):
    subprocess.run([FAB, "kill-all", "--grace", "1"], cwd=REPO, capture_output=True,
                   env={**os.environ, "FABTRAIN_CLUSTER": str(path)})


def listen_on(address, port):
    s = socket.socket()
    s.bind((address, port))
    s.listen()
    return s


def recorded(workspace: Path) -> dict:
    """The job.json of the node's current job."""
    return json.loads((workspace / "current" / "job.json").read_text())


def ticker_env(workspace: Path, role: str, rank: int) -> dict:
    path = workspace / f"env-{role}-{rank}.json"
    return json.loads(wait_for(lambda: path.exists() and path.read_text(), timeout=30))["env"]


@pytest.mark.parametrize("mode", ["pserver", "collective"])
def test_a_taken_port_is_named_by_check_refused_by_start_and_auto_starts_anyway(fab, tmp_path, sshd, mode):
    port = free_port(["127.0.0.2"])
    setting = {"pserver": {"pserver": {"port": port, "command": TICKER}},
               "collective": {"master_port": port}}[mode]
    nodes = NODES if mode == "pserver" else [(n, ["trainer"]) for n, _ in NODES]
    job = {"mode": mode, "watchdog": {"port": "auto"}, **setting}
    cluster, workspaces = make_cluster(tmp_path, sshd, job, nodes=nodes)
    what = "pserver 0" if mode == "pserver" else "master (rank 0)"
    field = "job.pserver.port" if mode == "pserver" else "job.master_port"
    holder = listen_on("127.0.0.2", port)  # node1's address: another program holds the job's port there
    try:
        out = fab("check", cluster=cluster)
        assert out.returncode == 1, out.stdout + out.stderr
        line = f"node1: port {port} ({what}) is in use by pid {os.getpid()} ("
        assert line in out.stdout and f"set {field}: auto" in out.stdout, out.stdout
        assert re.search(rf"^node1 .* {port} TAKEN", out.stdout, re.M), out.stdout

        start = "start-pserver" if mode == "pserver" else "start-trainers"
        out = fab("deploy", start, cluster=cluster)
        assert out.returncode == 2 and "nothing was started" in out.stderr, out.stdout + out.stderr
        assert f"fab {start}: node1: port {port} ({what}) is in use by pid {os.getpid()}" in out.stderr
        assert live_marked(workspaces) == []  # /proc: no process of this cluster on any node
        assert not any((ws / "jobs").exists() and list((ws / "jobs").iterdir()) for ws in workspaces)

        # The same job with the port set to auto starts, on a port that is free.
        doc = yaml.safe_load(cluster.read_text())
        if mode == "pserver":
            doc["job"]["pserver"]["port"] = "auto"
        else:
            doc["job"]["master_port"] = "auto"
        cluster.write_text(yaml.safe_dump(doc))
        steps = ["start-pserver", "start-trainers"] if mode == "pserver" else ["start-trainers"]
        out = fab(*steps, cluster=cluster, check=True)
        key = "pserver_port" if mode == "pserver" else "master_port"
        chosen = recorded(workspaces[0])["ports"][key]
        assert chosen != port and key in recorded(workspaces[0])["ports"]["auto"]
        assert f"{key} {chosen} (auto)" in out.stdout
        env = ticker_env(workspaces[1], "trainer", 1)
        assert env["PADDLE_INIT_PORT" if mode == "pserver" else "MASTER_PORT"] == str(chosen)
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
        status = fab("status", cluster=cluster)
        assert f"{key} {chosen} (auto)" in status.stdout, status.stdout
    finally:
        holder.close()
        kill_all(cluster)


def test_a_job_that_elects_has_each_nodes_ballot_box_udp_port_named_by_check_and_refused_by_start(fab, tmp_path, sshd):
    """Each agent of a job that elects binds its ballot box on the coordinator's port + 1 (UDP): another program
    holding it on node2 is one line naming node2, the port and the holder, and nothing starts."""
    port = free_port(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    job = {"mode": "collective", "watchdog": {"port": port, "on_failure": "restart", "min_nodes": 2}}
    cluster, workspaces = make_cluster(tmp_path, sshd, job, nodes=[(n, ["trainer"]) for n, _ in NODES])
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.0.3", port + 1))  # node2's address: another program holds its ballot box's port
    try:
        line = f"node2: port {port + 1} (ballot box (UDP, watchdog port + 1)) is in use by pid {os.getpid()} ("
        out = fab("check", cluster=cluster)
        assert out.returncode == 1 and line in out.stdout and "set job.watchdog.port: auto" in out.stdout, \
            out.stdout + out.stderr
        out = fab("deploy", "start-trainers", cluster=cluster)
        assert out.returncode == 2 and "nothing was started" in out.stderr, out.stdout + out.stderr
        assert f"fab start-trainers: {line}" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert live_marked(workspaces) == []
    finally:
        holder.close()
        kill_all(cluster)


def api_job(cluster: Path, state_dir: Path, monkeypatch) -> dict:
    """/api/job of a dashboard over a real collector of that cluster (the controller's state: the fab runs')."""
    from fabtrain.config.cluster import load_cluster
    from fabtrain.controller.collector import Collector
    from fabtrain.dashboard import create_app
    from fabtrain.remote.session import Session
    monkeypatch.setenv("FABTRAIN_STATE_DIR", str(state_dir))
    session = Session(load_cluster(cluster))
    try:
        collector = Collector(session)
        collector.poll()
        app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": "t" * 32, "ALLOWED_HOSTS": ["h:1"], "TESTING": True})
        return app.test_client().get("/api/job", headers={"Host": "h:1", "Authorization": "Bearer " + "t" * 32}).get_json()
    finally:
        session.close()


def test_two_jobs_on_the_same_nodes_with_auto_ports_run_and_stop_apart(fab, tmp_path, sshd, monkeypatch):
    auto = {"mode": "pserver", "master_port": "auto", "pserver": {"port": "auto", "command": TICKER},
            "watchdog": {"port": "auto", "interval": 0.5}}
    a, a_ws = make_cluster(tmp_path / "alice", sshd, auto, name="alice")
    b, b_ws = make_cluster(tmp_path / "bob", sshd, auto, name="bob")
    try:
        fab("deploy", "start-pserver", "start-trainers", cluster=a, check=True)
        fab("deploy", "start-pserver", "start-trainers", cluster=b, check=True)
        ports_a, ports_b = recorded(a_ws[0])["ports"], recorded(b_ws[0])["ports"]
        for key in ("pserver_port", "watchdog_port"):
            assert ports_a[key] != ports_b[key], (ports_a, ports_b)
        # Both watchdogs' coordinators listen: neither lost its port to the other.
        for ports in (ports_a, ports_b):
            assert wait_for(lambda: _listening("127.0.0.2", ports["watchdog_port"]), timeout=30)
        assert live_marked(a_ws) and live_marked(b_ws)

        fab("kill-all", cluster=a, check=True)
        assert live_marked(a_ws) == []
        assert len(live_marked(b_ws)) >= 6  # bob's pserver, 3 trainers and 3 agents live on
        out = fab("status", cluster=b, check=True)
        assert out.stdout.count("running") >= 4
        assert f"pserver_port {ports_b['pserver_port']} (auto)" in out.stdout
        job = api_job(b, tmp_path / "controller-state", monkeypatch)
        assert job["ports"] == ports_b and job["state"] == "running", job
    finally:
        kill_all(a)
        kill_all(b)


def _listening(address, port):
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def test_plan_shows_the_interface_each_node_is_pinned_to(fab, tmp_path, sshd):
    nodes = [("node1", ["pserver", "trainer"]), ("node2", ["trainer"])]
    cluster, _ = make_cluster(tmp_path, sshd, {"mode": "pserver", "pserver": {"port": "auto", "command": TICKER}},
                              nodes=nodes)
    out = fab("plan", cluster=cluster, check=True)
    assert out.stdout.count("GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo") == 3  # pserver-0, trainer-0, trainer-1
    assert re.search(r"pserver_port \d+ \(auto\)", out.stdout)
    out = fab("plan", "--offline", cluster=cluster, check=True)
    assert "GLOO_SOCKET_IFNAME='<iface of 127.0.0.2>'" in out.stdout
    # A node's own iface: wins, and job.env over both.
    doc = yaml.safe_load(cluster.read_text())
    doc["nodes"][1]["iface"] = "eth9"
    doc["job"]["env"] = {"NCCL_SOCKET_IFNAME": "ib0"}
    cluster.write_text(yaml.safe_dump(doc))
    out = fab("plan", cluster=cluster, check=True)
    assert "GLOO_SOCKET_IFNAME=eth9" in out.stdout and "NCCL_SOCKET_IFNAME=ib0" in out.stdout


def test_a_node_whose_address_is_not_its_own_cannot_be_reached_and_check_says_so(fab, tmp_path, sshd):
    cluster, _ = make_cluster(tmp_path, sshd, {"mode": "pserver", "pserver": {"port": "auto", "command": TICKER},
                                               "watchdog": {"enabled": False}})
    doc = yaml.safe_load(cluster.read_text())
    doc["nodes"][0]["address"] = "198.51.100.7"  # TEST-NET-2: where the others would look for node1
    cluster.write_text(yaml.safe_dump(doc))
    out = fab("check", cluster=cluster, timeout=120)
    assert out.returncode == 1
    assert re.search(r"^node2: cannot reach node1 198\.51\.100\.7:\d+ \(pserver 0\): ", out.stdout, re.M), out.stdout
    assert "198.51.100.7 is not an address of that machine" in out.stdout


def test_bandwidth_runs_an_all_reduce_on_three_nodes_and_leaves_nothing(fab, tmp_path, sshd):
    cluster, workspaces = make_cluster(tmp_path, sshd, {"mode": "pserver", "pserver": {"port": "auto"},
                                                        "watchdog": {"port": "auto"}})
    out = fab("check", "--bandwidth", cluster=cluster, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    met = re.search(r"all-reduce of 16\.0 MiB over 3 nodes \(gloo, met at 127\.0\.0\.2:(\d+)\): bus \d+\.\d\d Gb/s",
                    out.stdout)
    assert met, out.stdout
    assert re.search(r"slowest node: node[123] \(its link to the next node: \d+\.\d\d Gb/s\)", out.stdout)
    assert "do not say their speed" in out.stdout  # lo has no /sys/class/net/lo/speed
    # Cleaned up: rank 0's store is closed and no process holds its port.
    port = int(met.group(1))
    assert wait_for(lambda: not netcheck.busy_ports(port, port), timeout=10), netcheck.port_owner(port)
    assert live_marked(workspaces) == []
