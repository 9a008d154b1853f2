"""Spare nodes (`spare: true`, under job.watchdog.min_nodes) as data: the config's refusals, the plan (a spare
is not in the world at start), the board (a spare takes a lost node's slot, same WORLD_SIZE), and the
renumbered world its process gets. No process."""
from __future__ import annotations

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.errors import UserError
from fabtrain.plan.plan import make_plan

NODES = ("n1", "n2", "n3", "n4")


def doc(spares=("n4",), roles=None, min_nodes=2, mode="collective", job_trainer=None, **job):
    roles = roles or {}
    watchdog = {"on_failure": "restart", **({"min_nodes": min_nodes} if min_nodes else {})}
    return {"cluster": {"name": "c"},
            "nodes": [{"name": n, "host": f"10.0.0.{i + 1}", "roles": roles.get(n, ["trainer"]),
                       **({"spare": True} if n in spares else {})} for i, n in enumerate(NODES)],
            "job": {"mode": mode, "master_port": 29500, "trainer": job_trainer or {"per_node": 1}, "watchdog": watchdog,
                    **job}}


def cluster(**kw):
    return parse_cluster(doc(**kw), "c.yaml")


@pytest.mark.parametrize("kw, words", [
    ({"min_nodes": None}, "nodes[3].spare: needs job.watchdog.min_nodes"),
    ({"spares": ("n1",)}, "nodes[0].spare: n1 is the first node"),
    ({"spares": ("n4",), "mode": "pserver", "roles": {"n1": ["pserver", "trainer"], "n4": ["pserver", "trainer"]}},
     "nodes[3].spare: n4 has the roles pserver, trainer: a spare has the trainer role only"),
    ({"spares": ("n2", "n3", "n4"), "roles": {"n1": ["pserver"]}, "mode": "pserver", "min_nodes": 1},
     "nodes[3].spare: every trainer node is a spare"),
])
def test_a_spare_that_cannot_work_is_one_line_naming_its_key(kw, words):
    with pytest.raises(UserError) as e:
        cluster(**kw)
    assert str(e.value).startswith("c.yaml: ") and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_spare_with_mpirun_or_kubernetes_or_a_non_boolean_is_refused_naming_the_key():
    d = doc()
    d["nodes"][3]["spare"] = "yes"
    with pytest.raises(UserError, match=r"nodes\[3\]\.spare: must be true or false"):
        parse_cluster(d, "c.yaml")
    # mpirun cannot restart at all (on_failure restart is refused with it): with a spare, the spare's line too
    with pytest.raises(UserError) as e:
        cluster(launcher="mpirun")
    assert "nodes[3].spare: is for nodes: clusters" in str(e.value)


def test_a_spare_with_fewer_gpus_than_a_slots_ranks_is_refused_and_does_not_size_the_world():
    d = doc(job_trainer={"use_gpu": True})
    for n in d["nodes"]:
        n["gpus"] = 4
    d["nodes"][3]["gpus"] = 2
    with pytest.raises(UserError, match="4 ranks x 1 GPUs need 4 GPUs, node n4 has 2"):
        parse_cluster(d, "c.yaml")
    d["nodes"][3]["gpus"] = 8
    assert parse_cluster(d, "c.yaml").job.trainer.per_node == 4  # the world's nodes size it, not the spare

