"""A node's GPUs as a count or as physical indices, each local rank's CUDA_VISIBLE_DEVICES, per_node by fit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabtrain.config.cluster import load_cluster, parse_cluster
from fabtrain.errors import UserError
from fabtrain.plan.plan import make_plan
from tests.support import REPO

FAB = str(Path(sys.executable).parent / "fab")


def cluster(trainer, *gpus):
    nodes = [{"name": f"n{i}", "host": f"10.0.0.{i + 1}", "roles": ["trainer"]} | ({} if g is None else {"gpus": g})
             for i, g in enumerate(gpus)]
    return parse_cluster({"cluster": {"name": "t", "workspace": "/ws"}, "nodes": nodes,
                          "job": {"mode": "collective", "trainer": trainer}}, "t.yaml")


def devices(c):
    return [(n.node, p.rank, p.env.get("CUDA_VISIBLE_DEVICES"))
            for n in make_plan(c, "J").nodes for p in n.processes]


def test_listed_gpus_give_each_local_rank_its_own_physical_gpu_and_per_node_defaults_to_what_fits():
    c = cluster({"use_gpu": True}, [2, 3], [5, 1, 7])
    assert c.job.trainer.per_node == 2  # the smaller node fits two ranks of one GPU
    assert devices(c) == [("n0", 0, "2"), ("n0", 1, "3"), ("n1", 2, "5"), ("n1", 3, "1")]


def test_gpus_per_rank_gives_each_rank_a_group():
    c = cluster({"use_gpu": True, "gpus_per_rank": 2}, [4, 5, 6, 7], 4)
    assert c.job.trainer.per_node == 2
    assert devices(c) == [("n0", 0, "4,5"), ("n0", 1, "6,7"), ("n1", 2, "0,1"), ("n1", 3, "2,3")]


def test_an_auto_node_gives_its_ranks_slots_that_the_start_fills_and_cluster_gpus_is_the_default():
    c = cluster({"use_gpu": True, "per_node": 2, "gpus_per_rank": 2}, "auto", None)
    assert devices(c) == [("n0", 0, "auto:0,auto:1"), ("n0", 1, "auto:2,auto:3"), ("n1", 2, None), ("n1", 3, None)]
    every = parse_cluster({"cluster": {"name": "t", "gpus": "auto"}, "nodes": [
        {"name": "a", "host": "local", "roles": ["trainer"]}, {"name": "b", "host": "local", "roles": ["trainer"],
                                                                "gpus": [6]}], "job": {"mode": "collective"}}, "t.yaml")
    assert [(n.gpu_auto, n.gpu_ids) for n in every.nodes] == [(True, None), (False, (6,))]


def test_a_count_keeps_the_older_wrap_around_and_no_gpu_means_no_variable():
    assert devices(cluster({"use_gpu": True, "per_node": 3}, 2)) == [("n0", 0, "0"), ("n0", 1, "1"), ("n0", 2, "0")]
    assert devices(cluster({"use_gpu": False}, [2, 3])) == [("n0", 0, None)]
    unknown = cluster({"use_gpu": True}, None)
    assert unknown.job.trainer.per_node == 1 and devices(unknown) == [("n0", 0, None)]


@pytest.mark.parametrize("trainer, gpus, words", [
    ({"use_gpu": True}, "[]", "nodes[0].gpus: must list at least one GPU index, like [2, 3] (line 5)"),
    ({"use_gpu": True}, "[1, 1]", "nodes[0].gpus: lists GPU 1 twice (line 5)"),
    ({"use_gpu": True}, "[0, x]", "nodes[0].gpus[1]: must be an integer, got a string (line 5)"),
    ({"use_gpu": True}, "[0, 2000]", "nodes[0].gpus[1]: must be between 0 and 1023, got 2000 (line 5)"),
    ({"use_gpu": True}, "two", "nodes[0].gpus: must be a number of GPUs, a list of GPU indices like [2, 3] or auto, got a string (line 5)"),
    ({"use_gpu": True, "per_node": 3}, "[2, 3]",
     "job.trainer.per_node: 3 ranks x 1 GPUs need 3 GPUs, node n0 lists 2 (line 10)"),
    ({"use_gpu": True, "gpus_per_rank": 0}, "2", "job.trainer.gpus_per_rank: must be between 1 and 64, got 0 (line 10)"),
])
def test_a_wrong_gpus_field_is_one_line_with_its_line_and_exit_2(tmp_path, trainer, gpus, words):
    text = ("cluster:\n  name: t\nnodes:\n  - {name: n0, host: 10.0.0.1, roles: [trainer],\n"
            f"     gpus: {gpus}}}\njob:\n  mode: collective\n  trainer:\n"
            + "".join(f"    {k}: {str(v).lower()}\n" for k, v in trainer.items()))
    p = tmp_path / "cluster.yaml"
    p.write_text(text)
    with pytest.raises(UserError) as e:
        load_cluster(str(p))
    assert str(e.value) == f"{p}: {words}"
    r = subprocess.run([FAB, "plan"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "FABTRAIN_CLUSTER": str(p)})
    assert r.returncode == 2 and r.stderr.strip().endswith(words) and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["python train.py", "torchrun --nproc-per-node 2 train.py"])
def test_every_process_given_gpus_counts_them_in_the_pci_order_the_leases_use(command):
    order = lambda c: {p.env.get("CUDA_DEVICE_ORDER") for n in make_plan(c, "J").nodes for p in n.processes}
    assert order(cluster({"use_gpu": True, "command": command}, 2, 2)) == {"PCI_BUS_ID"}
    assert order(cluster({"command": command}, 2, 2)) == {None}  # no GPUs asked for: CUDA's own default
