"""`auto` ports on Slurm, drawn inside the allocation: the plan's tokens, the draw, and a node's busy ports.

The whole path on the real Slurm cluster is tests/slurm/test_slurm_attempts.py's auto-port test.
"""
import json
import random
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.contract import portdraw
from fabtrain.controller import preflight
from fabtrain.errors import UserError
from fabtrain.node import allocports
from fabtrain.plan.plan import Network, make_plan
from fabtrain.slurm import allocports as submit_side
from fabtrain.slurm.script import PLAN_END, plan_data, render, template
from tests.support.sshd import free_port
from tests.unit.test_slurm_config import BASE

JOB = "20261124-000000-abcd"
ROLES = ("pserver", "trainer")


def auto_cluster(mode: str, **job):
    doc = json.loads(json.dumps(BASE))
    doc["job"].update(mode=mode, master_port="auto", watchdog={"port": "auto", "on_failure": "restart",
                                                               "max_restarts": 2}, **job)
    if mode == "pserver":
        doc["job"]["pserver"] = {"port": "auto", "per_node": 2, "ports_num": 2,
                                 "command": "python ps.py --port {port} --master {master_port}"}
        doc["job"]["trainer"] = {"command": "python t.py --endpoints {master_port} --at {master_addr}:{port}"}
    return parse_cluster(doc, "cluster.yaml")


def symbolic_data(cluster):
    network = preflight.choose_ports(cluster, {}, random.Random(7))
    plan = make_plan(cluster, JOB, network=network)
    moved = {s: make_plan(cluster, JOB, network=submit_side.shifted(network, s)) for s in network.auto}
    return network, plan_data(cluster, plan, ROLES, 2.0, moved)


@pytest.mark.parametrize("mode", ["collective", "pserver"])
def test_the_tokens_filled_with_any_ports_are_the_plan_made_with_those_ports(mode):
    cluster = auto_cluster(mode)
    network, data = symbolic_data(cluster)
    assert set(network.auto) == ({"master_port", "watchdog_port"} | ({"pserver_port"} if mode == "pserver" else set()))
    text = json.dumps(data)
    # No stand-in port drawn at submit is left: only tokens, where each auto port goes.
    for port in network.ports.values():
        assert not re.search(rf"\b{port}\b", text), (port, text)
    assert "@slurm-port:master_port+0@" in text and '"@slurm-port": "watchdog_port"' in text
    for seed in range(5):
        rng = random.Random(seed)
        ports = {s: rng.randint(20000, 30000) for s in network.auto}
        expected = template(cluster, make_plan(cluster, JOB, network=Network(ports=ports, auto=network.auto)),
                            ROLES, 2.0)
        filled = portdraw.fill({k: v for k, v in data.items() if k != "ports"}, ports)
        assert filled == expected


@pytest.mark.parametrize("command", ["python t.py --x={master_port}0", "python t.py --id={rank}{master_port}",
                                     "python t.py --x={master_port}{rank}"])
def test_an_auto_port_run_together_with_other_digits_is_one_line_asking_for_a_fixed_port(command):
    """Such a text moves as a longer number, or keeps a leading zero a token would drop: no token can stand
    for it, and a wrong argv must never be started."""
    cluster = auto_cluster("collective", trainer={"command": command, "per_node": 2})
    with pytest.raises(UserError) as e:
        symbolic_data(cluster)
    assert "give that port a fixed number" in str(e.value) and "trainer" in str(e.value).lower(), str(e.value)
    assert "\n" not in str(e.value)


def test_a_plan_without_auto_ports_has_no_tokens_and_no_draw():
    cluster = parse_cluster(BASE, "cluster.yaml")
    plan = make_plan(cluster, JOB, network=Network(ports={"master_port": 29500, "watchdog_port": 7180}))
    script = render(cluster, plan, ROLES, "/home/u")
    assert "@slurm-port" not in script and "allocports" not in script
    with pytest.raises(ValueError):  # a plan with auto ports and nothing to find where they go
        auto = auto_cluster("collective")
        plan_data(auto, make_plan(auto, JOB, network=preflight.choose_ports(auto, {})), ROLES, 2.0)


def test_the_batch_script_clears_the_last_draw_and_fab_plan_shows_the_tokens():
    cluster = auto_cluster("collective", trainer={"command": "python train.py --port {master_port}"})
    network = preflight.choose_ports(cluster, {})
    plan = make_plan(cluster, JOB, network=network)
    moved = {s: make_plan(cluster, JOB, network=submit_side.shifted(network, s)) for s in network.auto}
    script = render(cluster, plan, ROLES, "/home/u", moved=moved)
    lines = script.splitlines()
    # The step's own tasks draw (no step of its own): each attempt starts without the last one's files.
    clear = lines.index('rm -f "$folder/ports.json" "$folder"/busy-*.json')
    step = next(i for i, line in enumerate(lines) if "-m fabtrain.node.allocation" in line)
    assert clear < step and [line for line in lines if line.startswith("srun ")] == [lines[step - 1]]
    readable = render(cluster, plan, ROLES, "/home/u", readable=True, moved=moved)
    assert "node0 trainer-0: python train.py --port @slurm-port:master_port+0@" in readable
    assert f"<<'{PLAN_END}'" in readable and "the port drawn for S in the allocation" in readable


