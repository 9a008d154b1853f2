"""job.watchdog.min_nodes as data: the config's refusals, who may leave, the board's smaller generation,
and the renumbered world each process of it gets. No process."""
from __future__ import annotations

from fabtrain.node.structs import replace

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.errors import UserError
from fabtrain.node.coordination.board import Board
from fabtrain.node.coordination.elastic import Layout, renumbered
from fabtrain.node.coordination.restart import RestartPolicy
from fabtrain.plan.plan import make_plan

NODES = ("n1", "n2", "n3")


def cluster(mode="collective", min_nodes=2, per_node=1, roles=None, command=None, **watchdog):
    roles = roles or {n: ["trainer"] for n in NODES}
    trainer = {"per_node": per_node, **({"command": command} if command else {})}
    return parse_cluster({"cluster": {"name": "c"},
                          "nodes": [{"name": n, "host": f"10.0.0.{i + 1}", "roles": roles[n]} for i, n in enumerate(NODES)],
                          "job": {"mode": mode, "master_port": 29500, "trainer": trainer,
                                  "watchdog": {"on_failure": "restart", "min_nodes": min_nodes, **watchdog}}}, "c.yaml")


@pytest.mark.parametrize("changes, words", [
    ({"on_failure": "kill-job"}, "job.watchdog.min_nodes: needs job.watchdog.on_failure: restart"),
    ({"min_nodes": 4}, "job.watchdog.min_nodes: is 4, but the cluster has 3 trainer nodes"),
    ({"min_nodes": 0}, "job.watchdog.min_nodes: must be between 1 and"),
    ({"command": "torchrun --nnodes=3 train.py"}, "job.trainer.command: --nnodes is fixed at start"),
    ({"command": "python train.py --world {world_size}"}, "job.trainer.command: {world_size} is fixed at start"),
])
def test_min_nodes_that_cannot_work_is_one_line_naming_the_field(changes, words):
    with pytest.raises(UserError) as e:
        cluster(**changes)
    assert str(e.value).startswith("c.yaml: ") and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def job_json(c, node: str) -> dict:
    return make_plan(c, "J").job_json(node)


def policy(c) -> RestartPolicy:
    j = job_json(c, "n1")
    return RestartPolicy.from_watchdog(j["watchdog"], j)


def test_who_may_leave_a_collective_job_and_a_pserver_job():
    layout = policy(cluster()).layout
    assert layout == Layout(2, NODES, NODES, frozenset(), 3)
    out, why = layout.leave("n3", frozenset())
    assert out == {"n3"} and why == "" and layout.world_size(out) == 2
    assert layout.leave("n2", out) == (None, "1 trainer node would be left, fewer than min_nodes (2)")
    assert "the first node: the agents' coordinator lives there" in layout.leave("n1", frozenset())[1]
    ps = policy(cluster("pserver", 1, roles={"n1": ["pserver"], "n2": ["pserver", "trainer"], "n3": ["trainer"]})).layout
    assert "runs parameter servers" in ps.leave("n2", frozenset())[1]
    assert ps.leave("n3", frozenset()) == ({"n3"}, "")
    assert policy(cluster(min_nodes=None)).layout is None


def beat(b, node, now, **kw):
    return b.beat({"node": node, "procs": {f"t-{node}": {"role": "trainer", "state": "running"}}, **kw}, now, 1000 + now)


def board(backoff=10.0, **watchdog):
    b = Board("J", list(NODES), 5.0, replace(policy(cluster(**watchdog)), backoff=backoff))
    for n in NODES:
        beat(b, n, 0)
    return b


