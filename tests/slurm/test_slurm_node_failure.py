"""A Slurm node lost mid-job (its slurmd killed): Slurm ends the job NODE_FAIL, or requeues it where
scheduler.requeue allows; either way fab says which node failed."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.conftest import require
from tests.support.procscan import wait_for
from tests.support.slurm_cluster import SBIN, SlurmCluster, slurm_missing
from tests.support.slurm_job import SlurmJob


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld marks a silent slurmd's node DOWN after 5 s (SlurmdTimeout), not Slurm's default 300."""
    missing = slurm_missing()
    require(not missing, "slurm-wlm and munge", f"apt-get could not install {' '.join(missing)}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), slurmd_timeout=5).start()
    yield cluster
    cluster.stop()


def kill_slurmd(slurm, name: str) -> subprocess.Popen:
    """The machine `name` is gone for Slurm: its slurmd killed (its step daemon lives on here, as the programs
    of a machine cut off from the controller would)."""
    daemon = next(p for p in slurm.procs if p.args[-1] == name and "slurmd" in p.args[0])
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.wait()
    return daemon


def bring_back(slurm, daemon: subprocess.Popen, name: str) -> None:
    """The node's slurmd started again (ReturnToService=2 makes the node usable at once)."""
    slurm.procs[slurm.procs.index(daemon)] = subprocess.Popen(
        [str(SBIN / "slurmd"), "-D", "-N", name], env=slurm.env(), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(lambda: slurm.idle() == 3, timeout=60)


def steps_of(slurm_job: str) -> list[int]:
    """The pids of the step daemons (`slurmstepd: [<job>.<step>]`) of a Slurm job still alive on this machine."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            title = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
        except (OSError, ValueError):
            continue
        if title.startswith(f"slurmstepd: [{slurm_job}."):
            found.append(int(entry))
    return found


def test_a_lost_slurmd_fails_the_job_naming_the_node(slurm, tmp_path):
    job = SlurmJob(tmp_path, slurm)
    job.configure("python resumable.py --period 0.2")
    job.fab("deploy", check=True)
    job.submit()
    assert job.running(), job.describe()
    n3 = kill_slurmd(slurm, "n3")
    try:
        assert job.wait_state("NODE_FAIL", "FAILED", "CANCELLED", "COMPLETED", timeout=90) == "NODE_FAIL", \
            job.describe()
        status = job.fab("status")
        assert f"slurm job {job.slurm_job}: NODE_FAIL" in status.stdout and "(node n3 failed)" in status.stdout, \
            status.stdout
    finally:  # n3 back, so that nothing of the job outlives the test
        bring_back(slurm, n3, "n3")


def test_with_requeue_a_lost_slurmd_requeues_the_job_and_it_resumes_naming_the_node(slurm, tmp_path):
    job = SlurmJob(tmp_path, slurm)
    job.configure("python resumable.py --period 0.2", scheduler={"requeue": 1})
    job.fab("deploy", check=True)
    job.submit()
    assert job.running(), job.describe()
    assert wait_for(lambda: all(len((job.jd(i) / "metrics" / f"trainer-{i}.jsonl").read_text().splitlines()) >= 5
                                for i in range(3)), timeout=30), job.describe()
    assert len(steps_of(job.slurm_job)) >= 3  # the step, one a node, and the batch step (all on this machine)
    n3 = kill_slurmd(slurm, "n3")
    try:
        # Slurm requeues a requeueable job whose node failed; it waits for three nodes again.
        assert job.wait_state("PENDING", "NODE_FAIL", "FAILED", "CANCELLED", timeout=90) == "PENDING", job.describe()
        # The first attempt's programs on n3 (a machine the controller lost, still running here) stop on their
        # own: their coordinator on n1 went with the allocation, and the agent fences itself.
        assert wait_for(lambda: (job.jd(2) / "run" / "trainer-2.exit").exists()
                        or (job.jd(2) / "attempts" / "1" / "run" / "trainer-2.exit").exists(), timeout=60), \
            job.describe()
    finally:
        bring_back(slurm, n3, "n3")
    # n3's slurmd, back, ends the first attempt's step daemon there; a second attempt launched on n3 before
    # then would be ended with it (same Slurm job id), as an admin who lifts the hold at once would see.
    assert wait_for(lambda: not steps_of(job.slurm_job), timeout=60), steps_of(job.slurm_job)
    job.requeued_and_back(timeout=30)
    assert wait_for(lambda: all(len(job.starts(i)) == 2 for i in range(3)), timeout=60), job.describe()
    for i in range(3):
        assert job.starts(i)[1]["restart_count"] == "1" and job.starts(i)[1]["from_step"] >= 5, job.starts(i)
    status = job.fab("status")
    assert job.slurm_state() == "RUNNING", job.describe()
    assert "attempt 2 of 2: requeued after node n3 failed (NODE_FAIL)" in status.stdout, status.stdout
    job.fab("kill-all", check=True)
    assert job.wait_state("CANCELLED", "COMPLETED", "FAILED", timeout=30) == "CANCELLED", job.describe()
    assert wait_for(lambda: not job.leftovers(), timeout=20), job.leftovers()
