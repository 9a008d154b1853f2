"""The world grows back (job.watchdog.min_nodes) on three sshd nodes with their own networks
(tests/support/netns.py): node3 cut off leaves the job, node1 and node2 go on as a world of 2; node3's link
healed, its agent (which fenced itself and waited) is taken into the next generation without a `fab start`,
and the job runs as a world of 3 again, on a rendezvous of its own. The trainers are
tests/programs/allreduce.py on gloo: the world each generation really formed is in its all-reduce's sum.
"""
from __future__ import annotations

import json

import pytest

from fabtrain.node import procfs
from fabtrain.node.coordination import fence
from tests.support.netns import net  # noqa: F401 (the module fixture: three nodes, each its own network)
from tests.support import partition_job
from tests.support.partition_job import GRACE, INTERVAL, MASTER_PORT, NODES, PartitionJob, stopped_at
from tests.support.procscan import wait_for

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

ALLREDUCE = "python tests/programs/allreduce.py --steps 100000 --period 0.2"
BACKOFF = 2.0


def result(job, node, rank):
    try:
        return json.loads((job.ws[node] / f"allreduce-{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def env_of(job, node, name) -> dict:
    pid = job.run_record(node, name)["program_pid"]
    return {k.decode(): v.decode() for k, v in procfs.environ(pid).items()}


def test_a_cut_off_node_healed_is_back_in_the_next_generation_at_full_size(fab, tmp_path, net, monkeypatch):
    monkeypatch.setattr(partition_job, "TRAINER", ALLREDUCE)
    job = PartitionJob(fab, tmp_path, net, on_failure="restart", restart_backoff=BACKOFF, max_restarts=3, min_nodes=2)
    try:
        assert wait_for(lambda: all((result(job, n, i) or {}).get("world") == 3 for i, n in enumerate(NODES)),
                        timeout=60), job.describe()
        for i, n in enumerate(NODES):
            (job.ws[n] / f"allreduce-{i}.json").unlink()
        net.cut("node3", "drop")
        # Generation 1: node1 and node2 as a world of 2 (1 + 2), after node3's fence.
        assert wait_for(lambda: (result(job, "node1", 0) or {}).get("sum") == 3.0,
                        timeout=fence.fence_wait(INTERVAL, GRACE) + 40), job.describe()
        assert wait_for(lambda: stopped_at(job, "node3", "trainer-2"), timeout=10), job.describe()
        for n in ("node1", "node2"):
            (job.ws[n] / f"allreduce-{NODES.index(n)}.json").unlink()
        net.heal("node3")
        # node3's agent beats again with nothing of the job left there: generation 2 takes it back.
        assert wait_for(lambda: job.events("node1", "node_back"), timeout=30), job.describe()
        (back,) = job.events("node1", "node_back")
        assert back["peer"] == "node3" and back["reason"] == "node3 back in generation 2 (WORLD_SIZE 3)", back
        assert wait_for(lambda: all((result(job, n, i) or {}).get("sum") == 6.0 for i, n in enumerate(NODES)),
                        timeout=BACKOFF + 40), job.describe()
        env = env_of(job, "node3", "trainer-2")
        assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["FABTRAIN_RESTART_COUNT"]) == (
            "2", "3", str(MASTER_PORT + 2), "2"), env
        # Never two generations at once: generation 1's trainers ended before any of generation 2 started.
        started = min(job.run_record(n, f"trainer-{i}")["started_at"] for i, n in enumerate(NODES))
        ends = [e["ts"] for n in ("node1", "node2") for e in job.events(n, "killed")]
        assert ends and max(ends) < started, (ends, started)
        (restarted,) = job.events("node3", "restarted")
        assert restarted["generation"] == 2, restarted
        assert not job.events("node3", "fenced") and not job.events("node1", "fenced")
        assert wait_for(lambda: job.health("node1")["job"]["status"] == "running", timeout=10), job.health("node1")
        assert "out" not in job.health("node1")["job"] or not job.health("node1")["job"]["out"]
        status = job.fab("status")
        assert "without node3" not in status.stdout and "node3 back in generation 2 (WORLD_SIZE 3)" in status.stdout, \
            status.stdout
    finally:
        job.end()
