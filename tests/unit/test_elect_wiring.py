"""The election wired (agent/elect.py, coordination/tenure.py, agent/link.py): three agents' links of a job
that elects, on 127.0.0.1-3, with real coordinators, clients and ballot boxes over real sockets. The first
node's agent ends (its coordinator with it): the two others elect node n2 for term 2, whose board restarts the
job as generation 1 without n1, and n3 follows it. A job that does not elect runs no ballot box and stamps
nothing. No agent loop: each test beats by hand, as the loop would."""
from __future__ import annotations

import time

import pytest

from fabtrain.contract.events import EventKind
from fabtrain.node.agent.link import Link
from fabtrain.node.agent.loop import settings
from tests.support.sshd import free_port

NODES = ("n1", "n2", "n3")


def job_of(node: str, port: int, min_nodes) -> dict:
    return {"job_id": "J", "node": node, "trainers": 3,
            "nodes": [{"name": n, "address": "127.0.0.%d" % (i + 1), "roles": ["trainer"]} for i, n in enumerate(NODES)],
            "watchdog": {"interval": 0.5, "hang_timeout": 60, "startup_timeout": 60, "grace": 0.5,
                         "on_failure": "restart", "min_nodes": min_nodes, "max_restarts": 3, "restart_backoff": 0.5,
                         "restart_on_exit_codes": None, "coordinator": {"host": "127.0.0.1", "port": port,
                                                                          "secret": "s3cr3t"}}}


class Agent:
    """What the agent loop gives its link: beats, and the events its link writes."""

    def __init__(self, node: str, port: int, tmp_path, min_nodes=2, again=False):
        """`again`: its agent started again over the job folder it left (its term record)."""
        self.node, self.events = node, []
        job = job_of(node, port, min_nodes)
        cfg, restart = settings(job, list(NODES))
        (tmp_path / node).mkdir(exist_ok=again)
        self.link = Link(job, list(NODES), cfg, restart, str(tmp_path / node),
                         lambda kind, reason="", node=None, **f: self.events.append((kind, reason, f)), lambda: None)

    def beat(self) -> None:
        self.link.send({"op": "beat", "job_id": "J", "node": self.node, "procs": {}, "done": False,
                        "failure": None, "final": None, "generation": 0})
        self.link.take()


@pytest.fixture
def agents(tmp_path):
    port = free_port(["127.0.0.%d" % (i + 1) for i in range(len(NODES))], udp=True)  # coordinator, ballot boxes
    made = [Agent(n, port, tmp_path) for n in NODES]
    yield made
    for a in made:
        a.link.stop()


