"""The agent's candidacy (node/agent/elect.py) over real ballot boxes on loopback: how soon a node whose
coordinator went silent asks again. A pre-vote that finds no majority raises and saves nothing, so a node
cut off asks again half a second later (healed, it learns its coordinator within about a second); a candidacy
rests the lease, so two candidates do not split each other's terms."""
from __future__ import annotations

import time

import pytest

from fabtrain.node.agent import elect
from fabtrain.node.coordination import ballot as bt
from fabtrain.node.coordination.election import TermFile, TermState, Voter
from tests.support.sshd import free_port

NODES = ("n1", "n2", "n3")
ADDRESSES = {"n1": "127.0.0.1", "n2": "127.0.0.2", "n3": "127.0.0.3"}
SECRET = "s" * 32
LEASE = 4.0


class Link:
    """What the elector asks of its agent's link: the job's port and secret, and where it reports."""

    def __init__(self, port: int):
        self.job_id, self.secret, self.port = "J", SECRET, port
        self.events, self.followed, self.elected = [], [], []

    def on_event(self, kind, **fields):
        self.events.append((kind, fields))

    def follow(self, node, address):
        self.followed.append(node)

    def hosting(self) -> bool:
        return bool(self.elected)

    def host_elected(self, won, previous, asked, lease):
        self.elected.append(won)


@pytest.fixture
def cluster(tmp_path):
    """n1's elector, its coordinator (itself, term 1) silent for longer than the lease; `voters(...)` starts
    ballot boxes for n2 and n3 that follow `coordinator` of `term` (None: a voter that heard none lately)."""
    port, made = free_port(list(ADDRESSES.values()), udp=True), []  # the ballot boxes: port + 1
    link = Link(port)
    job = {"node": "n1", "nodes": [{"name": n, "address": a} for n, a in ADDRESSES.items()]}
    e = elect.Elector(link, job, str(tmp_path), LEASE)
    e.voter.last_contact = e.voter.coordinator_heard = time.monotonic() - 10 * LEASE
    e.contacted = True
    e.box.start()
    made.append(e.box)

    def voters(term: int, coordinator: str | None):
        for n in ("n2", "n3"):
            f = TermFile(str(tmp_path / ("%s-term.json" % n)))
            v = Voter(n, NODES, TermState(term, None, coordinator), LEASE)
            if coordinator is not None:
                v.heard(term, coordinator, time.monotonic())
            box = bt.Box("J", SECRET, ADDRESSES[n], elect.ballot_port(port), v, f)
            box.start()
            made.append(box)

    yield e, link, voters
    for box in made:
        box.stop()


def stand_once(e) -> float:
    """Tick the elector until it has stood once; the seconds it then rests before it may stand again."""
    now = time.monotonic()
    e.tick(now)  # its candidacy's delay is set (none for the first node)
    e.tick(now)
    return e.rest_until - time.monotonic()


def test_a_node_cut_off_asks_again_soon_and_raises_no_term(cluster):
    e, link, _ = cluster
    rest = stand_once(e)
    assert rest <= elect.ASK_AGAIN < LEASE, rest
    assert e.term == 1 and not link.elected and not link.events
    assert TermFile(e.file.path).load().term in (0, 1)  # nothing raised on disk either


def test_healed_it_learns_the_coordinator_of_the_newer_term_from_the_refused_pre_vote(cluster):
    e, link, voters = cluster
    voters(2, "n2")
    rest = stand_once(e)
    assert rest <= elect.ASK_AGAIN, rest
    assert e.term == 2 and e.voter.state.coordinator == "n2" and not link.elected
    assert [f["reason"] for k, f in link.events] == ["n1 learned from a refused vote: coordinator n2 (term 2)"]
    e.tick(time.monotonic())
    assert link.followed[-1] == "n2"


def test_after_a_candidacy_it_rests_the_lease(cluster):
    e, link, voters = cluster
    voters(1, None)
    rest = stand_once(e)
    assert len(link.elected) == 1 and link.elected[0].term == 2 and e.term == 2
    assert elect.ASK_AGAIN < rest <= LEASE, rest