def test_a_spare_is_not_in_the_world_at_start_but_holds_its_trainer_spec():
    d = doc()
    d["nodes"].pop()  # the same job without its spare n4
    with_spare, without = make_plan(cluster(), "J"), make_plan(parse_cluster(d, "c.yaml"), "J")
    for node in ("n1", "n2", "n3"):
        a, b = with_spare.job_json(node), without.job_json(node)
        assert a["processes"] == b["processes"] and a["trainers"] == b["trainers"] == 3
    spare = with_spare.job_json("n4")
    assert [n.get("spare", False) for n in spare["nodes"]] == [False, False, False, True]
    (proc,) = spare["processes"]
    assert proc["role"] == "trainer" and proc["started_by"] == "stand_in"  # node ops' start leaves it alone
    assert proc["env"]["WORLD_SIZE"] == "3" and proc["env"]["MASTER_ADDR"] == "10.0.0.1"
    assert spare["trainers"] == 3
    from fabtrain.controller.report import plan_text  # fab plan says which node is a spare, and what that means
    text = plan_text(with_spare, asked=False)
    assert text.count("# spare: its agent starts these only in a lost trainer node's slot") == 1
    assert text.index("## node n4") < text.index("# spare:") < text.index("# trainer-3")


# -- the board ---------------------------------------------------------------------------------------------

from fabtrain.node.coordination.board import Board  # noqa: E402
from fabtrain.node.coordination.elastic import renumbered  # noqa: E402
from fabtrain.node.coordination.restart import RestartPolicy  # noqa: E402
from fabtrain.node.structs import replace  # noqa: E402

RUNNING = {"role": "trainer", "state": "running"}
IDLE = {"role": "trainer", "state": "not started"}


def beat(b, node, now, idle=False, **kw):
    procs = {f"t-{node}": IDLE if idle else RUNNING}
    return b.beat({"node": node, "procs": procs, **kw}, now, 1000 + now)


def board(c, backoff=10.0):
    """A board of `c`'s job that runs: every trainer node beats with its trainer running, every spare idle."""
    j = make_plan(c, "J").job_json("n1")
    b = Board("J", [n.name for n in c.nodes], 5.0, replace(RestartPolicy.from_watchdog(j["watchdog"], j),
                                                          backoff=backoff))
    for n in c.nodes:
        beat(b, n.name, 0, idle=n.spare)
    return b


def lose(b, node, at, alive):
    """`node` silent since its last beat, lost at `at`; the nodes `alive` beat up to then."""
    for n in alive:
        beat(b, n, at, idle=n in b.restart.layout.spares and n not in b.stand_in)
    return b.check_peers(at, 1000 + at)


def test_a_spare_waits_idle_and_counts_for_nothing_until_a_node_leaves():
    b = board(cluster())
    assert b.status["status"] == "running" and "out" not in b.status and "stand_in" not in b.status
    assert b.trainers == 3 and b.trainers_live == 3  # the spare's trainer, never started, is not the job's
    for n in ("n1", "n2", "n3"):  # every trainer of the world exits 0: the job is finished, spare or none
        b.beat({"node": n, "procs": {f"t-{n}": {"role": "trainer", "state": "exited", "exit_code": 0}}}, 1, 1001)
    assert b.status["status"] == "finished"
    # a spare lost while idle is its peer_lost only: no node_left, the job goes on as it is
    b = board(cluster())
    events = lose(b, "n4", 6.0, ("n1", "n2", "n3"))
    assert [e.kind for e in events] == ["peer_lost"] and b.status["status"] == "running"