def run_until(agents, cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for a in agents:
            a.beat()
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_the_first_nodes_agent_gone_the_others_elect_n2_which_restarts_the_job_without_n1(agents):
    n1, n2, n3 = agents
    assert all(a.link.start() for a in agents)
    assert run_until(agents, lambda: len(n1.link.coordinator.board.peers) == 3 and n1.link.coordinator.tenure.armed(),
                     10)
    assert all(a.link.elector.term == 1 for a in agents)
    n1.link.stop()  # its agent (and coordinator) gone
    assert run_until([n2, n3], lambda: n2.link.hosting() and n3.link.target == "n2"
                     and n3.link.view.get("generation") == 1, 30), (n2.events, n3.events)
    assert n2.link.elector.term == n3.link.elector.term == 2 and n2.link.term == n3.link.term == 2
    assert n3.link.health()["node"] == "n2" and n3.link.health()["term"] == 2
    moved = [r for k, r, _ in n2.events if k == EventKind.COORDINATOR]
    assert moved == ["coordinator now on n2 (term 2), after n1"], n2.events
    status = n2.link.coordinator.board.status
    assert status["status"] == "restarting" and status["generation"] == 1 and "n1" in n2.link.coordinator.board.out
    assert n3.link.view["status"] == "restarting", n3.link.view
    assert n1.link.coordinator.tenure.term == 1 and n3.link.coordinator is None
    # may_start: n2's and n3's beats say they know generation 1 (their voters' `known`): it is held no more
    board = n2.link.coordinator.board
    assert run_until([n2, n3], lambda: "held" not in board.status, 10), board.status
    assert board.peers["n2"].knows == board.peers["n3"].knows == 1


def test_the_old_coordinators_agent_started_again_learns_who_won_and_beats_the_new_coordinator(agents, tmp_path):
    """n1's agent gone, n2 elected for term 2; n1's agent started again over its term record (term 1, itself):
    its restored coordinator steps down (nobody echoes it), it stands in vain, learns term 2 and n2 from a
    refusal, and its beats reach n2's board, which answers them (here: fenced out, max_rejoins 0)."""
    n1, n2, n3 = agents
    assert all(a.link.start() for a in agents)
    assert run_until(agents, lambda: n1.link.coordinator.tenure.armed(), 10)
    n1.link.stop()
    assert run_until([n2, n3], lambda: n2.link.hosting() and n3.link.target == "n2", 30), n2.events
    again = Agent("n1", n1.link.port, tmp_path, again=True)
    try:
        assert again.link.start()
        assert run_until([again, n2, n3], lambda: again.link.target == "n2" and again.link.term == 2, 30), \
            again.events
        learned = [r for k, r, _ in again.events if k == EventKind.COORDINATOR and " learned " in r]
        assert learned == ["n1 learned from a refused vote: coordinator n2 (term 2)"], again.events
        assert again.link.elector.voter.state.term == 2 and again.link.peers().deposed is None
        # health.json says whose coordinator it follows, and that its own (stepped down) is none it hosts
        assert (again.link.health()["hosted_here"], again.link.health()["node"]) == (False, "n2")
        assert n2.link.health()["hosted_here"] is True and n3.link.health()["hosted_here"] is False
        # its beats reach n2's board, which answers (max_rejoins 0 here): n1 left once, it is fenced out for good
        assert run_until([again, n2, n3], lambda: again.link.fenced is not None, 10), n2.link.coordinator.board.status
        assert again.link.fenced["reason"].startswith("n1 left the job"), again.link.fenced
        moved = [r for a in (again, n2, n3) for k, r, _ in a.events if k == EventKind.COORDINATOR and " now on " in r]
        assert moved == ["coordinator now on n2 (term 2), after n1"], moved
    finally:
        again.link.stop()


def test_a_coordinator_that_loses_its_majority_steps_down_and_its_node_is_told_to_fence(agents):
    n1, n2, n3 = agents
    assert all(a.link.start() for a in agents)
    assert run_until(agents, lambda: n1.link.coordinator.tenure.armed(), 10)
    n2.link.stop()
    n3.link.stop()
    assert run_until([n1], lambda: n1.link.peers().deposed is not None, 10)
    assert "fewer than a majority (2): it steps down" in n1.link.peers().deposed
    assert not n1.link.hosting()


def test_a_job_that_does_not_elect_runs_no_ballot_box_and_stamps_nothing(tmp_path):
    port = free_port(["127.0.0.%d" % (i + 1) for i in range(len(NODES))], udp=True)  # coordinator, ballot boxes
    plain = [Agent(n, port, tmp_path, min_nodes=None) for n in NODES]
    try:
        assert all(a.link.start() for a in plain)
        assert run_until(plain, lambda: all(a.link.view.get("status") for a in plain), 10)
        assert all(a.link.elector is None for a in plain) and plain[0].link.coordinator.tenure is None
        assert "term" not in plain[1].link.view and "by" not in plain[1].link.view
    finally:
        for a in plain:
            a.link.stop()


def test_a_node_that_stood_in_vain_does_not_depose_the_coordinator_its_majority_still_follows(agents):
    n1, n2, n3 = agents
    assert all(a.link.start() for a in agents)
    assert run_until(agents, lambda: n1.link.coordinator.tenure.armed(), 10)
    with n2.link.elector.lock:  # n2 stood for term 5 and lost (cut off from n1 a while): its term record says so
        n2.link.elector.voter.state.term, n2.link.elector.voter.state.voted_for = 5, "n2"
        n2.link.elector.voter.state.coordinator = None
    run_until(agents, lambda: False, 8)  # its beats go on reaching n1, naming the term they follow
    assert n1.link.hosting() and n1.link.coordinator.tenure.stepped_down is None
    assert n3.link.target == "n1" and n3.link.elector.term == 1
    assert not [r for a in agents for k, r, _ in a.events if k == EventKind.COORDINATOR]
