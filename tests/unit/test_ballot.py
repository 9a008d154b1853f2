"""The votes over real sockets (coordination/ballot.py): three ballot boxes on loopback, each with its own term
record on disk; a candidate wins a strict majority, a second one of the same term does not, a forged request is
refused unanswered, and the vote is on disk before it is answered."""
from __future__ import annotations

import json
import socket
import time

import pytest

from fabtrain.node.coordination import ballot as bt
from fabtrain.node.coordination import election as el
from fabtrain.node.coordination.election import Known, TermFile, TermState, Voter

NODES = ("n1", "n2", "n3")
SECRET = "s" * 32


@pytest.fixture
def boxes(tmp_path):
    made = {}
    for n in NODES:
        f = TermFile(str(tmp_path / ("%s-term.json" % n)))
        made[n] = bt.Box("J", SECRET, "127.0.0.1", 0, Voter(n, NODES, f.load(), 4.0, Known(2, (), 3)), f)
        made[n].start()
    yield made
    for b in made.values():
        b.stop()


def where(boxes, *nodes):
    return {n: boxes[n].address for n in nodes}


def test_a_candidate_wins_a_majority_and_the_votes_are_on_disk(boxes, tmp_path):
    got = bt.ask("J", SECRET, "n2", 1, Known(2, (), 3), where(boxes, "n2", "n3"), 5.0, 2)
    won = el.tally(NODES, "n2", 1, got)
    assert won is not None and won.voters == ("n2", "n3") and won.first_generation() == 3
    for n in ("n2", "n3"):
        assert json.loads((tmp_path / ("%s-term.json" % n)).read_text()) == {"term": 1, "voted_for": "n2",
                                                                            "coordinator": None}
    # a second candidate of the same term: one vote a term, so no majority
    other = bt.ask("J", SECRET, "n1", 1, Known(2, (), 3), where(boxes, *NODES), 1.0, 2)
    assert el.tally(NODES, "n1", 1, other) is None
    assert {b.voter: b.granted for b in other} == {"n1": True, "n2": False, "n3": False}
    assert all(b.why.startswith("candidate n2, voted for, (term 1) heard") for b in other if not b.granted)


def test_a_vote_says_when_its_voter_last_heard_a_coordinator_never_earlier_than_it_did(boxes):
    """The voter sends how long ago (`quiet`, rounded down); the candidate takes it from the answer's arrival: on
    one clock here, so the candidate's figure is the voter's own moment or a little later, never earlier."""
    heard = time.monotonic() - 2.0
    boxes["n3"].voter.coordinator_heard = heard
    (vote,) = bt.ask("J", SECRET, "n2", 1, Known(2, (), 3), where(boxes, "n3"), 5.0, 1)
    assert vote.granted and heard <= vote.heard_at < heard + 0.5, (vote.heard_at - heard)
    # a voter that never heard one (and was not started again over a term record) cannot say
    (unsure,) = bt.ask("J", SECRET, "n2", 2, Known(2, (), 3), where(boxes, "n1"), 5.0, 1)
    assert unsure.granted and unsure.heard_at is None
    # one started again over its record: it may have heard one until its start
    assert Voter("n3", NODES, TermState(1, None, "n1"), 4.0, started=100.0).coordinator_heard == 100.0


def test_a_voter_restarted_from_its_record_does_not_vote_again(boxes, tmp_path):
    bt.ask("J", SECRET, "n2", 3, Known(2, (), 3), where(boxes, "n3"), 5.0, 1)
    boxes["n3"].stop()
    f = TermFile(str(tmp_path / "n3-term.json"))
    again = bt.Box("J", SECRET, "127.0.0.1", 0, Voter("n3", NODES, f.load(), 4.0), f)
    again.start()
    try:
        (b,) = bt.ask("J", SECRET, "n1", 3, Known(2, (), 3), {"n3": again.address}, 5.0, 1)
        assert not b.granted and b.why == "voted for n2 in term 3"
    finally:
        again.stop()
    # its promise to n2 was in memory: started again, it votes for nobody else for lease + MARGIN, newer term too
    restarted = Voter("n3", NODES, f.load(), 4.0, started=100.0)
    late = restarted.request("n1", 4, Known(), 104.9)
    assert not late.granted and late.why.startswith("candidate n2, voted for, (term 3) heard 4.9 s ago")
    assert restarted.request("n1", 4, Known(), 105.0).granted


