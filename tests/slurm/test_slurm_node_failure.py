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


def test_a_lost_slurmd_fails_the_job_naming_the_node(slurm, tmp_path):
    job = SlurmJob(tmp_path, slurm)
    job.configure("python resumable.py --period 0.2")
    job.fab("deploy", check=True)
    job.submit()
    assert job.running(), job.describe()
    n3 = next(p for p in slurm.procs if p.args[-1] == "n3" and "slurmd" in p.args[0])
    os.kill(n3.pid, signal.SIGKILL)  # the machine n3 is gone for Slurm (its step daemon lives on here)
    n3.wait()
    try:
        assert job.wait_state("NODE_FAIL", "FAILED", "CANCELLED", "COMPLETED", timeout=90) == "NODE_FAIL", \
            job.describe()
        status = job.fab("status")
        assert f"slurm job {job.slurm_job}: NODE_FAIL" in status.stdout and "(node n3 failed)" in status.stdout, \
            status.stdout
    finally:  # n3 back (ReturnToService=2), so that nothing of the job outlives the test
        slurm.procs[slurm.procs.index(n3)] = subprocess.Popen(
            [str(SBIN / "slurmd"), "-D", "-N", "n3"], env=slurm.env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: slurm.idle() == 3, timeout=60)
