"""A torchrun command under job.watchdog.min_nodes, as data: the plan gives torchrun its world through its own
PET_ variables (not its argv), each generation's renumbered over the nodes left; the flags that would fix the
world at start are refused in one line. No process (tests/sshd/test_elastic_torchrun_ssh.py runs one)."""
from __future__ import annotations

import pytest

from fabtrain.errors import UserError
from fabtrain.node.coordination.elastic import renumbered
from tests.unit.test_elastic import cluster, job_json, policy

RUN = "torchrun --max-restarts=0 train.py --lr 0.1"


def trainer(c, node):
    j = job_json(c, node)
    return j, next(p for p in j["processes"] if p["role"] == "trainer")


def test_the_world_travels_in_torchruns_own_variables_not_its_argv():
    j, spec = trainer(cluster(per_node=4, command=RUN), "n2")
    assert spec["argv"] == ["torchrun", "--nproc-per-node=4", "--max-restarts=0", "train.py", "--lr", "0.1"]
    env = spec["env"]
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"]) == (
        "3", "1", "10.0.0.1", "29500")
    assert j["watchdog"]["ranks_per_trainer"] == 4
    # without min_nodes the flags stay on the argv, as before
    _, plain = trainer(cluster(min_nodes=None, per_node=4, command=RUN), "n2")
    assert plain["argv"][:6] == ["torchrun", "--nnodes=3", "--node-rank=1", "--nproc-per-node=4",
                                 "--master-addr=10.0.0.1", "--master-port=29500"]
    assert "PET_NNODES" not in plain["env"]


def test_each_generation_gets_its_nnodes_node_rank_master_and_port():
    c = cluster(per_node=2, command=RUN)
    j3, spec = trainer(c, "n3")
    env = renumbered(j3, spec, {"n1"}, 2)  # the first node gone: n3 is node 1 of 2, the master moves to n2
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["NODE_RANK"], env["PET_MASTER_ADDR"], env["MASTER_ADDR"],
            env["PET_MASTER_PORT"], env["MASTER_PORT"]) == ("2", "1", "1", "10.0.0.2", "10.0.0.2", "29502", "29502")
    assert (env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]) == ("1", "2")
    assert "RANK" not in env and "WORLD_SIZE" not in env  # torchrun numbers its workers itself
    back = renumbered(j3, spec, (), 3)  # every node back: the start's world, generation 3's port
    assert (back["PET_NNODES"], back["PET_NODE_RANK"], back["PET_MASTER_PORT"]) == ("3", "2", "29503")
    layout = policy(c).layout
    assert layout.world_size({"n1"}) == 4 and layout.world_size(frozenset()) == 6  # ranks, not torchruns


@pytest.mark.parametrize("command, flag", [
    ("torchrun --nnodes=3 train.py", "--nnodes"),
    ("torchrun --node_rank 1 train.py", "--node-rank"),
    ("python -m torch.distributed.run --master-port=1234 train.py", "--master-port"),
    ("torchrun --rdzv-backend=c10d --rdzv-endpoint=h:1 train.py", "--rdzv-backend"),
    ("torchrun --standalone train.py", "--standalone"),
])
def test_a_torchrun_flag_that_fixes_the_world_is_refused_in_one_line(command, flag):
    with pytest.raises(UserError) as e:
        cluster(command=command)
    text = str(e.value)
    assert text.startswith("c.yaml: job.trainer.command: %s is fixed at start" % flag) and "\n" not in text, text
    assert "leave %s out" % flag in text


def test_a_script_argument_of_the_same_name_is_the_scripts_own():
    _, spec = trainer(cluster(command="torchrun train.py --nnodes 3"), "n1")
    assert spec["argv"][-2:] == ["--nnodes", "3"] and spec["env"]["PET_NNODES"] == "3"
