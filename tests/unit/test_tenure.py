"""A coordinator's term as server.py keeps it (coordination/tenure.py): lines stamped, the lease from the beats'
echoes, the first term counting once a majority echoed, stepping down (no majority, a newer term named)."""
from __future__ import annotations

import time

from fabtrain.node.coordination.election import Lease
from fabtrain.node.coordination.tenure import Tenure

NODES = ("n1", "n2", "n3")


def test_a_line_carries_the_term_the_coordinators_node_and_its_monotonic_time():
    line = Tenure("n2", Lease(NODES, "n2", 2, 4.0, 0.0)).stamp({"op": "status", "status": "running"})
    assert (line["op"], line["term"], line["by"]) == ("status", 2, "n2")
    assert abs(line["t"] - time.monotonic()) < 1.0


def test_the_first_term_counts_only_once_a_majority_has_echoed_then_holds_on_echoes_and_steps_down_without():
    t = Tenure("n1", Lease(NODES, "n1", 1, 4.0, asked=0.0))
    assert not t.armed() and t.holds(100.0)  # the agents are still starting: nothing to count yet
    t.beat({"node": "n2", "term": 1, "echo": 99.0})
    assert t.armed() and t.holds(100.0)
    t.beat({"node": "n2", "echo": 101.0})  # the term is named once; later beats leave it out
    assert t.holds(104.5)
    assert not t.holds(105.5) and "heard 1 of 3 trainer nodes" in t.stepped_down
    t.beat({"node": "n2", "echo": 105.4})
    assert not t.holds(105.6), "a coordinator that stepped down stays down"


def test_a_beat_queued_while_the_coordinator_was_paused_counts_from_the_line_it_echoes():
    t = Tenure("n1", Lease(NODES, "n1", 1, 4.0, asked=0.0))
    t.beat({"node": "n2", "term": 1, "echo": 10.0})
    t.beat({"node": "n2", "echo": 10.5})  # arrives at 30 (the coordinator was stopped): it echoes 10.5
    assert not t.holds(30.0)


def test_a_beat_naming_a_newer_term_makes_it_step_down_at_once():
    t = Tenure("n2", Lease(NODES, "n2", 2, 4.0, asked=10.0, voters=("n2", "n3")))
    assert t.holds(11.0)
    t.beat({"node": "n3", "term": 3, "echo": 10.9})
    assert not t.holds(11.0) and "names term 3" in t.stepped_down


def test_where_no_successor_could_go_on_the_lease_lost_ends_the_job_as_without_an_election():
    from tests.unit.test_elastic import board as elastic_board

    b = elastic_board(max_restarts=3)  # n1..n3 beat at 0, min_nodes 2
    b.out = frozenset({"n3"})  # n3 left the job earlier: without n1 only n2 would be left
    t = Tenure("n1", Lease(NODES, "n1", 1, 4.0, asked=0.0))
    t.beat({"node": "n2", "term": 1, "echo": 1.0})
    held, events = t.check(b, 6.0, 1006.0)
    assert held and t.stepped_down is None and b.status["status"] == "failed"
    assert "node n2 lost" in b.status["reason"] and "fewer than min_nodes (2)" in b.status["reason"]
    assert t.check(b, 60.0, 1060.0) == (True, [])  # an ended job's coordinator keeps saying so; it starts nothing


def test_where_a_successor_could_go_on_the_lease_lost_steps_down_and_the_board_is_left_as_it_was():
    from tests.unit.test_elastic import board as elastic_board

    b = elastic_board(max_restarts=3)
    t = Tenure("n1", Lease(NODES, "n1", 1, 4.0, asked=0.0))
    t.beat({"node": "n2", "term": 1, "echo": 1.0})
    before = dict(b.status)
    assert t.check(b, 6.0, 1006.0) == (False, []) and "steps down" in t.stepped_down
    assert b.status == before and not b.out


