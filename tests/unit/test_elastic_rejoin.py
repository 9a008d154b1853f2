"""The world grows back under job.watchdog.min_nodes, as data: a node that left and beats again with nothing
of the job left there is taken into the next generation (the board), up to max_rejoins times; its agent
waits out of the generations it is not in and starts its part of the one that takes it back (the policy).
No process (tests/sshd/test_elastic_rejoin_netns.py heals a real cut)."""
from __future__ import annotations

from fabtrain.node.agent.policy import Ledger, Peers, Relaunch, Status, on_status, word_wait
from fabtrain.node.structs import replace
from tests.unit.test_elastic import NODES, beat, board
from tests.unit.test_policy import CFG, notes, run, trainer

ENDED = {"t": {"role": "trainer", "state": "exited", "exit_code": -15}}


def lose_n3(b, at=6.0):
    """n3 silent since 0, lost at `at` while the job runs: generation 1 without it, which n1 and n2 start."""
    for n in ("n1", "n2"):
        beat(b, n, at)
    b.check_peers(at, 2000 + at)
    assert b.status["out"] == ["n3"] and b.status["generation"] == 1
    start = b.restart_start
    for n in ("n1", "n2"):
        beat(b, n, start + 1, generation=1)
    assert b.status["status"] == "running"
    return start + 1


def test_a_node_back_with_nothing_left_joins_the_next_generation_at_full_size():
    b = board()
    t = lose_n3(b)
    # Its trainer still alive there (a heal before its fence ended it): not back yet, and it counts for nothing.
    live = beat(b, "n3", t + 1)
    assert live.reply["op"] == "status" and b.status["status"] == "running" and b.trainers == 2 and not b.back
    out = b.beat({"node": "n3", "procs": ENDED, "seq": 4}, t + 2, 3000)
    assert out.reply["op"] == "status" and out.reply["ack"] == 4 and out.broadcast
    assert b.status["status"] == "restarting" and b.status["generation"] == 2 and "out" not in b.status
    assert b.status["back"] == "n3 back in generation 2 (WORLD_SIZE 3)"
    assert b.status["backoff"] == b.restart.backoff  # one backoff, not doubled
    (ev,) = [e for e in out.events if e.kind == "node_back"]
    assert ev.node == "n3" and ev.reason == "n3 back in generation 2 (WORLD_SIZE 3)", ev
    assert ev.fields == {"generation": 2, "world_size": 3, "nodes": 3}
    # The generation waits for n3's part too; running once every node said it started it.
    for n in ("n1", "n2"):
        beat(b, n, t + 13, generation=2)
    assert b.status["status"] == "restarting"
    beat(b, "n3", t + 13, generation=2)
    assert b.status["status"] == "running" and b.trainers == 3 and b.status["back"]  # said while it runs


def test_a_node_back_before_the_generation_without_it_starts_is_in_that_generation():
    b = board(backoff=30.0)
    beat(b, "n2", 1, failure={"reason": "trainer-0 on n2 exited 1", "kind": "exit", "generation": 0})
    for n in ("n1", "n2"):
        beat(b, n, 6)
    b.check_peers(6.0, 2006)
    assert b.status["generation"] == 1 and b.status["out"] == ["n3"] and b.restart_start == 31.0
    b.beat({"node": "n3", "procs": ENDED}, 10, 2010)
    assert b.status["generation"] == 1 and "out" not in b.status and b.status["back"].startswith("n3 back in generation 1")
    assert b.status["backoff"] == 21.0 and b.status["restarts_left"] == b.restart.restarts_left(1)  # none spent


def test_a_node_back_while_a_generation_starts_waits_for_the_next_and_none_without_restarts_left():
    b = board(backoff=10.0)
    for n in ("n1", "n2"):
        beat(b, n, 6)
    b.check_peers(6.0, 2006)
    start = b.restart_start
    b.beat({"node": "n3", "procs": ENDED}, start - 0.5, 2020)  # about to start: this one runs without it
    assert b.status["out"] == ["n3"] and b.back == {"n3"}
    for n in ("n1", "n2"):
        out = beat(b, n, start + 1, generation=1)
    assert b.status["generation"] == 2 and b.status["back"].startswith("n3 back") and out.broadcast  # once it runs
    assert [e.kind for e in out.events] == ["node_back"]
    spent = board(max_restarts=1)
    t = lose_n3(spent)
    spent.beat({"node": "n3", "procs": ENDED}, t + 1, 3000)
    assert spent.status["status"] == "running" and spent.status["out"] == ["n3"]  # stays out, the job goes on


def test_a_node_that_keeps_leaving_is_kept_out_after_max_rejoins():
    b = board(max_rejoins=1, max_restarts=5)
    t = lose_n3(b)
    b.beat({"node": "n3", "procs": ENDED}, t + 1, 3000)
    for n in NODES:
        beat(b, n, t + 14, generation=2)
    assert b.status["status"] == "running" and "out" not in b.status
    for n in ("n1", "n2"):
        beat(b, n, t + 20)
    b.check_peers(t + 20, 3020)  # n3 lost again: it left twice
    assert b.status["out"] == ["n3"] and b.status["generation"] == 3
    out = b.beat({"node": "n3", "procs": ENDED, "seq": 9}, t + 25, 3025)
    assert out.reply["op"] == "fenced" and "it left 2 times, more than max_rejoins (1): it is kept out" in \
        out.reply["reason"], out.reply
    assert [e.kind for e in out.events] == ["fenced"] and b.status["out"] == ["n3"]


