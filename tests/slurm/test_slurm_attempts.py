"""Slurm's own lifecycle on the real cluster: a requeued job resumes as its next attempt; what happened stays
what happened after `fab kill-all`; kill-all knows this cluster's Slurm jobs by id, not by name."""
from __future__ import annotations

import json
import os

import pytest

from tests.support.procscan import wait_for
from tests.support.slurm_job import SlurmJob


@pytest.fixture(scope="module")
def job(slurm, tmp_path_factory):
    j = SlurmJob(tmp_path_factory.mktemp("project"), slurm)
    j.configure("python resumable.py --period 0.2 --steps 40")
    j.fab("deploy", check=True)
    yield j
    j.fab("kill-all")


@pytest.fixture(autouse=True)
def no_job_left_behind(job, slurm):
    yield
    slurm.run("scancel", "--full", "--quiet", f"--user={os.getuid()}", check=False)
    wait_for(lambda: not slurm.run("squeue", "-h", check=False).stdout.strip(), timeout=20)


def starts(job, i: int) -> list[dict]:
    path = job.jd(i) / "checkpoints" / f"trainer-{i}.starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_scontrol_requeue_mid_job_resumes_from_the_checkpoint_as_attempt_2(job):
    job.configure("python resumable.py --period 0.2 --steps 40", scheduler={"requeue": 2})
    job.submit()
    assert job.running(), job.describe()
    assert wait_for(lambda: all(len((job.jd(i) / "metrics" / f"trainer-{i}.jsonl").read_text().splitlines()) >= 5
                                for i in range(3)), timeout=30), job.describe()
    assert job.slurm.run("scontrol", "requeue", job.slurm_job).returncode == 0
    assert job.wait_state("PENDING", timeout=30) == "PENDING", job.describe()
    # Slurm holds a requeued job back for a while (BeginTime); an admin's StartTime=now lets it run at once.
    job.slurm.run("scontrol", "update", f"jobid={job.slurm_job}", "StartTime=now")
    assert wait_for(lambda: all(len(starts(job, i)) == 2 for i in range(3)), timeout=60), job.describe()
    for i in range(3):
        first, second = starts(job, i)
        assert first == {"restart_count": "0", "from_step": 0}
        assert second["restart_count"] == "1" and second["from_step"] >= 5, second  # from its checkpoint
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED", timeout=60) == "COMPLETED", job.describe()
    status = job.fab("status")
    assert status.returncode == 0 and f"job {job.job_id}: finished" in status.stdout, status.stdout
    assert f"slurm job {job.slurm_job}: COMPLETED, exit code 0:0; attempt 2 of 3: requeued by scontrol requeue" \
        in status.stdout, \
        status.stdout
    # The first attempt's end is kept apart, never read as the second's.
    assert (job.jd(0) / "attempts" / "1" / "events.jsonl").exists()
    assert [e["kind"] for e in job.events(0)][0] == "attempt"


def test_a_requeue_past_scheduler_requeue_fails_the_job_saying_so(job):
    job.configure("python resumable.py --period 0.2", scheduler={"requeue": 1})
    job.submit()
    assert job.running(), job.describe()
    for attempt in (2, 3):
        assert job.slurm.run("scontrol", "requeue", job.slurm_job).returncode == 0
        assert job.wait_state("PENDING", timeout=30) == "PENDING", job.describe()
        job.slurm.run("scontrol", "update", f"jobid={job.slurm_job}", "StartTime=now")
        if attempt == 2:
            assert wait_for(lambda: len(starts(job, 0)) == 2, timeout=60), job.describe()
    assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=60) == "FAILED", job.describe()
    status = job.fab("status")
    assert status.returncode == 1, status.stdout
    assert "Slurm started attempt 3, but scheduler.requeue allows 2 attempts" in status.stdout, status.stdout
    assert len(starts(job, 0)) == 2  # attempt 3 started nothing


def test_kill_all_after_the_end_keeps_what_happened(job):
    job.configure("python resumable.py --period 0.1 --steps 5")
    job.submit()
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED", timeout=60) == "COMPLETED", job.describe()
    before = job.fab("status")
    assert before.returncode == 0 and "finished" in before.stdout, before.stdout
    job.fab("kill-all", check=True)
    after = job.fab("status")
    assert after.returncode == 0 and f"job {job.job_id}: finished" in after.stdout, after.stdout
    assert "kill-all" not in after.stdout, after.stdout

    job.configure("python resumable.py --period 0.1 --steps 5 --no-such-flag")  # exits 2 at once
    job.submit()
    assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=60) == "FAILED", job.describe()
    before = job.fab("status")
    assert before.returncode == 1 and "exited with code 2" in before.stdout, before.stdout
    job.fab("kill-all", check=True)
    after = job.fab("status")
    assert after.returncode == 1 and "exited with code 2" in after.stdout, after.stdout
    assert "kill-all" not in after.stdout, after.stdout


def test_kill_all_cancels_this_clusters_jobs_by_id_never_a_same_named_job_from_elsewhere(job, slurm):
    other = slurm.run("sbatch", "--parsable", "--job-name=fabtrain-slurmtest", "--nodes=1",
                      f"--output={job.root}/other-%j.out", "--wrap=sleep 300").stdout.strip()
    assert wait_for(lambda: "RUNNING" in slurm.run("squeue", "-h", "-j", other, "-o", "%T").stdout, timeout=20)
    job.configure("python resumable.py --period 0.2", nodes=2)
    out = job.fab("start-trainers", check=True)  # the same-named job does not block the start
    job.job_id, job.slurm_job = out.stdout.split("job ")[1].split(":")[0], out.stdout.split("slurm job ")[1].split()[0]
    out = job.fab("kill-all", check=True)
    assert f"slurm job {job.slurm_job}: CANCELLED" in out.stdout and f"slurm job {other}:" not in out.stdout, out.stdout
    assert "RUNNING" in slurm.run("squeue", "-h", "-j", other, "-o", "%T").stdout  # untouched
    out = job.fab("kill-all", check=True)
    assert "no Slurm job of this cluster is queued or running" in out.stdout, out.stdout