def test_the_node_of_a_coordinator_that_stepped_down_fences_at_once_and_a_restart_it_waited_for_never_starts():
    from fabtrain.contract.states import JobState
    from fabtrain.node.agent.policy import Config, Ledger, Observation, Peers, Status, decide

    cfg = Config(node="n1", job_id="J", interval=1.0, hang_timeout=3.0, startup_timeout=60.0, grace=2.0,
                 on_failure="restart", coordinator_node="n1", coordinator="10.0.0.1:7180", elastic=True)
    why = "coordinator n1 (term 1) heard 1 of 3 trainer nodes within its lease (4.0 s), fewer than a majority (2)"
    waiting = Ledger(generation=1, status=Status(JobState.RESTARTING, "n3 left"), restart_at=20.0)
    peers = Peers(ever_connected=True, connected=True, silent_for=0.1, lease_age=0.1, deposed=why)
    actions, ledger = decide(Observation(now=10.0, peers=peers), waiting, cfg)
    (fenced,) = [a for a in actions if getattr(a, "kind", None) == "peer_lost"]
    assert fenced.reason.startswith(why + "; this node fences itself")
    assert ledger.status.status == JobState.FAILED and ledger.restart_at is None
    # not deposed, the same lease is no fence
    assert decide(Observation(now=10.0, peers=Peers(ever_connected=True, connected=True, silent_for=0.1,
                                                    lease_age=0.1)), waiting, cfg)[1].restart_at == 20.0


def test_a_job_that_elects_has_the_coordinators_port_checked_free_on_every_node_others_on_the_first_only():
    from fabtrain.plan.ports import elects, port_uses
    from tests.unit.test_elastic import cluster

    ports = {"master_port": 29500, "watchdog_port": 7180}
    coordinator = [(u.node, u.port) for u in port_uses(cluster(), ports) if u.setting == "watchdog_port" and not u.udp]
    assert elects(cluster()) and coordinator == [("n1", 7180), ("n2", 7180), ("n3", 7180)]
    plain = [(u.node, u.port) for u in port_uses(cluster(min_nodes=None), ports) if u.setting == "watchdog_port"]
    assert not elects(cluster(min_nodes=None)) and plain == [("n1", 7180)]


def test_a_job_that_elects_has_each_nodes_ballot_box_udp_port_checked_free_and_no_other_job_has_one():
    from fabtrain.plan.ports import BALLOT_BOX, clashes, port_uses
    from tests.unit.test_elastic import cluster

    ports = {"master_port": 7181, "watchdog_port": 7180}  # master_port's TCP 7181 is not the ballot box's UDP 7181
    boxes = [(u.node, u.port, u.what, u.setting) for u in port_uses(cluster(), ports) if u.udp]
    assert boxes == [(n, 7181, BALLOT_BOX, "watchdog_port") for n in ("n1", "n2", "n3")]
    assert clashes(port_uses(cluster(), ports)) == []
    assert not [u for u in port_uses(cluster(min_nodes=None), ports) if u.udp]


def test_a_taken_ballot_box_port_is_one_line_naming_the_node_the_port_and_its_holder():
    """netcheck on this machine, a real UDP socket holding the ballot box's port: the entry is taken, its holder
    this process; the start's verdict is one line naming node, port and holder, and the setting to change."""
    import os
    import socket

    from fabtrain.controller import preflight
    from fabtrain.node import netcheck
    from fabtrain.plan.ports import BALLOT_BOX
    from fabtrain.contract.opreplies import Netcheck
    from fabtrain.plan.plan import Network
    from fabtrain.remote.transport import Reply
    from tests.unit.test_elastic import cluster

    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        c = cluster(port=port - 1)
        network = Network(ports={"master_port": 29500, "watchdog_port": port - 1}, auto=(), ifaces={})
        payloads = preflight._payloads(c, preflight.port_uses(c, network.ports), True, None, "t")
        replies = {}
        for n in c.nodes:
            payload = dict(payloads[n.name], node=n.name, address="127.0.0.1", workspace="/tmp", deadline=0.1)
            if n.name == "n2":  # the others' ports are free here: only n2's ballot box is looked at
                payload["listen"] = [e for e in payload["listen"] if e.get("udp")]
                assert payload["listen"] == [{"port": port, "what": BALLOT_BOX, "setting": "watchdog_port",
                                              "expect": 0, "udp": True}]
            else:
                payload["listen"] = []
            payload["reach"] = []
            replies[n.name] = Reply(n.name, True, Netcheck.checked(netcheck.run(payload)))
        (taken,) = replies["n2"].value.listen
        assert taken.state == "taken" and taken.owner.pid == os.getpid(), taken
        problems = preflight._listen_findings(c, [], replies, True)[0]
        assert problems == ["n2: port %d (%s) is in use by pid %d (%s): stop it, or set job.watchdog.port: auto (or "
                            "another port)" % (port, BALLOT_BOX, os.getpid(), taken.owner.command)], problems
    finally:
        holder.close()
    # freed, the same check finds it free
    entry = {"port": port, "udp": True}
    netcheck.bind_test("127.0.0.1", entry)
    assert entry["state"] == "ok"
