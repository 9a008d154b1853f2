"""`may_start` wired (coordination/quorum.py): a coordinator of a job that elects lets a restart's generation start
only once a strict majority of the job's trainer nodes' beats say they know it; its agents wait for that
(agent/policy.py). The real Board, RestartPolicy and the agent's rules, no process. A job that does not elect
is as before: no `held`, the same status."""
from __future__ import annotations

from fabtrain.contract.states import JobState
from fabtrain.node.agent.loop import replay
from fabtrain.node.agent.policy import Config, Ledger, restarting
from fabtrain.node.coordination.board import Board
from fabtrain.node.coordination.election import may_start
from fabtrain.node.structs import replace
from tests.unit.test_elastic import NODES, beat, cluster, policy

FAILED = {"reason": "trainer-0 on n2 exited 1", "kind": "exit", "generation": 0}
CFG = Config(node="n3", job_id="J", interval=1.0, hang_timeout=3.0, startup_timeout=60.0, grace=2.0,
             on_failure="restart", coordinator_node="n1", coordinator="10.0.0.1:7180", elastic=True)


def restarted_board(**watchdog) -> Board:
    """Every node beating generation 0 (knowing it), then n2's trainer failing at 1: a restart to generation 1,
    decided at 1 with a backoff of 10 s (its start at 11)."""
    b = Board("J", list(NODES), 5.0, replace(policy(cluster(max_restarts=3, **watchdog)), backoff=10.0))
    for n in NODES:
        beat(b, n, 0, knows=0)
    beat(b, "n2", 1, failure=FAILED, knows=0)
    assert b.status["status"] == JobState.RESTARTING and b.status["generation"] == 1
    return b


def test_may_start_is_a_strict_majority_of_the_trainer_nodes_knowing_the_generation():
    assert not may_start(1, {"n1": 1}, NODES) and not may_start(1, {"n1": 1, "n2": 0, "n3": 0}, NODES)
    assert may_start(1, {"n1": 1, "n3": 2}, NODES)
    assert not may_start(1, {"n1": 1, "n2": 1, "x": 1}, ("n1", "n2", "n3", "n4", "n5"))  # 2 of 5 (x is none)


def test_a_restart_known_to_a_minority_is_held_and_starts_once_a_majority_knows_it():
    b = restarted_board()
    assert b.quorum == NODES and b.status["held"] is True
    line = b.status_line()
    # the agents tear down and wait: no start time while it is held
    _, waiting = restarting(line, Ledger(), CFG, 1.5)
    assert waiting.generation == 1 and waiting.restart_at is None and waiting.held
    out = beat(b, "n1", 2.0, knows=1)  # the coordinator's own node: 1 of 3 is no majority
    assert b.status["held"] is True and not out.broadcast
    # nobody starts it, also long after its backoff (its nodes are cut off: the deadline then loses them)
    assert restarting(b.status_line(), waiting, CFG, 30.0)[1].restart_at is None
    out = beat(b, "n3", 3.0, knows=1)  # 2 of 3
    assert "held" not in b.status and out.broadcast and b.status["status"] == JobState.RESTARTING
    assert b.status["backoff"] == 8.0 and b.restart_start == 11.0  # the rest of the backoff decided at 1
    notes, started = restarting(b.status_line(), waiting, CFG, 3.5)
    assert notes == [] and started.restart_at == 11.5 and not started.held
    # the rest (n2 says it knows too) changes nothing more
    assert not beat(b, "n2", 4.0, knows=1).broadcast and b.status["backoff"] == 8.0


def test_a_majority_that_knows_only_after_the_backoff_starts_it_then_with_its_deadline_moved_as_far():
    b = restarted_board()
    due = b.restart_due
    beat(b, "n1", 20.0, knows=1)
    beat(b, "n2", 25.0, knows=1)
    assert "held" not in b.status and b.status["backoff"] == 0.0 and b.restart_start == 25.0
    assert b.restart_due == due + 14.0  # counted from the start it was given, not the one decided
    beat(b, "n1", 26.0, generation=1, knows=1)
    beat(b, "n2", 26.0, generation=1, knows=1)
    beat(b, "n3", 26.0, generation=1, knows=1)
    assert b.status["status"] == JobState.RUNNING and b.status["generation"] == 1


def test_a_job_that_does_not_elect_starts_on_its_backoff_as_before():
    b = restarted_board(min_nodes=None)  # no min_nodes: it does not elect
    assert b.quorum is None and "held" not in b.status and b.status["backoff"] == 10.0
    _, waiting = restarting(b.status_line(), Ledger(), replace(CFG, elastic=False), 1.5)
    assert waiting.restart_at == 11.5 and not waiting.held
    # the beats' `knows` (an agent of another version) is nothing to it
    assert not beat(b, "n1", 2.0, knows=1).broadcast and "held" not in b.status


def test_an_agent_started_again_during_a_held_restart_waits_for_the_release_then_starts_at_once():
    """Its keeper starts it again while its node waits out a held restart: all it has is its `restarting` event
    (agent/loop.py replay). It starts nothing while the status says held, and once it does not, at once (the
    rest of the backoff is not in its events); a job that does not elect starts it at once too, as before."""
    said = {"ts": 1.6, "node": "n3", "kind": "restarting", "reason": "job failed (x); restart 1 in 10 s",
            "origin": "n2", "generation": 1}
    for watchdog, released_at in (({}, 31.0), ({"min_nodes": None}, 2.0)):
        b = restarted_board(**watchdog)
        again, generation, _ = replay([said], "n3", {}, 0, float("inf"), 0.0, 60.0)
        assert again.status.status == JobState.RESTARTING and again.generation == 1 and generation == 0
        assert again.restart_at is None and again.held  # nothing started from the event alone
        cfg = CFG if b.quorum else replace(CFG, elastic=False)
        if b.quorum:
            _, again = restarting(b.status_line(), again, cfg, 30.0)  # still held, long after its backoff
            assert again.restart_at is None and again.held
            beat(b, "n1", 30.5, knows=1)
            beat(b, "n2", 30.5, knows=1)
            assert "held" not in b.status
        notes, started = restarting(b.status_line(), again, cfg, released_at)
        assert notes == [] and started.restart_at == released_at and not started.held and not started.replayed
