"""The majority election's rules (coordination/election.py), with no process: one vote a term, a strict
majority, the coordinator's lease against the voters' wait, the numbering carried on, the term on disk."""
from __future__ import annotations

import itertools
import json
import random

from fabtrain.node.coordination import election as el
from fabtrain.node.coordination.election import Known, TermFile, TermState, Voter

NODES = ("n1", "n2", "n3")
LEASE = 4.0


def voters(nodes=NODES, known=Known()):
    return {n: Voter(n, nodes, TermState(), LEASE, known) for n in nodes}


def test_a_strict_majority():
    assert [el.majority(n) for n in range(1, 7)] == [1, 2, 2, 3, 3, 4]


def test_two_nodes_have_no_majority_and_the_line_says_why():
    assert el.no_majority("n1", 2) == "1 of 2 nodes is no majority: the other cannot tell n1 gone from itself cut off"
    assert el.no_majority("n1", 3) is None


def test_the_two_node_line_is_the_layouts():
    from fabtrain.node.coordination.elastic import Layout
    layout = Layout(min_nodes=1, nodes=("n1", "n2"), trainer_nodes=("n1", "n2"), pserver_nodes=frozenset(), trainers=2)
    assert "(%s)" % el.no_majority("n1", 2) in layout.without_first()


def test_one_vote_a_term():
    v = Voter("n3", NODES, TermState(), LEASE)
    assert v.request("n1", 1, Known(), 100.0).granted and v.changed
    again = v.request("n2", 1, Known(), 200.0)  # its promise over: still one vote a term
    assert not again.granted and again.why == "voted for n1 in term 1"
    assert v.request("n1", 1, Known(), 200.0).granted  # the same candidate asking again: the same vote
    assert v.request("n2", 2, Known(), 200.0 + LEASE + el.MARGIN).granted  # a newer term, the promise over
    fresh = v.request("n1", 3, Known(), 200.0 + LEASE + el.MARGIN + 1)
    assert not fresh.granted and fresh.why.startswith("candidate n2, voted for, (term 2) heard 1.0 s ago")


def test_a_vote_kept_on_disk_is_not_given_twice_after_a_restart(tmp_path):
    f = TermFile(str(tmp_path / "term.json"))
    v = Voter("n3", NODES, f.load(), LEASE)
    assert v.request("n1", 5, Known(), 0.0).granted
    f.save(v.state)
    assert json.loads((tmp_path / "term.json").read_text()) == {"term": 5, "voted_for": "n1", "coordinator": None}
    restarted = Voter("n3", NODES, f.load(), LEASE)
    assert not restarted.request("n2", 5, Known(), 0.0).granted
    assert not restarted.request("n2", 4, Known(), 0.0).granted


def test_a_damaged_term_file_reads_as_nothing(tmp_path):
    p = tmp_path / "term.json"
    p.write_text("[1, 2")
    assert TermFile(str(p)).load() == TermState()
    p.write_text('{"term": true, "voted_for": 3}')
    assert TermFile(str(p)).load() == TermState()


def test_no_vote_while_the_coordinator_is_heard_within_lease_and_margin():
    v = Voter("n3", NODES, TermState(), LEASE)
    assert v.heard(1, "n1", 10.0)
    refused = v.request("n2", 2, Known(), 10.0 + LEASE + el.MARGIN - 0.01)
    assert not refused.granted and refused.why.startswith("coordinator n1 (term 1) heard 5.0 s ago, within its lease")
    assert v.request("n2", 2, Known(), 10.0 + LEASE + el.MARGIN).granted
    own = Voter("n3", NODES, TermState(), LEASE)
    own.heard(1, "n1", 10.0)
    assert own.request("n1", 2, Known(), 11.0).granted  # its own coordinator standing again: no lease against it


def test_a_candidate_behind_the_voters_generation_is_refused():
    v = Voter("n3", NODES, TermState(), LEASE, Known(generation=3))
    b = v.request("n2", 1, Known(generation=2), 0.0)
    assert not b.granted and b.why == "n2 knows generation 2, this node 3"
    assert not v.changed  # nothing to save: the term is not taken up by a refused vote


def test_a_line_of_an_older_term_is_not_followed():
    v = Voter("n3", NODES, TermState(term=3), LEASE)
    assert not v.heard(2, "n1", 0.0) and v.last_contact is None
    assert v.heard(3, "n2", 0.0) and v.state.coordinator == "n2"