def test_the_draw_keeps_off_busy_and_held_ports_on_the_nodes_that_use_them():
    # master_port on node 0 (and generations +1, +2), a pserver block of 2 on nodes 1 and 2.
    wanted = [("master_port", [(0, 0, 3)]), ("pserver_port", [(1, 0, 2), (2, 0, 2)])]
    window = (100, 120)
    busy = {0: set(range(100, 110)), 1: {112, 113}, 2: set(range(114, 121))}
    held = {1: {110}}
    for seed in range(50):
        got = portdraw.draw(wanted, held, busy, window, random.Random(seed))
        master, pserver = got["master_port"], got["pserver_port"]
        assert all(p not in busy[0] for p in range(master, master + 3)) and master + 2 <= 120
        block = set(range(pserver, pserver + 2))
        assert not block & (busy[1] | held[1] | busy[2]) and pserver + 1 <= 120
    with pytest.raises(LookupError) as e:
        portdraw.draw([("watchdog_port", [(0, 0, 1)])], {}, {0: set(range(100, 121))}, window, random.Random(1))
    assert e.value.args == ("watchdog_port",)


def write_plan(folder, window, nodes=2):
    data = {"job_id": JOB, "nodes": [{"job": {"workspace": str(folder / f"node{i}")}} for i in range(nodes)],
            "ports": {"auto": [["master_port", [[0, 0, 1]]], ["watchdog_port", [[1, 0, 1]]]],
                      "held": [], "window": list(window)}}
    (folder / allocports.PLAN).write_text(json.dumps(data))
    return data


def test_each_node_reports_the_ports_its_sockets_hold_and_node_0_draws_off_them_for_all(tmp_path):
    listeners = []
    try:
        # A window of three ports, two of them held by real listening sockets here: a block handed out to this
        # test alone, below the kernel's ephemeral range (no outgoing connection takes the third meanwhile).
        lo = free_port(["127.0.0.1"])
        listeners = [socket.create_server(("127.0.0.1", p)) for p in (lo, lo + 1)]
        data = write_plan(tmp_path, (lo, lo + 2))
        # Node 1's task reports and waits for the draw; node 0's waits for node 1's report, then draws.
        with ThreadPoolExecutor(2) as pool:
            later = pool.submit(allocports.report_and_draw, str(tmp_path), {"SLURM_NODEID": "1"}, data, 10)
            time.sleep(0.2)
            first = allocports.report_and_draw(str(tmp_path), {"SLURM_NODEID": "0"}, data, 10)
            second = later.result(timeout=10)
        assert first == second == {"master_port": lo + 2, "watchdog_port": lo + 2}  # one each on nodes 0 and 1
        reports = [json.loads((tmp_path / (allocports.BUSY % i)).read_text()) for i in range(2)]
        assert [r["node"] for r in reports] == [0, 1] and all({lo, lo + 1} <= set(r["busy"]) for r in reports)
        assert (tmp_path / allocports.DRAWN).stat().st_mode & 0o777 == 0o600
    finally:
        for s in listeners:
            s.close()


def test_a_node_that_did_not_report_and_a_full_window_are_each_one_line_on_every_node(tmp_path):
    data = write_plan(tmp_path, (20000, 20001))
    with pytest.raises(SystemExit) as e:  # node 1's task never came
        allocports.report_and_draw(str(tmp_path), {"SLURM_NODEID": "0"}, data, wait=0.2)
    said = ("fabtrain: node 1 of the allocation did not say which ports it has busy: "
            "auto ports cannot be drawn")
    assert str(e.value) == said
    with pytest.raises(SystemExit) as e:  # a node that comes late is told why, by the draw's file
        allocports.report_and_draw(str(tmp_path), {"SLURM_NODEID": "1"}, data, wait=0.2)
    assert str(e.value) == said
    (tmp_path / (allocports.BUSY % 0)).write_text(json.dumps({"node": 0, "busy": [20000, 20001]}))
    (tmp_path / (allocports.BUSY % 1)).write_text(json.dumps({"node": 1, "busy": []}))
    with pytest.raises(SystemExit) as e:
        allocports.draw(data, allocports.reports(str(tmp_path), 2))
    assert str(e.value) == ("fabtrain: auto port master_port: no port in 20000-20001 is free on every node "
                            "that uses it; give a port in cluster.yaml")
    (tmp_path / allocports.DRAWN).unlink()
    with pytest.raises(SystemExit) as e:  # node 0 never drew
        allocports.report_and_draw(str(tmp_path), {"SLURM_NODEID": "1"}, data, wait=0.2)
    assert str(e.value).startswith("fabtrain: node 0 of the allocation drew no auto ports within 0.2 s")
    with pytest.raises(SystemExit, match="no auto ports drawn in .*ports.json"):
        allocports.drawn(str(tmp_path), {"ports": {}})


def test_fab_status_says_the_ports_the_allocation_drew_and_auto_before_the_draw():
    from fabtrain.controller.report import ports_text
    ports = {"master_port": None, "watchdog_port": None, "pserver_port": 7000}
    assert ports_text(ports, ("master_port", "watchdog_port")) == (
        "ports: master_port auto (drawn in the allocation), watchdog_port auto (drawn in the allocation), "
        "pserver_port 7000")
    drawn = {"master_port": 23817, "watchdog_port": 27402}
    assert ports_text({**ports, **drawn}, ("master_port", "watchdog_port"), drawn=drawn) == (
        "ports: master_port 23817 (auto, drawn in the allocation), watchdog_port 27402 (auto, drawn in the "
        "allocation), pserver_port 7000")