def test_a_spare_takes_a_lost_nodes_slot_with_the_same_world_size_and_ranks():
    b = board(cluster())
    events = lose(b, "n2", 6.0, ("n1", "n3", "n4"))
    st = b.status
    assert st["status"] == "restarting" and st["generation"] == 1 and st["out"] == ["n2"]
    assert st["stand_in"] == {"n4": "n2"} and st["world_size"] == 3
    kinds = [e.kind for e in events]
    assert kinds == ["peer_lost", "node_left", "stand_in"], kinds
    (left,) = [e for e in events if e.kind == "node_left"]
    assert "generation 1 runs on 3 of 3 nodes without n2, n4 (spare) in n2's place (WORLD_SIZE 3)" in left.reason
    (took,) = [e for e in events if e.kind == "stand_in"]
    assert took.node == "n4" and took.reason == "n4 (spare) takes n2's place in generation 1 (WORLD_SIZE 3)"
    assert took.fields == {"generation": 1, "world_size": 3, "slot": "n2"}
    # the generation waits for the spare's part too
    start = b.restart_start
    for n in ("n1", "n3"):
        beat(b, n, start + 1, generation=1)
    assert b.status["status"] == "restarting"
    beat(b, "n4", start + 1, generation=1)
    assert b.status["status"] == "running" and b.status["stand_in"] == {"n4": "n2"} and b.trainers == 3
    # each process's world: n4 in n2's slot (rank 1), n1 and n3 keep theirs
    plan = make_plan(cluster(), "J")
    ranks = {n: renumbered(plan.job_json(n), plan.job_json(n)["processes"][0], {"n2"}, 1, {"n4": "n2"})
             for n in ("n1", "n3", "n4")}
    assert {n: (e["RANK"], e["WORLD_SIZE"], e["NODE_RANK"]) for n, e in ranks.items()} == {
        "n1": ("0", "3", "0"), "n3": ("2", "3", "2"), "n4": ("1", "3", "1")}
    assert ranks["n4"]["FABTRAIN_RANK"] == "1" and ranks["n3"]["FABTRAIN_RANK"] == "2"  # the slot it holds
    assert ranks["n4"]["MASTER_PORT"] == "29501" and ranks["n4"]["MASTER_ADDR"] == "10.0.0.1"
    endpoints = ranks["n1"]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert endpoints[1] == plan.job_json("n4")["processes"][0]["env"]["PADDLE_CURRENT_ENDPOINT"] and len(endpoints) == 3
    assert ranks["n3"]["PADDLE_TRAINER_ENDPOINTS"] == ranks["n4"]["PADDLE_TRAINER_ENDPOINTS"]


