"""The node side of the network check (fabtrain/node/netcheck.py), on this machine's real sockets."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

from fabtrain.node import netcheck
from tests.support.procscan import wait_for
from tests.support.sshd import free_port

from tests.support import REPO

HOLDER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("ready", flush=True); time.sleep(60)
"""


def hold(address, port, env=None):
    """A process of its own listening on address:port (as another program on the node would)."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, address, str(port)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    assert p.stdout.readline().strip() == "ready"
    return p


def test_the_interface_carrying_an_address_is_found_even_when_not_listed():
    assert netcheck.iface_of("127.0.0.1") == "lo"
    assert netcheck.iface_of("127.0.0.2") == "lo"  # not on any interface, but local: lo's subnet
    for name, address, _ in netcheck.ipv4_interfaces():
        assert netcheck.iface_of(address) == name
    assert netcheck.iface_of("198.51.100.7") is None  # TEST-NET-2: nobody's here
    local, iface = netcheck.route_to("127.0.0.3")
    assert local.startswith("127.") and iface == "lo"


def test_a_taken_port_names_the_process_and_its_job():
    port = free_port(["127.0.0.2"])
    holder = hold("127.0.0.2", port, {"FABTRAIN_WORKSPACE": "/tmp/ws-other", "FABTRAIN_JOB_ID": "J9"})
    try:
        reply = netcheck.run({"node": "n1", "workspace": "/tmp/ws", "address": "127.0.0.2",
                              "listen": [{"port": port, "what": "pserver 0"}, {"port": port + 1, "what": "pserver 0"}]})
        taken, free = reply["listen"]
        assert taken["state"] == "taken" and free["state"] == "ok"
        assert taken["owner"]["pid"] == holder.pid and HOLDER.strip()[:20] in taken["owner"]["command"]
        assert (taken["owner"]["workspace"], taken["owner"]["job_id"]) == ("/tmp/ws-other", "J9")
        assert reply["iface"] == "lo" and reply["address_local"] is True
    finally:
        holder.kill()
        holder.wait()


def test_listeners_answer_the_other_node_and_leave_no_time_wait_on_their_port():
    ports = {"a": free_port(["127.0.0.2"]), "b": free_port(["127.0.0.3"])}
    replies = {}

    def node(name, address, other, other_address):
        replies[name] = netcheck.run({
            "node": name, "workspace": "/tmp/ws-" + name, "address": address, "peers": [other_address],
            "serve": True, "token": "tok", "deadline": 5,
            "listen": [{"port": ports[name], "what": "p", "expect": 1}],
            "reach": [{"node": other, "address": other_address, "port": ports[other], "what": "p"}]})

    a = threading.Thread(target=node, args=("a", "127.0.0.2", "b", "127.0.0.3"))
    b = threading.Thread(target=node, args=("b", "127.0.0.3", "a", "127.0.0.2"))
    a.start()
    time.sleep(0.3)  # b's listener comes up late: a retries until it is there
    b.start()
    a.join(10)
    b.join(10)
    for name in "ab":
        (listened,), (reached,) = replies[name]["listen"], replies[name]["reach"]
        assert listened["state"] == "ok" and listened["accepted"] == 1
        assert reached["state"] == "ok" and reached["iface"] == "lo"
    assert replies["a"]["reach"][0]["attempts"] > 1
    # The client closed first: no TIME_WAIT holds either listener's port.
    left = [(p, st) for p, st, _ in netcheck.tcp_sockets() if p in ports.values() and st == netcheck.TCP_TIME_WAIT]
    assert left == []


def test_a_port_that_another_program_answers_or_nobody_does_is_told_apart():
    port = free_port(["127.0.0.2"])
    holder = hold("127.0.0.2", port)
    try:
        reply = netcheck.run({"node": "x", "workspace": "/tmp/ws-x", "address": "127.0.0.4", "serve": True,
                              "token": "tok", "deadline": 1.5,
                              "reach": [{"node": "n1", "address": "127.0.0.2", "port": port, "what": "pserver 0"},
                                        {"node": "n1", "address": "127.0.0.2", "port": port + 1, "what": "pserver 0"}]})
    finally:
        holder.kill()
        holder.wait()
    other, nobody = reply["reach"]
    assert other["state"] == "other"  # connected, but no check token: some other program holds it
    assert nobody["state"] == "refused" and nobody["attempts"] > 3  # retried until the deadline


def test_ports_claimed_by_a_running_job_are_seen_before_it_binds_them(tmp_path):
    ws = tmp_path / "ws"
    (ws / "jobs" / "J1").mkdir(parents=True)
    (ws / "jobs" / "J1" / "job.json").write_text(json.dumps({"listens": [[23456, 2, "pserver 0", "127.0.0.2"]]}))
    sleeper = subprocess.Popen(["sleep", "30"], env={**os.environ, "FABTRAIN_WORKSPACE": str(ws), "FABTRAIN_JOB_ID": "J1"})
    try:
        claims = wait_for(lambda: [c for c in netcheck.claimed_ports("/elsewhere", None) if c["job_id"] == "J1"])
        assert claims == [{"port": 23456, "count": 2, "what": "pserver 0", "address": "127.0.0.2",
                           "workspace": str(ws), "job_id": "J1"}]
        assert not [c for c in netcheck.claimed_ports(str(ws), "J1") if c["job_id"] == "J1"]  # its own job
    finally:
        sleeper.kill()
        sleeper.wait()


def test_node_modules_need_only_the_standard_library():
    code = ("import sys; sys.path.insert(0, %r); import fabtrain.node.netcheck, fabtrain.node.bandwidth; "
            "assert 'torch' not in sys.modules and 'yaml' not in sys.modules; print('ok')" % str(REPO))
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_free_ports_and_bound_ones_are_told_apart():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # a port nobody holds (the kernel's pick, no SO_REUSEADDR)
        s.listen()
        port = s.getsockname()[1]
        assert port in netcheck.busy_ports(port - 1, port + 1)
    assert port not in netcheck.busy_ports(port, port)


def test_a_start_probe_asks_only_the_nodes_holding_the_jobs_ports_what_is_busy(tmp_path):
    """A start's probe decides the auto ports and refuses a taken fixed one from the nodes that hold
    them; the others are not asked for busy ports or other jobs' claims (a read of /proc/net/tcp and of
    every process's environment there), while every node still answers for its address."""
    from fabtrain.config.cluster import load_cluster
    from fabtrain.controller import preflight
    from fabtrain.remote.session import Session
    from tests.support.sshd import write_cluster

    # Collective: rank 0's master port and the watchdog's coordinator are both on n0, the first node.
    path = write_cluster(tmp_path / "cluster.yaml", None,
                         local_nodes=[("n0", ["trainer"]), ("n1", ["trainer"]), ("n2", ["trainer"])],
                         job={"name": "probe", "mode": "collective", "watchdog": {"interval": 1}})
    session = Session(load_cluster(str(path)))
    try:
        network, found = preflight.probe(session, None)
    finally:
        session.close()
    replies = found.replies
    assert all(r.ok for r in replies.values()), replies
    assert replies["n0"].value.busy is not None  # a list, maybe empty: asked
    assert replies["n1"].value.busy is None and replies["n2"].value.busy is None
    assert replies["n1"].value.claimed == replies["n2"].value.claimed == []
    assert all(r.value.address_ip == "127.0.0.1" for r in replies.values())
    assert {"master_port", "watchdog_port"} <= set(network.ports) and not found.problems, found.problems
