"""Slow is not gone, on three real sshd nodes: a job whose processes keep every core busy runs on,
and an agent or a coordinator that is really gone (SIGKILL, its keeper too) is noticed as soon as before."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.procscan import live_marked, stat, wait_for
from tests.support.ssh_job import deployed, pids, ppid

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

# The hold spans three hang_timeouts and a dozen peer timeouts (5 s): a starved agent, coordinator or
# trainer read as hung or lost would show within it (it was 120 s against a hang_timeout of 60).
HOLD, HANG_TIMEOUT = 60.0, 20
BAD = {"job_failed", "peer_lost", "teardown", "hang", "coordinator_refused"}


@pytest.fixture(scope="module")
def job(sshd, tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("liveness"), sshd, "python tests/programs/fakejob.py") as j:
        yield j


@pytest.fixture
def fresh(job):
    yield job
    job.clean()


def busy_children(job) -> int:
    """The stand-in's busy children alive (R: running, or runnable and waiting for a core)."""
    return sum(1 for p in pids() for parent in [ppid(p)] if parent in {job.program(n, x) for n, x in
               (("node1", "pserver-0"), ("node2", "trainer-0"), ("node3", "trainer-1"))} and (stat(p) or "S")[0] == "R")


@pytest.mark.alone
def test_a_job_that_keeps_every_core_busy_runs_a_minute_with_no_failure(fresh):
    job = fresh
    cores = os.cpu_count() or 2
    # Every process of the job (a pserver, two trainers) starts enough busy children to fill the cores.
    job.start(trainer_args=f"--burn *:{cores}", pserver_args=f"--burn *:{cores}", hang_timeout=HANG_TIMEOUT)
    assert busy_children(job) >= cores
    time.sleep(HOLD)
    bad = [e for e in job.events() if e["kind"] in BAD]
    assert not bad, bad
    assert all((job.health(n) or {}).get("job", {}).get("status") == "running" for n in ("node1", "node2", "node3"))
    assert busy_children(job) >= cores  # still burning: the test held the machine busy throughout
    steps = len(job.metrics("node3", "trainer-1"))
    assert wait_for(lambda: len(job.metrics("node3", "trainer-1")) > steps, timeout=10)


def test_a_coordinator_gone_for_good_fails_the_job_within_peer_timeout(fresh):
    job = fresh
    job.start()
    agent = job.agent("node1")
    keeper = next(p for p in pids() if ppid(p) == agent)
    os.kill(keeper, signal.SIGKILL)  # no keeper: nothing restarts the coordinator's agent
    os.kill(agent, signal.SIGKILL)
    t0 = time.time()
    # Its kernel closes every connection at once; reconnects are refused: gone, not slow. The
    # others fail after peer_timeout (5 intervals, at least 5 s), as before.
    assert wait_for(lambda: not live_marked([job.ws["node2"], job.ws["node3"]]), timeout=25), job.describe()
    for node in ("node2", "node3"):
        (failed,) = [e for e in job.events(node) if e["kind"] == "job_failed"]
        assert "unreachable" in failed["reason"] and "open connection" not in failed["reason"], failed
        # peer_timeout, and the agent's next look (one interval): as before the slow/gone rule.
        assert failed["ts"] - t0 < 5 + 1 + 1, (failed["ts"] - t0, failed)
    job.fab("kill-all", "--grace", "1", check=True)
    assert not job.leftovers()
