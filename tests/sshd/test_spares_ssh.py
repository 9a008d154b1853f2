"""A spare node (`spare: true`) on four real sshd nodes: three trainer nodes and a spare under
job.watchdog.min_nodes 2. The spare's agent runs from the start and its trainer does not; when node2's
machine is gone (its sshd, keeper, agent and trainer killed), the next generation runs on node1, node3
and the spare in node2's slot: WORLD_SIZE 3 still, node1 and node3 keep their ranks, the spare's
trainer is rank 1. No `fab` runs while it restarts.

The job is tests/programs/allreduce.py (torch gloo): every rank all-reduces rank+1 and writes the sum and
the world it saw, so the generation with the spare shows 3 ranks (1+2+3=6), not 2.
"""
from __future__ import annotations

import json
import re

import pytest

from fabtrain.node import procfs
from tests.sshd.test_elastic_ssh import ElasticJob
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import SshdCluster, free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(240)]

NODES = ("node1", "node2", "node3", "node4")  # node4: the spare
TRAINERS = ("node1", "node2", "node3")
BACKOFF = 8.0  # as test_elastic_ssh.py: the loss is known before the generation without node2 starts
COMMAND = "python tests/programs/allreduce.py --steps 100000 --period 0.2"


@pytest.fixture(scope="module")
def sshd4(tmp_path_factory):
    """Four real sshd nodes on 127.0.0.20-23 (the session's three are another test's)."""
    cluster = SshdCluster(tmp_path_factory.mktemp("sshd4"), count=4, first=20)
    yield cluster
    cluster.close()


class SpareJob(ElasticJob):
    """ElasticJob's helpers (results, events, run records, a node's loss) over a cluster with a spare."""

    def __init__(self, fab, tmp_path, sshd):  # (not ElasticJob's: that one writes a cluster of three)
        self.fab_, self.sshd = fab, sshd
        self.ws = {n: tmp_path / f"ws-{n}" for n in NODES}
        addresses = [n.address for n in sshd.nodes]
        self.master_port = free_port(addresses)
        job = {"mode": "collective", "master_port": self.master_port, "trainer": {"per_node": 1, "command": COMMAND},
               "watchdog": {"interval": 1, "grace": 2, "hang_timeout": 60, "port": free_port(addresses),
                            "on_failure": "restart", "restart_backoff": BACKOFF, "max_restarts": 3, "min_nodes": 2}}
        self.path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[(n, ["trainer"]) for n in NODES], job=job,
                                  extra_node_fields={"node4": {"spare": True}})
        out = self.fab("deploy", "start-trainers", check=True)
        self.job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)

    def env(self, node, name):
        return {k.decode(): v.decode() for k, v in procfs.environ(self.run(node, name)["program_pid"]).items()}

    def describe(self):
        out = []
        for n in NODES:
            for f in sorted(self.jd(n).glob("logs/*.log")):
                out.append(f"--- {n} {f.name}\n{f.read_text()[-1200:]}")
            out += [json.dumps(e) for kind in ("node_left", "stand_in", "restarting", "job_failed")
                    for e in self.events(n, kind)]
        return "\n".join(out)


@pytest.fixture
def job(fab, tmp_path, sshd4):
    j = SpareJob(fab, tmp_path, sshd4)
    yield j
    for node in sshd4.nodes:
        if node.process is None or node.process.poll() is not None:
            sshd4.start(node)
    j.fab("kill-all", "--grace", "1")


def test_a_spare_takes_a_lost_nodes_slot_and_the_world_keeps_its_size(job):
    assert wait_for(lambda: all((job.result(n, i) or {}).get("world") == 3 for i, n in enumerate(TRAINERS)),
                    timeout=60), job.describe()
    assert job.result("node1", 0)["sum"] == 6.0
    # The spare ran nothing: its agent watches, its trainer (trainer-3, numbered after the world) never started.
    assert job.run("node4", "agent")["program_pid"]
    assert not (job.jd("node4") / "run" / "trainer-3.json").exists() and job.result("node4", 1) is None
    status = job.fab("status")
    assert "node4 spare (idle)" in status.stdout and "3 of 3 processes" in status.stdout, status.stdout
    for i, n in ((0, "node1"), (2, "node3")):
        (job.ws[n] / f"allreduce-{i}.json").unlink()
    old = job.run("node2", "trainer-1")["program_pid"]
    job.lose("node2")

    # The next generation: node1, node3 and node4 in node2's slot, all-reducing 1 + 2 + 3 as a world of 3.
    assert wait_for(lambda: all(job.result(n, r) for n, r in (("node1", 0), ("node4", 1), ("node3", 2))),
                    timeout=3 * BACKOFF + 20), job.describe()
    for n, r in (("node1", 0), ("node4", 1), ("node3", 2)):
        assert [job.result(n, r)[k] for k in ("world", "sum")] == [3, 6.0], job.describe()
    spare, node3 = job.env("node4", "trainer-3"), job.env("node3", "trainer-2")
    g = int(spare["FABTRAIN_RESTART_COUNT"])
    assert g >= 1 and node3["FABTRAIN_RESTART_COUNT"] == str(g)
    assert (spare["RANK"], spare["WORLD_SIZE"], spare["NODE_RANK"], spare["FABTRAIN_RANK"]) == ("1", "3", "1", "1")
    assert (node3["RANK"], node3["WORLD_SIZE"]) == ("2", "3")  # node3 keeps its rank
    assert int(spare["MASTER_PORT"]) == int(node3["MASTER_PORT"]) == job.master_port + g  # the generation's own
    (took,) = job.events("node1", "stand_in")
    assert took["peer"] == "node4" and took["reason"] == \
        f"node4 (spare) takes node2's place in generation {g} (WORLD_SIZE 3)", took
    (left,) = job.events("node1", "node_left")
    assert left["peer"] == "node2" and left["world_size"] == 3, left
    # Nothing of node2's generation is left anywhere: its trainer gone, nothing marked with its workspace.
    assert not procfs.alive(old) and wait_for(lambda: not live_marked([job.ws["node2"]]), timeout=15), \
        live_marked([job.ws["node2"]])
    status = job.fab("status")
    assert "node4 (spare) in node2's place" in status.stdout and "without node2" in status.stdout, status.stdout