def test_a_node_that_could_not_start_its_part_is_not_taken_back():
    """It is there and answers, but its part does not start: taking it back would spend a restart each time."""
    b = board(max_restarts=5)
    beat(b, "n3", 1, failure={"reason": "restart 1 on n3: cannot start trainer-2", "kind": "start", "generation": 0})
    assert b.status["out"] == ["n3"]
    out = b.beat({"node": "n3", "procs": ENDED}, 2, 2002)
    assert out.reply["op"] == "fenced" and "a node that could not start its part is not taken back" in \
        out.reply["reason"] and b.status["out"] == ["n3"] and b.status["generation"] == 1


def test_a_heal_before_the_coordinator_lost_the_node_is_its_leaving_not_the_jobs_failure():
    """The agent fenced itself (fence_after) and says so; its beat gets through before peer_timeout."""
    b = board()
    beat(b, "n3", 4.5, failure={"reason": "coordinator ... unreachable ...; this node fences itself",
                                "kind": "lost", "generation": 0})
    assert b.status["status"] == "restarting" and b.status["out"] == ["n3"]
    cfg = replace(CFG, on_failure="restart", elastic=True)
    cut = Peers(ever_connected=True, connected=False, silent_for=1.0, lease_age=4.0, error="timed out")
    _, ledger = run(trainer(last_record=9.9), peers=cut, cfg=cfg)
    assert ledger.failure_kind == "lost" and ledger.coordinator_lost
    assert word_wait(ledger, cfg) == 600.0 and word_wait(ledger, replace(cfg, elastic=False)) == 12.0


def test_an_agent_out_of_a_generation_starts_nothing_and_starts_its_part_once_back():
    cfg = replace(CFG, on_failure="restart", elastic=True)
    fenced = Ledger(status=Status("failed", "coordinator unreachable; this node fences itself", "n2"),
                    failure="coordinator unreachable", failure_kind="lost", coordinator_lost=True)
    without = {"op": "status", "job_id": "J", "status": "restarting", "generation": 1, "backoff": 5.0, "out": ["n2"],
               "ts": 1.0, "reason": "node n2 lost"}
    actions, ledger = on_status(without, "J", fenced, cfg, 10.0)
    assert ledger.status.status == "restarting" and ledger.restart_at is None
    assert "n2 is out of it: it stops its part and starts nothing" in notes(actions, "restarting")[0].reason
    actions, _ = run(now=100.0, ledger=ledger, cfg=cfg, peers=Peers(ever_connected=True, connected=True, lease_age=0.5))
    assert not [a for a in actions if isinstance(a, Relaunch)]
    # Back in that same generation (it had not started yet): it starts with the others.
    back = dict(without, out=None, back="n2 back in generation 1 (WORLD_SIZE 3)", ts=2.0, backoff=3.0)
    actions, ledger = on_status(back, "J", ledger, cfg, 20.0)
    assert ledger.restart_at == 23.0 and notes(actions, "restarting")[0].reason.startswith("n2 back in generation 1")
    actions, _ = run(now=23.0, ledger=ledger, cfg=cfg, peers=Peers(ever_connected=True, connected=True, lease_age=0.5))
    assert Relaunch(1) in actions
    # Back in a new generation: a restart like any other, said as one that takes it back.
    grow = dict(without, generation=2, out=None, back="n2 back in generation 2 (WORLD_SIZE 3)", ts=3.0)
    actions, ledger = on_status(grow, "J", fenced, cfg, 30.0)
    assert ledger.generation == 2 and ledger.restart_at == 35.0
    assert notes(actions, "restarting")[0].reason.startswith("n2 back in generation 2 (WORLD_SIZE 3); restart 2")


def test_fab_status_says_which_node_is_back_in_the_generation_that_took_it():
    from fabtrain.controller.jobstate import NodeObservation, job_verdict
    from fabtrain.controller.verdict_text import sentence
    agent = {"job": {"status": "running", "on_failure": "restart", "generation": 2, "restarts_left": 1,
                     "back": "n3 back in generation 2 (WORLD_SIZE 3)"}}
    trainer = {"name": "trainer-0", "role": "trainer", "rank": 0, "state": "running", "pid": 10, "records": 5}
    nodes = [NodeObservation("n1", True, "J", processes=(trainer,), agent=agent, agent_age=0.1)]
    v = job_verdict(nodes, "J")
    assert v.back == "n3 back in generation 2 (WORLD_SIZE 3)", v
    assert "; n3 back in generation 2 (WORLD_SIZE 3)" in sentence(v, 6.0)
    other = dict(agent["job"], back=None)  # another node's agent that has not heard, of a later generation
    later = nodes + [NodeObservation("n2", True, "J", agent={"job": dict(other, generation=3)}, agent_age=0.1)]
    assert job_verdict(later, "J").back is None  # said in the generation that took it back only