def test_a_lost_node_leaves_and_the_generation_not_yet_started_runs_without_it():
    # the generation starts at 21: after n3's fence (its last beat at 0 + fence_wait 14); max_rejoins 0: it stays out
    b = board(backoff=20.0, max_rejoins=0)
    beat(b, "n2", 1, failure={"reason": "trainer-0 on n2 exited 1", "kind": "exit", "generation": 0})
    assert b.status["status"] == "restarting" and b.status["generation"] == 1
    beat(b, "n1", 6)
    beat(b, "n2", 6)
    events = b.check_peers(6.0, 2000)  # n3 silent for 6 s, its connection gone: lost
    assert [e.kind for e in events] == ["peer_lost", "node_left"]
    assert b.status["status"] == "restarting" and b.status["generation"] == 1 and b.status["out"] == ["n3"]
    assert events[1].fields == {"world_size": 2, "nodes_left": 2, "generation": 1}
    assert "n3 left the job" in events[1].reason and "WORLD_SIZE 2" in events[1].reason
    beat(b, "n1", 22, generation=1)
    assert beat(b, "n2", 22, generation=1).changed and b.status["status"] == "running"  # n3 is not waited for
    # It stays out (max_rejoins 0): its beats count for nothing, and its agent is told it is fenced out.
    out = beat(b, "n3", 23, failure={"reason": "x", "kind": "exit", "generation": 1}, seq=7)
    assert b.status["status"] == "running" and b.trainers == 2
    assert out.reply["op"] == "fenced" and out.reply["ack"] == 7 and "n3 left the job at generation 1" in \
        out.reply["reason"] and [e.kind for e in out.events] == ["fenced"] and not out.broadcast
    assert beat(b, "n3", 24).events == []  # the event once
    again = Board.restore(b.saved(2000), "J", list(NODES), 5.0, 50, b.restart)
    assert again.out == {"n3"} and again.status["out"] == ["n3"]


def test_no_generation_without_a_lost_node_starts_before_its_fence_ends():
    """The generation's start is never earlier than the lost node's last beat + fence_wait: its agent has
    stopped everything there by then (fence.py), whatever the backoff."""
    b = board(backoff=2.0)
    wait = b.restart.fence_wait
    assert wait == 4 + 1 + 1 + 1 + 5 + 1 + 1  # fence_after, a beat, keepalive, a tick, grace 5, launcher, safety
    beat(b, "n1", 6)
    beat(b, "n2", 6)
    b.check_peers(6.0, 2000)  # n3's last beat at 0: lost at 6
    assert b.status["status"] == "restarting" and b.status["generation"] == 1
    assert b.status["backoff"] == pytest.approx(wait - 6) and b.restart_start == pytest.approx(wait)
    # Lost while a generation waits to start: one whose start comes before the fence is replaced by the next.
    b = board(backoff=2.0)
    beat(b, "n2", 1, failure={"reason": "trainer-0 on n2 exited 1", "kind": "exit", "generation": 0})
    assert b.restart_start == 3.0
    beat(b, "n1", 2.5)
    beat(b, "n2", 2.5)
    assert b.check_peers(2.5, 2000) == []
    b.check_peers(5.5, 2000)
    assert b.status["generation"] == 2 and b.status["out"] == ["n3"] and b.restart_start == pytest.approx(wait)
    # One whose start is still far off waits for the fence instead: the same generation, no restart spent,
    # its start moved to the fence's end (the agents take the remaining backoff: policy.restarting).
    b = board(backoff=8.0)
    beat(b, "n2", 1, failure={"reason": "trainer-0 on n2 exited 1", "kind": "exit", "generation": 0})
    assert b.restart_start == 9.0
    beat(b, "n1", 5.5)
    beat(b, "n2", 5.5)
    b.check_peers(5.5, 2000)
    assert b.status["generation"] == 1 and b.status["out"] == ["n3"] and b.restart_start == pytest.approx(wait)
    assert b.status["backoff"] == pytest.approx(wait - 5.5) and b.status["restarts_left"] == b.restart.restarts_left(1)


def test_a_lost_nodes_backoff_counts_from_its_last_beat_not_from_when_the_coordinator_found_it_out():
    """Finding a lost node out takes peer_timeout (longer with an election): that time is part of the backoff,
    as a crashed program's exit starts its backoff at once. A backoff longer than the fence wait ends
    restart_backoff after the node's last beat; a shorter one, at the fence's end; neither is pushed later
    by the detection."""
    b = board(backoff=20.0)
    beat(b, "n1", 6)
    beat(b, "n2", 6)
    b.check_peers(6.0, 2000)  # n3's last beat at 0: lost at 6
    assert b.status["status"] == "restarting" and b.status["generation"] == 1 and b.status["out"] == ["n3"]
    assert b.restart_start == pytest.approx(20.0) and b.status["backoff"] == pytest.approx(14.0)
    b = board(backoff=10.0)
    wait = b.restart.fence_wait
    beat(b, "n1", 7)
    beat(b, "n2", 7)
    b.check_peers(7.0, 2000)
    assert wait > 10.0 and b.restart_start == pytest.approx(wait) and b.status["backoff"] == pytest.approx(wait - 7)
    # A program's failure is known when it happens: its backoff counts from the report, as before.
    b = board(backoff=20.0)
    beat(b, "n2", 3, failure={"reason": "trainer-0 on n2 exited 1", "kind": "exit", "generation": 0})
    assert b.restart_start == 23.0 and b.status["backoff"] == 20.0


