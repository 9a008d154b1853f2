"""job.watchdog.min_nodes with a torchrun command on three real sshd nodes: torchrun gets each generation's
--nnodes, --node-rank, --master-addr and --master-port (its own PET_ variables, renumbered by fabtrain), so
an unchanged torch.distributed script run by torchrun goes on as the smaller world when a node is lost.

The script is tests/programs/allreduce.py, unchanged: every rank all-reduces rank+1 once and writes the sum
and the world it saw (torchrun gives it RANK and WORLD_SIZE), so the smaller generation shows 2 ranks (1+2=3).
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from fabtrain.node import procfs
from tests.sshd.test_elastic_ssh import BACKOFF, NODES, ElasticJob, elastic_job
from tests.support.procscan import live_marked, wait_for

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(240)]

TORCHRUN = "torchrun --max-restarts=0 tests/programs/allreduce.py --steps 100000 --period 0.2"


def env_of(pid: int) -> dict:
    return {k.decode(): v.decode() for k, v in procfs.environ(pid).items()}


def lose_all(job: ElasticJob, node: str) -> float:
    """The node's machine gone: its sshd and every process of the job there (torchrun's workers too) killed."""
    keeper = json.loads((job.jd(node) / "health.json").read_text())["agent"].get("keeper_pid")
    job.sshd.stop(next(n for n in job.sshd.nodes if n.name == node))
    t0 = time.time()
    for pid in [keeper] + [pid for pid, _ in live_marked([job.ws[node]])]:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return t0


@pytest.fixture
def job(fab, tmp_path, sshd):
    yield from elastic_job(fab, tmp_path, sshd, TORCHRUN)


def test_a_torchrun_job_goes_on_as_the_smaller_world_with_each_generations_nnodes_and_node_rank(job):
    assert wait_for(lambda: all((job.result(n, i) or {}).get("world") == 3 for i, n in enumerate(NODES)), timeout=90), \
        job.describe()
    assert job.result("node1", 0)["sum"] == 6.0
    start_port = int(env_of(job.run("node2", "trainer-1")["program_pid"])["PET_MASTER_PORT"])
    for n in ("node1", "node2"):
        (job.ws[n] / f"allreduce-{NODES.index(n)}.json").unlink()
    t0 = lose_all(job, "node3")
    # Generation 1: torchrun on node1 and node2 with --nnodes 2; their workers are ranks 0 and 1 of 2.
    assert wait_for(lambda: job.result("node1", 0) and job.result("node2", 1), timeout=BACKOFF + 20), job.describe()
    took = time.time() - t0
    assert [job.result("node1", 0)[k] for k in ("world", "sum")] == [2, 3.0], job.describe()
    assert [job.result("node2", 1)[k] for k in ("world", "sum")] == [2, 3.0]
    assert took <= BACKOFF + 20, f"the smaller torchrun world trained {took:.1f} s after the loss"
    run = job.run("node2", "trainer-1")
    launcher = env_of(run["program_pid"])
    assert (launcher["PET_NNODES"], launcher["PET_NODE_RANK"], launcher["PET_MASTER_PORT"],
            launcher["FABTRAIN_RESTART_COUNT"]) == ("2", "1", str(start_port + 1), "1"), launcher
    assert "torchrun" in " ".join(procfs.cmdline(run["program_pid"])) and \
        "--nnodes" not in " ".join(procfs.cmdline(run["program_pid"]))
    (left,) = job.events("node1", "node_left")
    assert left["peer"] == "node3" and left["world_size"] == 2, left
    status = job.fab("status")
    assert "without node3 (left the job: min_nodes), WORLD_SIZE 2" in status.stdout, status.stdout
