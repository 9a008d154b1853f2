"""Why a job under job.watchdog.min_nodes cannot go on without its first node, in one line: on the coordinator's
board (Layout.leave) and in the fence of every other node's agent. No process."""
from __future__ import annotations

from fabtrain.node.agent.loop import settings
from fabtrain.node.agent.policy import Peers
from tests.unit.test_elastic import job_json, policy
from tests.unit.test_policy import run, trainer
from fabtrain.config.cluster import parse_cluster


def two(roles=None, mode="collective"):
    roles = roles or {"n1": ["trainer"], "n2": ["trainer"]}
    return parse_cluster({"cluster": {"name": "c"},
                          "nodes": [{"name": n, "host": f"10.0.0.{i + 1}", "roles": r} for i, (n, r) in enumerate(roles.items())],
                          "job": {"mode": mode, "master_port": 29500, "trainer": {"per_node": 1},
                                  "watchdog": {"on_failure": "restart", "min_nodes": 1}}}, "c.yaml")


def test_two_nodes_cannot_go_on_without_the_first_and_the_line_says_no_majority():
    layout = policy(two()).layout
    out, why = layout.leave("n1", frozenset())
    assert out is None and why == ("n1 is the first node: the agents' coordinator lives there, so the job cannot go "
                                   "on without it (1 of 2 nodes is no majority: the other cannot tell n1 gone from "
                                   "itself cut off)")
    ps = policy(two({"n1": ["pserver", "trainer"], "n2": ["trainer"]}, "pserver")).layout
    assert ps.leave("n1", frozenset())[1].endswith(
        "itself cut off); and it runs parameter servers, whose shard of the model lives only there")


def test_the_other_nodes_agent_says_it_in_its_fence():
    j = job_json(two(), "n2")
    cfg, _ = settings(j, [n["name"] for n in j["nodes"]])
    assert cfg.elastic and "1 of 2 nodes is no majority" in cfg.without_coordinator
    cut = Peers(ever_connected=True, connected=False, silent_for=1.0, lease_age=4.0, error="timed out")
    _, ledger = run(trainer(last_record=9.9), peers=cut, cfg=cfg)
    reason = ledger.status.reason
    assert reason.startswith("coordinator 10.0.0.1:") and "this node fences itself" in reason and "\n" not in reason
    assert reason.endswith("(1 of 2 nodes is no majority: the other cannot tell n1 gone from itself cut off)"), reason