def test_a_term_with_a_coordinator_takes_no_other_candidate():
    v = Voter("n3", NODES, TermState(), LEASE)
    v.heard(4, "n2", 0.0)
    assert not v.request("n1", 4, Known(), 100.0).granted
    assert v.request("n1", 5, Known(), 100.0).granted


def test_the_winner_needs_a_strict_majority_of_granted_votes_of_its_term():
    vs = voters(("n1", "n2", "n3", "n4"))
    own = vs["n2"].request("n2", 1, Known(), 0.0)
    one = vs["n3"].request("n2", 1, Known(), 0.0)
    assert el.tally(("n1", "n2", "n3", "n4"), "n2", 1, [own, one]) is None  # 2 of 4
    other = vs["n4"].request("n2", 1, Known(), 0.0)
    won = el.tally(("n1", "n2", "n3", "n4"), "n2", 1, [own, one, one, other])
    assert won is not None and won.voters == ("n2", "n3", "n4")
    stale = el.Ballot("n1", 0, True)
    assert el.tally(NODES, "n2", 1, [own, stale]) is None
    assert el.tally(NODES, "n2", 1, [one, el.Ballot("n9", 1, True)]) is None  # not the job's, and no own vote


def test_the_numbering_goes_on_from_the_newest_generation_of_the_majority():
    ballots = [el.Ballot("n2", 2, True, Known(3, ("n1",), 4)), el.Ballot("n3", 2, True, Known(4, ("n1",), 3))]
    won = el.tally(NODES, "n2", 2, ballots)
    assert won.known == Known(4, ("n1",), 3) and won.first_generation() == 5


def test_two_coordinators_of_one_term_never_win_whatever_the_order():
    """Every order in which two candidates of one term ask every voter: at most one wins."""
    for order in itertools.permutations([(c, v) for c in ("n1", "n2") for v in NODES]):
        vs = voters()
        ballots = {"n1": [], "n2": []}
        for cand, voter in order:
            ballots[cand].append(vs[voter].request(cand, 7, Known(), 0.0))
        winners = [c for c in ballots if el.tally(NODES, c, 7, ballots[c])]
        assert len(winners) <= 1, order


def test_the_coordinator_holds_with_a_majority_and_steps_down_without():
    assert not el.Lease(NODES, "n1", 1, LEASE, 0.0).holds(0.0)  # no voter but itself: 1 of 3
    lease = el.Lease(NODES, "n1", 1, LEASE, 0.0, voters=("n1", "n2"))
    assert lease.holds(3.9)  # n2's vote, given after the ask, holds it for a lease from the ask
    lease.beat("n3", 1, 3.0)
    assert lease.holds(6.9)  # n3 echoed a line n1 sent 3.9 s ago: n1 and n3 are 2 of 3
    assert not lease.holds(7.0)
    assert lease.why_not(7.0) == ("coordinator n1 (term 1) heard 1 of 3 trainer nodes within its lease (4.0 s), "
                                  "fewer than a majority (2): it steps down and its node fences itself")
    assert not lease.beat("n2", 0, 7.0) and not lease.beat("n9", 1, 7.0)


def test_a_newer_term_in_a_beat_makes_it_step_down():
    lease = el.Lease(NODES, "n1", 1, LEASE, 0.0, voters=("n3",))
    assert not lease.beat("n2", 2, 0.5)
    assert not lease.holds(0.5) and lease.why_not(0.5).startswith("a node names term 2, newer")


def test_candidates_go_by_node_order_among_the_nodes_they_hear():
    assert el.candidacy_delay(NODES, "n2", {"n3"}, 0.5) == 0.0  # n1 cut off: n2 goes first
    assert el.candidacy_delay(NODES, "n3", {"n2"}, 0.5) == 0.5
    assert el.candidacy_delay(NODES, "n3", {"n1", "n2"}, 0.5) == 1.0


def test_the_moved_line():
    assert el.moved("n2", 2, "n1") == "coordinator now on n2 (term 2), after n1"


def test_a_queued_beat_counts_from_what_it_echoes_not_from_its_arrival():
    """A coordinator paused for 10 s takes in, when it runs again, a beat n3 sent before the pause: it echoes a
    line sent at 1.0, so it does not hold the lease at 11.0 (n2 and n3 may have elected n2 meanwhile)."""
    lease = el.Lease(NODES, "n1", 1, LEASE, 0.0, voters=("n3",))
    assert lease.beat("n3", 1, 1.0) and not lease.holds(11.0)
    assert not lease.beat("n3", 1, 0.5) or lease.heard["n3"] == 1.0  # an older echo never moves it back