def test_a_node_lost_while_running_restarts_smaller_and_a_second_loss_fails_naming_min_nodes():
    b = board()
    beat(b, "n1", 6)
    beat(b, "n2", 6)
    b.check_peers(6.0, 2000)
    assert b.status["status"] == "restarting" and b.status["generation"] == 1 and b.status["out"] == ["n3"]
    beat(b, "n1", 17, generation=1)
    beat(b, "n2", 17, generation=1)
    assert b.status["status"] == "running"
    beat(b, "n1", 30)
    b.check_peers(30.0, 2030)
    assert b.status["status"] == "failed" and b.status["node"] == "n2"
    assert "not restarted: 1 trainer node would be left, fewer than min_nodes (2)" in b.status["reason"]


def test_a_node_that_cannot_start_its_part_leaves_and_the_others_start_the_next_generation():
    b = board()
    beat(b, "n2", 1, failure={"reason": "trainer-0 on n2 exited 1", "kind": "exit", "generation": 0})
    due = 1 + b.restart.start_deadline(1)
    for n in ("n1", "n2"):
        beat(b, n, due - 1, generation=1)
    beat(b, "n3", due - 1)  # alive, but its part did not start
    events = b.check_peers(due, 2000)
    assert [e.kind for e in events] == ["node_left"] and b.status["generation"] == 2 and b.status["out"] == ["n3"]
    b2 = board()
    beat(b2, "n3", 1, failure={"reason": "restart 1 on n3: cannot start", "kind": "start", "generation": 0})
    assert b2.status["status"] == "restarting" and b2.status["out"] == ["n3"]


def test_the_smaller_world_is_renumbered_over_the_nodes_that_are_left():
    c = cluster(per_node=2)
    j3 = job_json(c, "n3")
    env = renumbered(j3, j3["processes"][1], {"n2"})  # trainer-5 on n3: now node 1 of 2, local rank 1
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["NODE_RANK"]) == ("3", "4", "1", "1")
    assert (env["PADDLE_TRAINER_ID"], env["PADDLE_TRAINERS_NUM"], env["OMPI_COMM_WORLD_RANK"]) == ("3", "4", "3")
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["FABTRAIN_RANK"] == "5"  # the slot keeps its name
    assert env["PADDLE_TRAINER_ENDPOINTS"].split(",") == [
        "10.0.0.1:29501", "10.0.0.1:29502", "10.0.0.3:29501", "10.0.0.3:29502"]
    assert env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.3:29502"
    # The first trainer node gone (a pserver job's coordinator is on its pserver node): the master moves.
    ps = cluster("pserver", 1, roles={"n1": ["pserver"], "n2": ["trainer"], "n3": ["trainer"]})
    p3 = job_json(ps, "n3")
    env = renumbered(p3, p3["processes"][0], {"n2"})
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["PADDLE_INIT_NUM_GRADIENT_SERVERS"]) == (
        "0", "1", "10.0.0.3", "1")
    pserver = job_json(ps, "n1")["processes"][0]
    assert renumbered(job_json(ps, "n1"), pserver, {"n2"})["PADDLE_INIT_NUM_GRADIENT_SERVERS"] == "1"
    assert renumbered(j3, j3["processes"][0], ()) == j3["processes"][0]["env"]


def test_every_generation_has_its_own_rendezvous_port_checked_free_at_start():
    c = cluster(max_restarts=3)
    j1 = job_json(c, "n1")
    spec = j1["processes"][0]
    assert spec["env"]["MASTER_PORT"] == "29500"
    ports = [renumbered(j1, spec, (), g)["MASTER_PORT"] for g in range(4)]
    assert ports == ["29500", "29501", "29502", "29503"]
    assert renumbered(j1, spec, {"n3"}, 2)["MASTER_PORT"] == "29502"
    from fabtrain.plan.ports import port_uses
    master = [u for u in port_uses(c, {"master_port": 29500}) if u.setting == "master_port"]
    assert [list(u.ports) for u in master] == [[29500, 29501, 29502, 29503]] and "master_port + g" in master[0].what