def test_a_request_without_the_secret_or_of_another_job_is_refused_unanswered(boxes):
    assert bt.ask("J", "wrong" * 8, "n2", 1, Known(), where(boxes, "n3"), 0.6, 1) == []
    assert bt.ask("K", SECRET, "n2", 1, Known(), where(boxes, "n3"), 0.6, 1) == []
    assert boxes["n3"].refused >= 2
    assert boxes["n3"].voter.state == TermState()  # nothing was taken up


def test_an_answer_cannot_pass_for_a_request():
    key = bt.ballot_key(SECRET, "J")
    answer = el.Ballot("n3", 1, True)
    sealed = bt.seal(key, b"voter", {"job_id": "J", "voter": answer.voter, "term": 1, "granted": True,
                                     "candidate": "n3", "n": "x"})
    with pytest.raises(bt.ProtocolError):
        bt._open(key, b"candidate", sealed, "J")


def test_a_pre_vote_says_whether_a_voter_would_grant_and_changes_nothing(boxes, tmp_path):
    would = bt.ask("J", SECRET, "n2", 1, Known(2, (), 3), where(boxes, "n1", "n3"), 5.0, 2, pre=True)
    assert sorted(b.voter for b in would if b.granted and b.term == 1) == ["n1", "n3"]
    assert not any((tmp_path / ("%s-term.json" % n)).exists() for n in NODES)  # nothing saved anywhere
    assert all(boxes[n].voter.state.term == 0 and boxes[n].voter.last_contact is None for n in NODES)
    # a real vote then binds: a pre-vote for another candidate of that term is refused
    bt.ask("J", SECRET, "n2", 1, Known(2, (), 3), where(boxes, "n3"), 5.0, 1)
    (no,) = bt.ask("J", SECRET, "n1", 1, Known(2, (), 3), where(boxes, "n3"), 1.0, 1, pre=True)
    assert not no.granted and boxes["n3"].voter.state.voted_for == "n2"


def test_a_refusal_carries_the_voters_coordinator_sealed_and_a_forged_one_teaches_nothing(boxes):
    """n3 follows n2 in term 2; n1 (the old coordinator of term 1) asks: the refusal names term 2 and n2, and n1
    takes them up. The same refusal sealed without the job's secret is dropped by the asker: nothing learned."""
    n3 = boxes["n3"].voter
    with boxes["n3"].lock:
        n3.heard(2, "n2", time.monotonic())
    n1 = Voter("n1", NODES, TermState(1, None, "n1"), 4.0)
    (no,) = bt.ask("J", SECRET, "n1", 2, Known(2, (), 3), where(boxes, "n3"), 1.0, 1, pre=True)
    assert not no.granted and (no.voter, no.term, no.coordinator) == ("n3", 2, "n2")
    assert n1.learn([no], 0.0) == "n2" and (n1.state.term, n1.state.coordinator) == (2, "n2")

    # a forger without the secret answers n1's request (it saw the nonce on the wire) naming itself
    asker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    asker.settimeout(2.0)
    asker.bind(("127.0.0.1", 0))
    forged = bt.seal(bt.ballot_key("wrong" * 8, "J"), b"voter", {
        "job_id": "J", "voter": "n3", "term": 9, "granted": False, "known": {}, "why": "", "coordinator": "n3",
        "n": "N"})
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forger:
        forger.sendto(forged, asker.getsockname())
    answers: dict = {}
    bt._take(asker, bt.ballot_key(SECRET, "J"), "J", "N", {"n3": ("127.0.0.1", 9)}, answers)
    asker.close()
    assert answers == {}  # dropped: no refusal to learn from
