"""The plan's network: interface pinning, `auto` ports, the ports the job holds (pure: no node asked)."""
import random

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.contract.opreplies import Claim, Netcheck
from fabtrain.controller.preflight import choose_ports
from fabtrain.errors import UserError
from fabtrain.plan.plan import Network, make_plan
from fabtrain.plan.ports import AUTO_WINDOW, clashes, port_uses
from fabtrain.remote.transport import Reply

NODES = [{"name": "a", "host": "10.0.0.1", "roles": ["pserver", "trainer"]},
         {"name": "b", "host": "10.0.0.2", "roles": ["trainer"], "iface": "ib0"},
         {"name": "c", "host": "10.0.0.3", "roles": ["pserver", "trainer"]}]


def cluster(job=None, nodes=None):
    return parse_cluster({"cluster": {"name": "t", "workspace": "/ws"}, "nodes": nodes or NODES,
                          "job": job or {"mode": "pserver"}}, "t.yaml")


def env_of(plan, node):
    return [p.env for p in plan.node(node).processes]


def test_gloo_and_nccl_are_pinned_to_the_interface_found_unless_iface_or_job_env_says():
    c = cluster()
    plan = make_plan(c, "J", network=Network(ports={}, ifaces={"a": "eth0", "b": "eth7", "c": "eth1"}))
    assert {(e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) for e in env_of(plan, "a")} == {("eth0", "eth0")}
    assert {e["GLOO_SOCKET_IFNAME"] for e in env_of(plan, "b")} == {"ib0"}  # the node's own iface: wins
    pinned = cluster({"mode": "pserver", "env": {"NCCL_SOCKET_IFNAME": "ib1"}})
    plan = make_plan(pinned, "J", network=Network(ports={}, ifaces={"a": "eth0"}))
    assert {(e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) for e in env_of(plan, "a")} == {("eth0", "ib1")}
    # Nothing probed: the plan says what start will find.
    assert env_of(make_plan(c, "J"), "c")[0]["GLOO_SOCKET_IFNAME"] == "<iface of 10.0.0.3>"


@pytest.mark.parametrize("field,value,words", [
    ("iface", "eth0;reboot", "not a valid interface name"),
    ("iface", "a-name-far-too-long", "not a valid interface name"),
])
def test_a_bad_iface_is_one_line(field, value, words):
    nodes = [dict(NODES[0], **{field: value})] + NODES[1:]
    with pytest.raises(UserError, match=rf"nodes\[0\]\.{field}: .*{words}"):
        cluster(nodes=nodes)


@pytest.mark.parametrize("job,where", [
    ({"master_port": "automatic"}, "job.master_port"),
    ({"pserver": {"port": "7164"}}, "job.pserver.port"),
    ({"watchdog": {"port": 0}}, "job.watchdog.port"),
])
def test_a_port_is_a_number_or_auto(job, where):
    with pytest.raises(UserError, match=rf"{where}: must be"):
        cluster({"mode": "pserver", **job})


def test_auto_ports_need_the_probe_and_land_in_job_json():
    c = cluster({"mode": "pserver", "master_port": "auto", "pserver": {"port": "auto", "ports_num": 2},
                 "watchdog": {"port": "auto"}})
    assert (c.job.master_port, c.job.pserver.port, c.job.watchdog.port) == (None, None, None)
    with pytest.raises(ValueError, match="auto"):
        make_plan(c, "J")
    network = Network(ports={"master_port": 21000, "pserver_port": 22000, "watchdog_port": 23000},
                      auto=("master_port", "pserver_port", "watchdog_port"))
    plan = make_plan(c, "J", network=network)
    job = plan.job_json("c")
    assert job["ports"] == {"master_port": 21000, "pserver_port": 22000, "watchdog_port": 23000,
                            "auto": ["master_port", "pserver_port", "watchdog_port"]}
    assert job["listens"] == [[22000, 3, "pserver 1", "10.0.0.3"]]
    assert plan.job_json("a")["listens"] == [[22000, 3, "pserver 0", "10.0.0.1"], [23000, 1, "watchdog coordinator", "10.0.0.1"]]
    assert plan.job_json("a")["watchdog"]["coordinator"]["port"] == 23000
    assert env_of(plan, "b")[0]["PADDLE_INIT_PORT"] == "22000" and env_of(plan, "b")[0]["MASTER_PORT"] == "21000"


