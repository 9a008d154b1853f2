"""Spare nodes (`spare: true`, under job.watchdog.min_nodes) as data: the config's refusals, the plan (a spare
is not in the world at start), the board (a spare takes a lost node's slot, same WORLD_SIZE), and the
renumbered world its process gets. No process."""
from __future__ import annotations

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.errors import UserError
from fabtrain.plan.plan import make_plan

NODES = ("n1", "n2", "n3", "n4")


def doc(spares=("n4",), roles=None, min_nodes=2, mode="collective", **job):
    roles = roles or {}
    watchdog = {"on_failure": "restart", **({"min_nodes": min_nodes} if min_nodes else {})}
    return {"cluster": {"name": "c"},
            "nodes": [{"name": n, "host": f"10.0.0.{i + 1}", "roles": roles.get(n, ["trainer"]),
                       **({"spare": True} if n in spares else {})} for i, n in enumerate(NODES)],
            "job": {"mode": mode, "master_port": 29500, "trainer": {"per_node": 1}, "watchdog": watchdog, **job}}


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