def test_a_torchrun_spare_takes_the_slots_node_rank_and_a_per_node_two_spare_its_ranks():
    run = "torchrun --max-restarts=0 train.py"
    plan = make_plan(cluster(job_trainer={"per_node": 2, "command": run}), "J")
    j4 = plan.job_json("n4")
    (spec,) = j4["processes"]
    assert spec["name"] == "trainer-3" and spec["env"]["PET_NNODES"] == "3" and j4["trainers"] == 3
    env = renumbered(j4, spec, {"n1", "n2"}, 1, {"n4": "n2"})  # the master's node gone too: n4 is node 0 of 2
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_MASTER_ADDR"], env["FABTRAIN_RANK"]) == (
        "2", "0", "10.0.0.4", "1")
    assert renumbered(j4, spec, {"n2"}, 1)["PET_NODE_RANK"] == spec["env"]["PET_NODE_RANK"]  # idle: unchanged
    plan = make_plan(cluster(job_trainer={"per_node": 2}), "J")
    j4 = plan.job_json("n4")
    assert [p["name"] for p in j4["processes"]] == ["trainer-6", "trainer-7"]
    envs = [renumbered(j4, p, {"n3"}, 1, {"n4": "n3"}) for p in j4["processes"]]
    assert [(e["RANK"], e["LOCAL_RANK"], e["FABTRAIN_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("4", "0", "4", "6"), ("5", "1", "5", "6")]

def test_with_no_spare_ready_the_world_goes_on_smaller_as_before():
    b = board(cluster())
    beat(b, "n4", 1)  # the spare runs something (not the job's): not ready
    lose(b, "n2", 6.0, ("n1", "n3"))
    beat(b, "n4", 6.0)
    assert b.status["out"] == ["n2"] and "stand_in" not in b.status and b.status["world_size"] == 2


def test_two_losses_and_one_spare_the_first_slot_is_held_the_second_goes_smaller():
    b = board(cluster(min_nodes=1))
    lose(b, "n2", 6.0, ("n1", "n3", "n4"))
    start = b.restart_start
    for n in ("n1", "n3", "n4"):
        beat(b, n, start + 1, generation=1)
    assert b.status["status"] == "running"
    t = start + 20
    events = lose(b, "n3", t, ("n1", "n4"))
    assert b.status["out"] == ["n2", "n3"] and b.status["stand_in"] == {"n4": "n2"} and b.status["world_size"] == 2
    assert "stand_in" not in [e.kind for e in events]
    # the stand-in itself lost: its slot is empty again, no spare left; n1 alone (min_nodes 1)
    start = b.restart_start
    for n in ("n1", "n4"):
        beat(b, n, start + 1, generation=2)
    lose(b, "n4", start + 20, ("n1",))
    assert b.status["out"] == ["n2", "n3", "n4"] and "stand_in" not in b.status and b.status["world_size"] == 1
    # back with nothing running, the spare is a ready spare again (not `back`: no generation spent on it)
    g = b.status["generation"]
    b.beat({"node": "n4", "procs": {"t-n4": {"role": "trainer", "state": "exited", "exit_code": -15}}},
           start + 21, 3000)
    assert "n4" not in b.out and "n4" not in b.back and b.status["generation"] == g


def test_a_node_back_while_a_spare_holds_its_slot_stays_out_idle():
    b = board(cluster())
    lose(b, "n2", 6.0, ("n1", "n3", "n4"))
    start = b.restart_start
    for n in ("n1", "n3", "n4"):
        beat(b, n, start + 1, generation=1)
    g = b.status["generation"]
    b.beat({"node": "n2", "procs": {"t-n2": {"role": "trainer", "state": "exited", "exit_code": -15}}},
           start + 2, 3000)
    assert b.status["status"] == "running" and b.status["generation"] == g and b.status["out"] == ["n2"]
    assert b.status["stand_in"] == {"n4": "n2"}


# -- the spare's agent, and fab status --------------------------------------------------------------------

from fabtrain.contract.states import ProcessState  # noqa: E402
from fabtrain.node.agent.policy import Config, Ledger, Peers, Relaunch, on_status  # noqa: E402
from tests.unit.test_policy import notes, run, trainer  # noqa: E402

SPARE = Config(node="n4", job_id="J", interval=1.0, hang_timeout=3.0, startup_timeout=60.0, grace=2.0,
               on_failure="restart", coordinator_node="n1", coordinator="10.0.0.1:7180", elastic=True, spare=True)
CONNECTED = Peers(ever_connected=True, connected=True, lease_age=0.5)


def test_a_spares_agent_starts_nothing_until_the_status_puts_it_in_a_slot():
    # at start: its trainer never started is not a failed start
    never = trainer("trainer-3", state=ProcessState.NOT_STARTED)
    obs = dict(peers=Peers(ever_connected=True, seen=("n4",)), must_join=("n4",), startup_deadline=60.0)
    actions, ledger = run(never, now=60.0, cfg=SPARE, **obs)
    assert not notes(actions, "not_joined") and ledger.failure is None
    actions, ledger = run(never, now=60.0, cfg=replace(SPARE, spare=False), **obs)  # the rule it is spared from
    assert ledger.status.reason == "trainer-3 on n4 never started within startup_timeout (60 s)"
    # a restart that does not take it: it waits, and says it is a spare
    restart = {"op": "status", "job_id": "J", "status": "restarting", "generation": 1, "backoff": 5.0, "ts": 1.0,
               "reason": "trainer-0 on n2 exited 1"}
    actions, ledger = on_status(restart, "J", Ledger(), SPARE, 10.0)
    assert ledger.restart_at is None and "n4 is out of it: it is a spare and starts nothing" in \
        notes(actions, "restarting")[0].reason
    actions, _ = run(now=100.0, ledger=ledger, cfg=SPARE, peers=CONNECTED)
    assert not [a for a in actions if isinstance(a, Relaunch)]
    # the same generation, n2 lost before it started: the spare takes n2's slot in it and starts with the others
    took = dict(restart, out=["n2"], stand_in={"n4": "n2"}, ts=2.0, backoff=3.0)
    actions, ledger = on_status(took, "J", ledger, SPARE, 20.0)
    assert ledger.restart_at == 23.0
    assert notes(actions, "restarting")[0].reason == "n4 (spare) in n2's place in generation 1; it starts in 3 s"
    actions, _ = run(now=23.0, ledger=ledger, cfg=SPARE, peers=CONNECTED)
    assert Relaunch(1) in actions
    # a new generation that takes it: a restart like any other
    actions, ledger = on_status(dict(took, generation=2, ts=3.0), "J", Ledger(generation=1), SPARE, 30.0)
    assert ledger.restart_at == 33.0 and ledger.generation == 2


def test_fab_status_says_a_spare_idle_and_a_spare_in_a_lost_nodes_place():
    from fabtrain.controller.jobstate import NodeObservation, job_verdict
    from fabtrain.controller.verdict_text import sentence

    def node(name, state, agent_job):
        proc = {"name": f"trainer-{name[1:]}", "role": "trainer", "rank": int(name[1:]), "state": state,
                "pid": 10 if state == "running" else None, "records": 5 if state == "running" else 0}
        job = {"status": "running", "on_failure": "restart", "generation": 0, **agent_job}
        return NodeObservation(name, True, "J", processes=(proc,), agent={"job": job}, agent_age=0.1)

    idle = [node("n1", "running", {}), node("n2", "running", {}), node("n4", "not started", {"spare": True})]
    v = job_verdict(idle, "J")
    assert v.state == "running" and v.spares == (("n4", None),), v
    assert sentence(v, 0.0).startswith("job running: 2 of 2 processes") and "; n4 spare (idle)" in sentence(v, 0.0)
    # after a restart that did not take it, the spare's agent still waits it out: the job runs all the same
    waiting = idle[:2] + [node("n4", "not started", {"spare": True, "status": "restarting", "generation": 1})]
    assert job_verdict(waiting, "J").state == "running"
    after = {"generation": 1, "out": ["n2"], "world_size": 2, "stand_in": {"n4": "n2"}}
    took = [node("n1", "running", after), node("n2", "exited", after),
            node("n4", "running", dict(after, spare=True, slot="n2"))]
    text = sentence(job_verdict(took, "J"), 0.0)
    assert "without n2 (left the job: min_nodes)" in text and "; n4 (spare) in n2's place" in text, text


def test_copy_data_gives_a_spare_every_trainers_shards(tmp_path):
    from fabtrain.controller.datacopy import files_per_node
    from fabtrain.data import load_manifest, prepare

    c = cluster()
    prepare(str(tmp_path), c.trainer_count, sample=True)  # prepare.py's own sample data, one shard per trainer
    needed = files_per_node(c, load_manifest(str(tmp_path)))
    assert set(needed) == {"n1", "n2", "n3", "n4"}
    assert "train.txt-00001" in needed["n2"] and "train.txt-00001" not in needed["n1"]
    assert set(needed["n4"]) == set(needed["n1"]) | set(needed["n2"]) | set(needed["n3"])


def test_a_node_that_cannot_start_its_part_gives_its_slot_to_a_spare_and_a_restored_board_keeps_it():
    b = board(cluster())
    beat(b, "n3", 1, failure={"reason": "restart 1 on n3: cannot start", "kind": "start", "generation": 0})
    assert b.status["status"] == "restarting" and b.status["out"] == ["n3"] and b.status["stand_in"] == {"n4": "n3"}
    # the coordinator's agent restarted: its board, restored from what it saved, has the spare in n3's slot
    restored = Board.restore(b.saved(1001), "J", list(NODES), 5.0, 2.0, b.restart)
    assert restored.stand_in == {"n4": "n3"} and restored.status["world_size"] == 3
    assert restored.status["stand_in"] == {"n4": "n3"} and restored.status["out"] == ["n3"]