def test_the_ports_a_job_holds_follow_the_plans_layout():
    shared = [{"name": "x", "host": "local", "roles": ["pserver", "trainer"], "workspace": "/w1"},
              {"name": "y", "host": "local", "roles": ["pserver"], "workspace": "/w2"}]
    c = cluster({"mode": "pserver", "pserver": {"port": 7000, "per_node": 2}}, nodes=shared)
    uses = port_uses(c, {"pserver_port": 7000, "master_port": 29500, "watchdog_port": 7180})
    # Two nodes on one address: consecutive ranges, never the same port (and master_port is unchecked here).
    assert [(u.node, u.port, u.count, u.what) for u in uses] == [
        ("x", 7000, 2, "pserver 0"), ("x", 7002, 2, "pserver 1"), ("y", 7004, 2, "pserver 2"),
        ("y", 7006, 2, "pserver 3"), ("x", 7180, 1, "watchdog coordinator")]
    collective = cluster({"mode": "collective", "master_port": 29500}, nodes=[dict(n, roles=["trainer"]) for n in NODES])
    assert [(u.node, u.port, u.what) for u in port_uses(collective, {"master_port": 29500, "watchdog_port": 7180})] == [
        ("a", 29500, "master (rank 0)"), ("a", 7180, "watchdog coordinator")]


def replies(busy=None, claimed=None, ifaces=None):
    out = {}
    for n in ("a", "b", "c"):
        out[n] = Reply(n, True, Netcheck(busy=sorted((busy or {}).get(n, [])),
                                         claimed=[Claim(**c) for c in (claimed or {}).get(n, [])],
                                         iface=(ifaces or {}).get(n, "eth0")))
    return out


def test_auto_ports_avoid_busy_and_claimed_ports_on_the_nodes_concerned():
    c = cluster({"mode": "pserver", "pserver": {"port": "auto", "ports_num": 2}, "watchdog": {"port": "auto"}})
    lo, hi = AUTO_WINDOW
    # Everything busy on node c (a pserver) but a few ports; node b (no pserver) is full and does not matter.
    free_on_c = {25000, 25001, 25002, 25003, 26000}
    busy = {"c": set(range(lo, hi + 1)) - free_on_c, "b": set(range(lo, hi + 1))}
    claimed = {"a": [{"port": 25000, "count": 1}]}  # another job's, not bound yet
    for seed in range(20):
        network = choose_ports(c, replies(busy, claimed), random.Random(seed))
        base = network.ports["pserver_port"]
        assert {base, base + 1, base + 2} <= free_on_c and base != 25000  # 3 ports a pserver, all free
        assert network.ports["watchdog_port"] not in range(base, base + 3)
        assert network.auto == ("pserver_port", "watchdog_port") and network.ports["master_port"] == 29500
    with pytest.raises(UserError, match=r"job.pserver.port: auto: no free port"):
        choose_ports(c, replies(busy={"c": set(range(lo, hi + 1))}))


def test_two_of_the_jobs_own_ports_on_one_node_are_a_problem():
    c = cluster({"mode": "collective", "master_port": 7180}, nodes=[dict(n, roles=["trainer"]) for n in NODES])
    found = clashes(port_uses(c, {"master_port": 7180, "watchdog_port": 7180}))
    assert found == ["a: port 7180 is both master (rank 0) (job.master_port) and watchdog coordinator "
                     "(job.watchdog.port): change one, or set it to auto"]


def test_only_the_ports_the_mode_uses_are_shown_and_recorded():
    from fabtrain.contract.opreplies import Start
    from fabtrain.controller.lifecycle import StartResult
    from fabtrain.controller.report import plan_text, start_text
    collective = cluster({"mode": "collective", "master_port": 29500},
                         nodes=[dict(n, roles=["trainer"]) for n in NODES])
    network = choose_ports(collective, replies())
    assert network.ports == {"master_port": 29500, "watchdog_port": 7180}  # what the controller's state records
    plan = make_plan(collective, "J", network=network)
    assert set(plan.job_json("a")["ports"]) == {"master_port", "watchdog_port", "auto"}
    started = start_text(StartResult("J", plan, [Reply("a", True, Start(job_dir="/w/jobs/J", started=[], failed=[],
                                                                        warnings=[]))]),
                         ("trainer",))
    for text in (started, plan_text(plan)):
        assert "master_port 29500" in text and "watchdog_port 7180" in text and "pserver_port" not in text, text
    quiet = cluster({"mode": "collective", "watchdog": {"enabled": False}}, nodes=[dict(n, roles=["trainer"]) for n in NODES])
    assert make_plan(quiet, "J").ports == {"master_port": 29500}
    pserver = make_plan(cluster({"mode": "pserver"}), "J")
    assert set(pserver.ports) == {"master_port", "pserver_port", "watchdog_port"}