def _run(rng: random.Random, n: int) -> bool:
    """One random run of a coordinator n1 of term 1 and candidates among the others: lines sent by n1 reach a
    node after a delay (if it is reachable), its beats echo the newest it got and reach n1 after another delay
    (queued while n1 is paused); cuts flip at random; a candidate stands whenever it may. Whenever a successor
    is elected, n1's lease had already stopped holding (it stepped down first). Agents restart now and then,
    keeping only their term record. True if one was elected."""
    nodes = tuple("n%d" % (i + 1) for i in range(n))
    vs = voters(nodes)
    lease = el.Lease(nodes, "n1", 1, LEASE, 0.0, voters=nodes)
    for v in vs.values():
        v.heard(1, "n1", 0.0)
    got = {v: 0.0 for v in nodes}  # the newest n1 line each node received (n1's send time)
    inbox: list = []  # (arrival, node, term, echoed): beats on their way to n1
    reach = {v: True for v in nodes}
    paused_until, stepped_down_at, t = 0.0, None, 0.0
    while t < 60.0:
        t += rng.uniform(0.05, 1.0)
        if rng.random() < 0.1:
            node = rng.choice(nodes[1:])
            reach[node] = not reach[node]
        if rng.random() < 0.03 and t >= paused_until:
            paused_until = t + rng.uniform(1.0, 10.0)
        if rng.random() < 0.05:  # an agent restarted by its keeper: its term record read back, nothing else
            node = rng.choice(nodes[1:])
            st = vs[node].state
            vs[node] = Voter(node, nodes, TermState(st.term, st.voted_for, st.coordinator), LEASE, vs[node].known,
                             started=t)
        running = t >= paused_until and stepped_down_at is None
        for node in nodes[1:]:
            if not reach[node]:
                continue
            if running and vs[node].heard(1, "n1", t + rng.uniform(0, 0.3)):  # n1's line, received a bit later
                got[node] = t
            if rng.random() < 0.8:
                inbox.append((t + rng.uniform(0, 0.5), node, vs[node].state.term, got[node]))
        if running:  # n1 takes in what arrived (a paused one all at once when it runs again), then checks
            for item in sorted(x for x in inbox if x[0] <= t):
                lease.beat(item[1], item[2], item[3])
            inbox = [x for x in inbox if x[0] > t]
            if not lease.holds(t):
                stepped_down_at = t
        cand = rng.choice(nodes[1:])
        if el.may_stand(vs[cand], t):
            term = max(v.state.term for v in vs.values()) + 1
            ballots = [vs[v].request(cand, term, vs[cand].known, t) for v in nodes[1:]
                       if v == cand or (reach[v] or reach[cand]) and rng.random() < 0.9]
            if el.tally(nodes, cand, term, ballots):
                # n1, were it to run now and take in every beat of its term, must not hold its lease
                for item in inbox:
                    lease.beat(item[1], 1, item[3]) if item[2] == 1 else None
                assert lease.superseded or not lease.holds(t), (t, lease.heard)
                assert stepped_down_at is not None or t < paused_until
                return True
    return False


def test_no_successor_while_the_old_coordinator_could_hold_its_lease_random_runs():
    rng = random.Random(58)
    elected = sum(_run(rng, rng.choice((3, 4, 5))) for _ in range(400))
    assert elected > 200  # the runs do elect successors: the check is not empty


def test_a_generation_starts_only_once_a_majority_knows_it_so_no_successor_reuses_its_number():
    assert not el.may_start(3, {"n1": 3}, NODES)  # only the coordinator knows generation 3
    assert el.may_start(3, {"n1": 3, "n3": 4}, NODES)
    # every majority that could elect a successor then holds a node that knew 3: the successor starts at 4 or later
    for quorum in itertools.combinations(NODES, 2):
        knows = {"n1": 3, "n3": 3, "n2": 2}
        ballots = [el.Ballot(v, 2, True, Known(knows[v])) for v in quorum]
        for cand in quorum:
            won = el.tally(NODES, cand, 2, ballots)
            assert won is not None and won.first_generation() >= 4, (quorum, won)


