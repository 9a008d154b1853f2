"""A coordinator elected by majority takes over the job's board (coordination/succession.py), with the real
Board and RestartPolicy and no process: the numbering goes on, the old coordinator's node leaves with the
fence's wait, and the two-node and pserver jobs keep their one line."""
from __future__ import annotations

from fabtrain.node.coordination import election as el
from fabtrain.node.coordination import fence
from fabtrain.node.coordination.election import Known
from fabtrain.node.coordination.succession import take_over
from fabtrain.node.structs import replace
from tests.unit.test_elastic import NODES, beat, cluster, policy

BACKOFF = 2.0


def won(generation=1, out=(), voters=("n2", "n3"), term=2):
    return el.Won(term, voters, Known(generation, out, 0))


def restart(**watchdog):
    return replace(policy(cluster(**watchdog)), backoff=BACKOFF)


def test_the_successor_goes_on_without_the_first_node_one_generation_on_after_the_fence():
    r = restart(max_restarts=5)
    board, events = take_over("J", list(NODES), 5.0, r, won(generation=1), "n2", "n1", 100.0, 1100.0)
    st = board.status
    assert st["status"] == "restarting" and st["generation"] == 2 and st["out"] == ["n1"] and st["world_size"] == 2
    # the fence's wait from the election, not the backoff: n1 stepped down before any vote for n2 was given
    assert board.restart_start == 100.0 + r.fence_wait and st["backoff"] == round(r.fence_wait, 3)
    assert fence.fence_wait(1.0, 5.0) > BACKOFF
    kinds = [(e.kind, e.node) for e in events]
    assert kinds == [("coordinator", "n2"), ("node_left", "n1")], events
    assert events[0].reason == "coordinator now on n2 (term 2), after n1" and events[0].fields["term"] == 2
    assert events[1].reason.startswith("n1 left the job (node n1 lost: the coordinator there lost its majority; "
                                       "coordinator now on n2 (term 2)); generation 2 runs on 2 of 3 nodes"), events[1]


def test_the_fence_wait_counts_from_the_latest_a_voter_heard_a_coordinator_and_never_from_later_than_now():
    """Each voter's ballot says when it last heard a coordinator's line (ballot.py); the old coordinator's echoes
    expire a lease after that, so its node's fence (its dead-man: step-down + fence_slack) ends within
    stop_bound of the latest of them, and fence_wait from it is enough (succession.py's docstring)."""
    r = restart(max_restarts=5)
    votes = [el.Ballot("n2", 2, True, Known(1, (), 0), heard_at=91.5), el.Ballot("n3", 2, True, Known(1, (), 0),
                                                                                  heard_at=93.25)]
    elected = el.tally(NODES, "n2", 2, votes)
    assert elected.heard == 93.25  # the latest: the old coordinator may have counted n3 until 93.25 + its lease
    board, _ = take_over("J", list(NODES), 5.0, r, elected, "n2", "n1", 100.0, 1100.0)
    assert board.restart_start == 93.25 + r.fence_wait and board.status["backoff"] == round(r.fence_wait - 6.75, 3)
    # one voter that cannot say (an older agent's answer): from the election, as before
    unsure = el.tally(NODES, "n2", 2, [votes[0], replace(votes[1], heard_at=None)])
    assert unsure.heard is None
    assert take_over("J", list(NODES), 5.0, r, unsure, "n2", "n1", 100.0, 1100.0)[0].restart_start == 100.0 + r.fence_wait
    # a refused ballot's hearing counts for nothing; a hearing after the election (it cannot be) is the election's
    refused = el.Ballot("n1", 2, False, Known(1, (), 0), heard_at=99.0)
    assert el.tally(NODES, "n2", 2, votes + [refused]).heard == 93.25
    late = el.tally(NODES, "n2", 2, [votes[0], replace(votes[1], heard_at=150.0)])
    assert take_over("J", list(NODES), 5.0, r, late, "n2", "n1", 100.0, 1100.0)[0].restart_start == 100.0 + r.fence_wait


def test_the_new_world_runs_once_its_nodes_started_their_part():
    board, _ = take_over("J", list(NODES), 5.0, restart(max_restarts=5), won(), "n2", "n1", 0.0, 1000.0)
    beat(board, "n2", 20.0, generation=2)
    assert board.status["status"] == "restarting"  # n3 has not started its part
    beat(board, "n3", 20.5, generation=2)
    assert board.status["status"] == "running" and board.status["generation"] == 2


def test_a_node_already_out_stays_out_and_the_healed_first_node_is_back_later():
    r = restart(max_restarts=5, min_nodes=1, max_rejoins=1)
    board, _ = take_over("J", list(NODES), 5.0, r, won(generation=3, out=("n3",)), "n2", "n1", 0.0, 1000.0)
    assert board.status["out"] == ["n1", "n3"] and board.status["generation"] == 4
    beat(board, "n2", 20.0, generation=4)
    assert board.status["status"] == "running"
    # n1 healed, its programs gone by its fence: it beats with none and is taken into the next generation
    board.beat({"node": "n1", "procs": {}}, 30.0, 1030.0)
    assert board.status["status"] == "restarting" and board.status["generation"] == 5
    assert board.status["back"] == "n1 back in generation 5 (WORLD_SIZE 2)"


def test_no_restart_left_ends_the_job_naming_why():
    board, _ = take_over("J", list(NODES), 5.0, restart(max_restarts=1), won(generation=1), "n2", "n1", 0.0, 0.0)
    assert board.status["status"] == "failed" and board.status["reason"].endswith("max_restarts (1) spent")


def test_without_election_the_first_node_still_cannot_leave():
    layout = restart().layout
    assert layout.elects()
    assert layout.leave("n1", frozenset())[0] is None  # the board on nodes[0] as today
    assert layout.leave("n1", frozenset(), elected=True) == (frozenset({"n1"}), "")
    ps = policy(cluster("pserver", 1, roles={"n1": ["pserver", "trainer"], "n2": ["trainer"], "n3": ["trainer"]})).layout
    assert not ps.elects() and "parameter servers" in ps.leave("n1", frozenset(), elected=True)[1]


def test_two_nodes_elect_nobody_and_the_line_says_no_majority():
    from tests.unit.test_elastic_first_node import two
    layout = policy(two()).layout
    assert not layout.elects()
    assert layout.leave("n1", frozenset(), elected=True)[1].endswith("(1 of 2 nodes is no majority: the other cannot "
                                                                      "tell n1 gone from itself cut off)")
