"""on_failure restart as data: the restart policy, the coordinator's board and the agent's rules, no process."""
from __future__ import annotations

from fabtrain.node.structs import replace

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.controller.jobstate import NodeObservation, job_verdict
from fabtrain.plan.plan import make_plan
from fabtrain.node.agent.policy import (Config, Ledger, Note, Observation, Peers, ProcFacts, Relaunch,
                                        Status, Stop, decide, fail, on_status)
from fabtrain.node.coordination.board import Board
from fabtrain.node.coordination.fence import fence_wait
from fabtrain.node.coordination.restart import BACKOFF_CAP, RestartPolicy
from fabtrain.contract.states import JobState, ProcessState

POLICY = RestartPolicy(enabled=True, max_restarts=3, backoff=10.0, exit_codes=None, grace=2.0)
CFG = Config(node="n2", job_id="J", interval=1.0, hang_timeout=3.0, startup_timeout=60.0, grace=2.0, on_failure="restart",
             coordinator_node="n1", coordinator="10.0.0.1:7180")


def exit_failure(code=137, generation=0, kind="exit"):
    return {"reason": "trainer-1 on n2 killed by SIGKILL", "kind": kind, "exit_code": code, "generation": generation}


# -- the policy -------------------------------------------------------------------------------


def test_the_backoff_doubles_from_restart_backoff_and_is_capped():
    assert [POLICY.backoff_for(g) for g in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert POLICY.backoff_for(30) == BACKOFF_CAP
    assert replace(POLICY, backoff=600).backoff_for(3) == 600  # a larger first backoff is its own cap


def test_an_exit_or_a_hang_is_restarted_until_max_restarts_is_spent():
    d = POLICY.decide(exit_failure(), 0)
    assert d.restart and d.generation == 1 and d.backoff == 10
    assert POLICY.decide(exit_failure(kind="hang", code=None), 2).generation == 3
    spent = POLICY.decide(exit_failure(), 3)
    assert not spent.restart and spent.why_not == "max_restarts (3) spent"
    assert POLICY.restarts_left(1) == 2 and POLICY.restarts_left(5) == 0


@pytest.mark.parametrize("kind", ["other", "kill-all", "start", None])
def test_a_lost_node_kill_all_or_a_failed_start_is_never_restarted(kind):
    d = POLICY.decide(exit_failure(kind=kind), 0)
    assert not d.restart and "not a restartable failure" in d.why_not


def test_restart_on_exit_codes_filters_exits_but_not_hangs():
    p = replace(POLICY, exit_codes=(137, 143))
    assert p.decide(exit_failure(code=137), 0).restart
    d = p.decide(exit_failure(code=1), 0)
    assert not d.restart and d.why_not == "exit code 1 is not in restart_on_exit_codes [137, 143]"
    assert p.decide(exit_failure(kind="hang", code=None), 0).restart


def test_kill_job_and_keep_never_restart():
    assert not RestartPolicy.never().decide(exit_failure(), 0).restart
    assert RestartPolicy.from_watchdog(planned_watchdog(on_failure="kill-job")).enabled is False
    w = planned_watchdog(max_restarts=2, restart_backoff=1.5, restart_on_exit_codes=[137])
    assert RestartPolicy.from_watchdog(w) == RestartPolicy(True, 2, 1.5, (137,), 5.0, fence_wait=fence_wait(
        float(w["interval"]), 5.0))


def test_the_node_reads_the_restart_settings_strictly_from_job_json():
    """cluster.yaml's config holds the only defaults: a job.json without a setting is refused, not defaulted."""
    w = planned_watchdog()
    del w["max_restarts"]
    with pytest.raises(KeyError):
        RestartPolicy.from_watchdog(w)


# -- the config -------------------------------------------------------------------------------

def planned_watchdog(**watchdog) -> dict:
    """job.json's watchdog as the plan writes it from cluster.yaml."""
    return make_plan(cluster(**watchdog), "J").job_json("n1")["watchdog"]


def cluster(**watchdog):
    return parse_cluster({"cluster": {"name": "c"}, "nodes": [{"name": "n1", "host": "127.0.0.2", "roles": ["trainer"]}],
                          "job": {"mode": "collective", "watchdog": {"on_failure": "restart", **watchdog}}})


@pytest.mark.parametrize("field, value, message", [
    ("max_restarts", -1, "job.watchdog.max_restarts: must be between 0 and 1000, got -1"),
    ("restart_backoff", "soon", "job.watchdog.restart_backoff: must be a number, got a string"),
    ("restart_on_exit_codes", [137, 300], "job.watchdog.restart_on_exit_codes[1]: must be between 1 and 255, got 300"),
    ("restart_on_exit_codes", 137, "job.watchdog.restart_on_exit_codes: must be a non-empty list of exit codes"),
])
def test_a_wrong_restart_value_is_one_line_naming_the_field(field, value, message):
    with pytest.raises(Exception) as e:
        cluster(**{field: value})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_restart_keys_and_their_defaults():
    w = cluster().job.watchdog
    assert (w.on_failure, w.max_restarts, w.restart_backoff, w.restart_on_exit_codes) == ("restart", 3, 10.0, None)


# -- the board: one generation for the whole job ------------------------------------------------


def beat(b, node, now, **kw):
    msg = {"node": node, "procs": {f"p-{node}": {"role": "trainer", "state": "running"}}, **kw}
    return b.beat(msg, now, 1000 + now)


def board():
    b = Board("J", ["n1", "n2", "n3"], 5.0, POLICY)
    for n in ("n1", "n2", "n3"):
        beat(b, n, 0)
    return b


def test_a_failure_moves_the_job_to_the_next_generation_and_back_to_running_once_every_node_started():
    b = board()
    out = beat(b, "n2", 1, failure=exit_failure())
    assert out.changed and b.status["status"] == "restarting" and b.status["generation"] == 1
    assert b.status["backoff"] == 10 and b.status["restarts_left"] == 2
    assert out.reply["status"] == "restarting"  # the failing agent hears it in the reply to its own beat
    # A late failure of generation 0 (an agent that had not heard yet) changes nothing.
    assert not beat(b, "n3", 2, failure=exit_failure()).changed and b.status["generation"] == 1
    beat(b, "n1", 12, generation=1)
    beat(b, "n2", 12, generation=1)
    assert b.status["status"] == "restarting"  # all or nothing: n3 has not started its part
    assert beat(b, "n3", 13, generation=1).changed and b.status["status"] == "running"
    assert b.status["generation"] == 1


def test_a_node_that_does_not_start_its_part_fails_the_job_naming_it():
    b = board()
    beat(b, "n2", 1, failure=exit_failure())
    due = 1 + POLICY.start_deadline(1)
    beat(b, "n1", due - 1, generation=1)
    beat(b, "n2", due - 1, generation=1)
    beat(b, "n3", due - 1)  # alive, but has not started its part
    assert b.check_peers(due - 0.5, 0) == [] and b.status["status"] == "restarting"
    events = b.check_peers(due, 2000)
    assert b.status["status"] == "failed" and b.status["node"] == "n3"
    assert "restart to generation 1 failed: node n3 did not start its part" in b.status["reason"]
    assert [e.kind for e in events] == ["restart_failed"]


def test_after_max_restarts_the_next_failure_fails_the_job_and_a_kill_all_is_final():
    b = Board("J", ["n1"], 5.0, replace(POLICY, max_restarts=1))
    beat(b, "n1", 0, failure=exit_failure())
    beat(b, "n1", 11, generation=1)
    beat(b, "n1", 12, generation=1, failure=exit_failure(generation=1))
    assert b.status["status"] == "failed" and "not restarted: max_restarts (1) spent" in b.status["reason"]
    k = board()
    beat(k, "n2", 1, failure=exit_failure(kind="kill-all"))
    assert k.status["status"] == "failed"


def test_a_restored_coordinator_keeps_the_generation():
    b = board()
    beat(b, "n2", 1, failure=exit_failure())
    again = Board.restore(b.saved(1001), "J", ["n1", "n2", "n3"], 5.0, 50, POLICY)
    assert again.status["status"] == "restarting" and again.status["generation"] == 1
    assert again.restart_due == 50 + POLICY.start_deadline(1) and again.peers["n2"].had_procs


# -- the agent ------------------------------------------------------------------------------


def restarting_msg(g=1, backoff=10.0):
    return {"op": "status", "job_id": "J", "status": "restarting", "generation": g, "backoff": backoff,
            "reason": "trainer-1 on n3 killed by SIGKILL", "node": "n3", "restarts_left": 2}


def trainer(**kw):
    return ProcFacts(**{**dict(name="trainer-0", role="trainer", rank=0, state=ProcessState.RUNNING, pid=200,
                               launcher=100, last_activity=0.0), **kw})


def test_an_agent_tears_down_waits_the_backoff_then_relaunches():
    actions, ledger = on_status(restarting_msg(), "J", Ledger(), CFG, now=100.0)
    assert [a.kind for a in actions] == [JobState.RESTARTING] and actions[0].fields["backoff"] == 10.0
    assert ledger.status.status == JobState.RESTARTING and ledger.generation == 1 and ledger.restart_at == 110.0
    actions, ledger = decide(Observation(now=100.1, procs=(trainer(),)), ledger, CFG)
    assert [a for a in actions if isinstance(a, Stop)] and any(
        isinstance(a, Note) and a.kind == "teardown" for a in actions)
    gone = trainer(state=ProcessState.KILLED, exit_code=143, close_reason="teardown")
    actions, ledger = decide(Observation(now=105.0, procs=(gone,)), ledger, CFG)
    assert not [a for a in actions if isinstance(a, Relaunch)]  # the backoff is not over
    assert not [a for a in actions if isinstance(a, Note) and a.kind == "job_failed"]  # a teardown is no failure
    actions, ledger = decide(Observation(now=110.0, procs=(gone,)), ledger, CFG)
    assert [a for a in actions if isinstance(a, Relaunch)] == [Relaunch(1)]
    # The same generation said again (a reply) does not restart twice.
    assert on_status(restarting_msg(), "J", ledger, CFG, now=111.0)[0] == []


def test_kill_all_during_the_backoff_fails_the_job_instead_of_relaunching():
    _, ledger = on_status(restarting_msg(backoff=1.0), "J", Ledger(), CFG, now=100.0)
    actions, ledger = decide(Observation(now=102.0, killed_by="fab kill-all"), replace(ledger, acted=True), CFG)
    assert not [a for a in actions if isinstance(a, Relaunch)]
    assert ledger.status.status == "failed" and ledger.failure_kind == "kill-all"


def test_an_agent_whose_own_failure_started_it_takes_the_restart_but_not_after_a_final_failure():
    _, mine = fail(Ledger(), CFG, "trainer-0 on n2 killed by SIGKILL", "exit", 137)
    assert mine.failure_kind == "exit" and mine.failure_code == 137
    assert on_status(restarting_msg(), "J", mine, CFG, now=1.0)[1].status.status == JobState.RESTARTING
    final = Ledger(status=Status("failed", "node n3 lost", "n3"))
    assert on_status(restarting_msg(), "J", final, CFG, now=1.0)[1] == final
    assert on_status(restarting_msg(), "J", Ledger(), replace(CFG, on_failure="kill-job"), now=1.0)[1] == Ledger()


def test_a_lost_coordinator_during_the_backoff_fails_instead_of_a_lonely_restart():
    _, ledger = on_status(restarting_msg(backoff=1.0), "J", Ledger(), CFG, now=100.0)
    peers = Peers(ever_connected=True, silent_for=9.0)
    actions, ledger = decide(Observation(now=102.0, peers=peers), replace(ledger, acted=True), CFG)
    assert not [a for a in actions if isinstance(a, Relaunch)] and ledger.status.status == "failed"


# -- what fab status says -------------------------------------------------------------------


def test_a_failure_followed_by_a_restart_is_not_the_jobs_verdict():
    ev = [{"kind": "job_failed", "ts": 1.0, "reason": "trainer-1 killed"},
          {"kind": "restarting", "ts": 1.1, "generation": 1}, {"kind": "restarted", "ts": 12.0, "generation": 1}]
    health = {"job": {"status": "running", "on_failure": "restart", "generation": 1, "restarts_left": 2}}
    procs = ({"name": "trainer-0", "state": "running"},)
    v = job_verdict([NodeObservation("n1", True, "J", procs, agent=health, agent_age=0.5, events=tuple(ev))])
    assert v.state == JobState.RUNNING and v.restarts == "generation 1, 2 restarts left"
    restarting = {"job": dict(health["job"], status="restarting", reason="trainer-1 killed")}
    gone = ({"name": "trainer-0", "state": "killed", "exit_code": 143},)
    v = job_verdict([NodeObservation("n1", True, "J", gone, agent=restarting, agent_age=0.5, events=tuple(ev[:2]))])
    assert v.state == JobState.RESTARTING and not v.ended


def test_a_node_fenced_out_under_min_nodes_does_not_fail_the_verdict():
    """Its agent fenced itself (job_failed there, its trainer killed): the job goes on without it."""
    running = {"job": {"status": "running", "on_failure": "restart", "generation": 1, "restarts_left": 1,
                       "out": ["n3"], "world_size": 2}}
    fenced = {"job": {"status": "failed", "on_failure": "restart", "generation": 0, "reason": "fenced out of the job"}}
    nodes = [NodeObservation("n1", True, "J", ({"name": "trainer-0", "state": "running"},), agent=running,
                             agent_age=0.5),
             NodeObservation("n3", True, "J", ({"name": "trainer-2", "state": "killed", "exit_code": 143},),
                             agent=fenced, agent_age=0.5, events=({"kind": "job_failed", "ts": 1.0,
                                                                   "reason": "coordinator unreachable"},))]
    v = job_verdict(nodes)
    assert v.state == JobState.RUNNING and v.left == ("n3",), v
    assert job_verdict(nodes[1:]).state == JobState.FAILED  # without the coordinator's word it is a failure


def test_metrics_has_a_restarts_counter_for_a_restarting_job():
    from types import SimpleNamespace

    from fabtrain.controller.jobstate import Verdict
    from fabtrain.dashboard.prometheus import render
    snap = SimpleNamespace(cluster="c", verdict=Verdict(JobState.RUNNING, job_id="J", generation=2, restarts_left=1),
                           nodes=(), progress={}, dropped={})
    text = render(snap, 0.0)
    assert "# TYPE fabtrain_job_restarts_total counter" in text
    assert 'fabtrain_job_restarts_total{cluster="c",job="J"} 2' in text
    assert 'fabtrain_job_restarts_left{cluster="c",job="J"} 1' in text
    plain = SimpleNamespace(cluster="c", verdict=Verdict(JobState.RUNNING, job_id="J"), nodes=(), progress={},
                            dropped={})
    assert "restarts" not in render(plain, 0.0)  # a job that does not restart has no such series


def test_a_restartable_failure_is_not_the_jobs_end_until_the_coordinator_says_so():
    actions, ledger = fail(Ledger(), CFG, "trainer-0 on n2 exited with code 1", "exit", 1)
    assert [a.kind for a in actions] == ["failure"] and ledger.pending  # not job_failed: it may be restarted
    final = {"op": "status", "job_id": "J", "status": "failed", "node": "n1",
             "reason": "trainer-0 on n2 exited with code 1; not restarted: max_restarts (3) spent"}
    actions, ledger = on_status(final, "J", ledger, CFG, now=1.0)
    assert [a.kind for a in actions] == ["job_failed"] and "max_restarts" in actions[0].reason
    assert not ledger.pending and ledger.status.status == "failed"
    actions, _ = fail(Ledger(), CFG, "stopped by fab kill-all", "kill-all")
    assert [a.kind for a in actions] == ["job_failed"]  # never restarted: final at once


def test_an_evicted_nodes_loss_said_by_the_agent_that_replaced_it_restarts_once_and_keeps_that_agent_watched():
    lost = {"reason": "node n2 evicted by Kubernetes", "kind": "lost", "generation": 0}
    said_by_old = Board("J", ["n1", "n2"], 5.0, POLICY)
    said_by_new = Board("J", ["n1", "n2"], 5.0, POLICY)
    for b in (said_by_old, said_by_new):
        b.beat({"node": "n1", "procs": {}}, 0, 1000)
    said_by_old.beat({"node": "n2", "procs": {}, "failure": lost}, 1, 1001)
    said_by_new.beat({"node": "n2", "procs": {}, "failure": dict(lost, before=True)}, 1, 1001)
    for b in (said_by_old, said_by_new):
        assert (b.status["status"], b.status["generation"]) == ("restarting", 1)
    assert said_by_old.peers["n2"].done  # the agent the platform took goes silent: not lost
    assert not said_by_new.peers["n2"].done  # the new one runs: its silence is a loss
    said_by_new.beat({"node": "n2", "failure": dict(lost, before=True)}, 2, 1002)  # said again: the same restart
    assert said_by_new.status["generation"] == 1
    assert [e.kind for e in said_by_new.check_peers(10, 1010)] == ["peer_lost", "peer_lost"]


def test_the_agent_of_a_replaced_part_says_its_loss_first_and_only_while_the_job_runs():
    actions, ledger = fail(Ledger(), CFG, "node n2 evicted by Kubernetes", "lost", before=True)
    assert ledger.failure_before and ledger.pending and [a.kind for a in actions] == ["failure"]
    _, later = fail(replace(ledger, status=Status(JobState.RUNNING)), CFG, "trainer-1 on n2 exited 1", "exit")
    assert not later.failure_before  # a failure of its own part is not its predecessor's


def part_beat(b, node, part, now, **kw):
    return b.beat({"node": node, "part": part, "procs": {f"t-{node}": {"role": "trainer", "state": "running"}}, **kw},
                  now, 1000 + now)


def test_a_nodes_part_started_again_while_its_generation_ran_restarts_the_job_once():
    b = Board("J", ["n1", "n2"], 5.0, POLICY)
    part_beat(b, "n1", "a1", 0)
    part_beat(b, "n2", "b1", 0)
    part_beat(b, "n2", "b1", 1)  # the same part going on (a new connection, the agent restarted by its keeper)
    assert b.status["status"] == "running"
    part_beat(b, "n2", "b2", 2)  # a replacement pod: its agent beats before any silence could lose the old one
    assert (b.status["status"], b.status["generation"]) == ("restarting", 1)
    assert "node n2 lost: its part was started again while generation 0 ran there" in b.status["reason"]
    assert not b.peers["n2"].done  # the new part's agent is watched
    part_beat(b, "n2", "b3", 3)  # not of the generation running: nothing more
    assert b.status["generation"] == 1


@pytest.mark.parametrize("before", [{"done": True}, {"procs": {}}])
def test_a_new_part_after_the_old_one_ended_or_never_ran_is_no_loss(before):
    b = Board("J", ["n1", "n2"], 5.0, POLICY)
    part_beat(b, "n1", "a1", 0)
    b.beat({"node": "n2", "part": "b1", "procs": {}, **before}, 0, 1000)
    part_beat(b, "n2", "b2", 1)
    assert b.status["status"] == "running"


def test_a_restored_board_knows_each_nodes_part():
    b = Board("J", ["n1", "n2"], 5.0, POLICY)
    part_beat(b, "n1", "a1", 0)
    part_beat(b, "n2", "b1", 0)
    restored = Board.restore(b.saved(1000), "J", ["n1", "n2"], 5.0, 10, POLICY)
    part_beat(restored, "n2", "b1", 11)
    assert restored.status["status"] == "running"
    part_beat(restored, "n2", "b2", 12)
    assert restored.status["status"] == "restarting"