def test_a_refusal_names_the_coordinator_its_voter_follows_and_a_node_behind_takes_up_that_term():
    """n1, the old coordinator of term 1, cut off and stepped down; n2 coordinates term 2, n3 follows it. n1,
    healed, asks for term 2: n3 refuses, naming term 2 and n2, and n1 follows n2 in term 2 from then on."""
    n1, n3 = Voter("n1", NODES, TermState(1, None, "n1"), LEASE), Voter("n3", NODES, TermState(2, "n2", None), LEASE)
    n3.heard(2, "n2", 100.0)
    no = n3.request("n1", 2, Known(), 101.0)
    assert not no.granted and (no.term, no.coordinator) == (2, "n2") and no.why == "term 2 is not newer than 2 " \
        "(coordinator n2)"
    assert n1.learn([no], 102.0) == "n2" and n1.changed
    assert (n1.state.term, n1.state.coordinator, n1.holder, n1.last_contact) == (2, "n2", "n2", 102.0)
    assert not n1.heard(1, "n1", 103.0)  # a line of the older term: not followed
    assert not n1.request("n3", 3, Known(), 103.0).granted  # it follows n2 within its lease, as after a line of it


def test_a_refusal_teaches_nothing_older_nor_the_own_term_of_a_node_that_knows_its_coordinator():
    v = Voter("n2", NODES, TermState(3, None, "n3"), LEASE)
    assert v.learn([el.Ballot("n1", 2, False, coordinator="n1")], 0.0) is None  # older
    assert v.learn([el.Ballot("n1", 3, False, coordinator="n1")], 0.0) is None  # its own term: n3 coordinates it
    assert v.learn([el.Ballot("n1", 4, True, coordinator="n1")], 0.0) is None  # a vote given is no refusal
    assert v.learn([el.Ballot("n1", 4, False, coordinator="n9")], 0.0) is None  # not a node of the job
    assert v.learn([el.Ballot("n1", 4, False, coordinator="n2")], 0.0) is None  # itself: it never coordinated 4
    assert v.learn([el.Ballot("n1", 4, False)], 0.0) is None  # no coordinator named
    assert (v.state, v.changed) == (TermState(3, None, "n3"), False)
    # its own term, where it knows no coordinator (it voted in vain); the newest of several
    w = Voter("n2", NODES, TermState(3, "n2", None), LEASE)
    assert w.learn([el.Ballot("n1", 3, False, coordinator="n1")], 0.0) == "n1" and w.state.term == 3
    assert w.learn([el.Ballot("n1", 4, False, coordinator="n1"), el.Ballot("n3", 5, False, coordinator="n3")],
                   9.0) == "n3" and (w.state.term, w.state.coordinator) == (5, "n3")


def test_learning_from_refusals_keeps_one_coordinator_a_term_and_never_an_older_term_random_runs():
    """Candidates stand whenever they may, the winners' lines reach some nodes, and every candidate that loses
    learns from its refusals: each node's term only grows, and whatever coordinator of a term a node follows
    (heard or learned) is the one that won that term."""
    rng = random.Random(5858)
    learned = 0
    for _ in range(200):
        nodes = tuple("n%d" % (i + 1) for i in range(rng.choice((3, 5))))
        vs, winners, t = voters(nodes), {1: "n1"}, 0.0
        reach = {n: True for n in nodes}  # cut off: it neither hears lines nor is asked, nor asks
        for v in vs.values():
            v.heard(1, "n1", 0.0)
        for _ in range(60):
            t += rng.uniform(0.1, 3.0)
            if rng.random() < 0.3:
                node = rng.choice(nodes)
                reach[node] = not reach[node]
            before = {n: v.state.term for n, v in vs.items()}
            # the newest coordinator's lines reach the nodes it reaches
            co = max(winners.items())[1]
            for n, v in vs.items():
                if reach[n] and reach[co] and rng.random() < 0.3:
                    v.heard(max(winners), co, t)
            cand = rng.choice(nodes)
            if el.may_stand(vs[cand], t):
                term = vs[cand].state.term + 1
                ballots = [vs[v].request(cand, term, vs[cand].known, t) for v in nodes
                           if v == cand or reach[cand] and reach[v] and rng.random() < 0.9]
                if el.tally(nodes, cand, term, ballots):
                    assert winners.setdefault(term, cand) == cand  # one coordinator a term
                    vs[cand].heard(term, cand, t)
                elif vs[cand].learn(ballots, t) is not None:
                    learned += 1
            for n, v in vs.items():
                assert v.state.term >= before[n]
                assert v.state.coordinator is None or winners.get(v.state.term) == v.state.coordinator, (n, v.state)
    assert learned > 50  # the runs do learn: the check is not empty
