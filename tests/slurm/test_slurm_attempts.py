"""Slurm's own lifecycle on the real cluster: a requeued job resumes as its next attempt; what happened stays
what happened after `fab kill-all`; kill-all knows this cluster's Slurm jobs by id, not by name."""
from __future__ import annotations

import json
import os
import re
import socket

import pytest

from fabtrain.contract.events import OUTCOMES, EventKind
from fabtrain.contract.jobfolder import JobFolder
from tests.conftest import require
from tests.support.procscan import wait_for
from tests.support.slurm_cluster import SlurmCluster, slurm_missing
from tests.support.slurm_job import SlurmJob


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The tests' Slurm cluster with a second partition, "high", whose jobs preempt (requeue) those of "debug"."""
    missing = slurm_missing()
    require(not missing, "slurm-wlm and munge", f"apt-get could not install {' '.join(missing)}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), preemption=True).start()
    yield cluster
    cluster.stop()


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


def test_scontrol_requeue_mid_job_resumes_from_the_checkpoint_as_attempt_2(job):
    job.configure("python resumable.py --period 0.2 --steps 40", scheduler={"requeue": 2})
    job.submit()
    assert job.running(), job.describe()
    assert wait_for(lambda: all(len((job.jd(i) / "metrics" / f"trainer-{i}.jsonl").read_text().splitlines()) >= 5
                                for i in range(3)), timeout=30), job.describe()
    assert job.slurm.run("scontrol", "requeue", job.slurm_job).returncode == 0
    job.requeued_and_back()
    assert wait_for(lambda: all(len(job.starts(i)) == 2 for i in range(3)), timeout=60), job.describe()
    for i in range(3):
        first, second = job.starts(i)
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


def test_a_job_preempted_by_a_higher_partition_is_requeued_and_resumes(job, slurm):
    job.configure("python resumable.py --period 0.2 --steps 30", scheduler={"requeue": 1})
    job.submit()
    assert job.running(), job.describe()
    assert wait_for(lambda: len((job.jd(0) / "metrics" / "trainer-0.jsonl").read_text().splitlines()) >= 3,
                    timeout=30), job.describe()
    high = slurm.run("sbatch", "--parsable", "--partition=high", "--nodes=1", f"--output={job.root}/high-%j.out",
                     "--wrap=sleep 1").stdout.strip()
    job.requeued_and_back()
    assert wait_for(lambda: all(len(job.starts(i)) == 2 for i in range(3)), timeout=60), job.describe()
    assert [s["restart_count"] for s in job.starts(1)] == ["0", "1"] and job.starts(1)[1]["from_step"] >= 3
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED", timeout=60) == "COMPLETED", job.describe()
    status = job.fab("status")
    assert status.returncode == 0 and f"job {job.job_id}: finished" in status.stdout, status.stdout
    assert "attempt 2 of 2: requeued after preemption (preempted by Slurm)" in status.stdout, status.stdout
    # The preemptor: a job id of its own, numbered after ours (sbatch --parsable prints the id alone), that ran in
    # partition "high" to its end while ours waited (slurmctld keeps an ended job MinJobAge=300 s).
    assert re.fullmatch(r"\d+", high) and int(high) > int(job.slurm_job), (high, job.slurm_job)
    preemptor = slurm.run("scontrol", "show", "job", "-o", high, check=False).stdout
    assert re.search(r"\bPartition=high\b", preemptor) and re.search(r"\bJobState=COMPLETED\b", preemptor), preemptor
    assert (job.root / f"high-{high}.out").exists()


def test_with_continue_after_time_limit_the_job_goes_on_as_its_next_attempt(job):
    # As in test_slurm.py's time-limit test: the warning comes 15 to 45 s after the start of a 1-minute job.
    job.configure("python resumable.py --period 0.2", scheduler={"time": "1", "term_before": 15, "requeue": 1,
                                                                 "continue_after_time_limit": True})
    job.submit()
    assert job.running(), job.describe()
    job.requeued_and_back(timeout=80)  # at the warning the batch shell requeued it: no idle wait for TIMEOUT
    assert wait_for(lambda: all(len(job.starts(i)) == 2 for i in range(3)), timeout=60), job.describe()
    assert job.starts(0)[1]["restart_count"] == "1" and job.starts(0)[1]["from_step"] > 0
    assert [(job.jd(0) / "attempts" / "1" / "run" / f"trainer-0.exit").read_text().strip()] == ["143"]  # SIGTERM
    status = job.fab("status")
    assert "attempt 2 of 2: requeued at the time limit" in status.stdout, status.stdout
    assert job.slurm_state() == "RUNNING"
    job.fab("kill-all", check=True)


def test_a_requeue_past_scheduler_requeue_fails_the_job_saying_so(job):
    job.configure("python resumable.py --period 0.2", scheduler={"requeue": 1})
    job.submit()
    assert job.running(), job.describe()
    for attempt in (2, 3):
        assert job.slurm.run("scontrol", "requeue", job.slurm_job).returncode == 0
        job.requeued_and_back()
        if attempt == 2:
            assert wait_for(lambda: len(job.starts(0)) == 2, timeout=60), job.describe()
    assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=60) == "FAILED", job.describe()
    status = job.fab("status")
    assert status.returncode == 1, status.stdout
    assert "Slurm started attempt 3, but scheduler.requeue allows 2 attempts" in status.stdout, status.stdout
    assert len(job.starts(0)) == 2  # attempt 3 started nothing


def record_on_disk(job) -> dict:
    """What each node's job folder holds of how the job ended (read through fabtrain.contract's JobFolder): every
    event, the `killed` marker, health.json's job status and each process's exit record."""
    out = {}
    for i in range(job.nodes):
        folder = JobFolder(str(job.jd(i)))
        health = json.loads(open(folder.health).read())
        exits = {name[:-len(".exit")]: open(os.path.join(folder.run, name)).read().strip()
                 for name in sorted(os.listdir(folder.run)) if name.endswith(".exit")}
        out[f"node{i}"] = {"events": folder.read_events(), "killed": os.path.exists(folder.killed),
                           "job": health.get("job"), "exits": exits}
    return out


def outcomes(record: dict) -> dict:
    """Each node's outcome events (finished, job_failed, kept), by kind."""
    return {node: [e["kind"] for e in r["events"] if e.get("kind") in OUTCOMES] for node, r in record.items()}


def test_kill_all_after_the_end_keeps_what_happened(job):
    job.configure("python resumable.py --period 0.1 --steps 5")
    job.submit()
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED", timeout=60) == "COMPLETED", job.describe()
    before = job.fab("status")
    assert before.returncode == 0 and "finished" in before.stdout, before.stdout
    on_disk = record_on_disk(job)
    # A node recorded the job finished (the one whose agent saw the job's last status: in a Slurm step, where every
    # node's agent leaves as its task ends, that may be any of them); no node recorded another outcome.
    said = outcomes(on_disk)
    assert [EventKind.FINISHED] in said.values() and all(k in ([], [EventKind.FINISHED]) for k in said.values()), said
    assert not any(r["killed"] for r in on_disk.values()), on_disk
    assert [on_disk[f"node{i}"]["exits"].get(f"trainer-{i}") for i in range(job.nodes)] == ["0"] * job.nodes, on_disk
    job.fab("kill-all", check=True)
    after = job.fab("status")
    assert after.returncode == 0 and f"job {job.job_id}: finished" in after.stdout, after.stdout
    assert "kill-all" not in after.stdout, after.stdout
    # The record itself, not only its reading: no event added, no `killed` marker, health and exit codes as they were.
    assert record_on_disk(job) == on_disk

    job.configure("python resumable.py --period 0.1 --steps 5 --no-such-flag")  # exits 2 at once
    job.submit("--no-wait")  # (the job can end between two of the start's looks: it says so, and exits 1)
    assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=60) == "FAILED", job.describe()
    before = job.fab("status")
    assert before.returncode == 1 and "exited with code 2" in before.stdout, before.stdout
    on_disk = record_on_disk(job)
    said = outcomes(on_disk)
    assert any(EventKind.JOB_FAILED in k for k in said.values()) and not any(EventKind.FINISHED in k for k in
                                                                            said.values()), said
    assert not any(r["killed"] for r in on_disk.values()), on_disk
    # Every trainer's exit recorded; the ones the teardown did not reach first, 2.
    codes = [on_disk[f"node{i}"]["exits"].get(f"trainer-{i}") for i in range(job.nodes)]
    assert None not in codes and "2" in codes, on_disk
    job.fab("kill-all", check=True)
    after = job.fab("status")
    assert after.returncode == 1 and "exited with code 2" in after.stdout, after.stdout
    assert "kill-all" not in after.stdout, after.stdout
    assert record_on_disk(job) == on_disk


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


def drawn_ports(job) -> dict:
    return json.loads((job.ws / "slurm" / job.job_id / "ports.json").read_text())["ports"]


def test_auto_ports_are_drawn_in_each_attempts_allocation_among_the_ports_free_there(job):
    job.configure("python resumable.py --period 0.2 --steps 40", scheduler={"requeue": 1},
                  job={"master_port": "auto"}, port="auto")
    job.submit()
    assert job.running(), job.describe()
    first = drawn_ports(job)
    assert set(first) == {"master_port", "watchdog_port"}
    for i in range(3):  # every node filled the same ports in: the agents found their coordinator on it
        on_node = json.loads((job.jd(i) / "job.json").read_text())
        assert on_node["watchdog"]["coordinator"]["port"] == first["watchdog_port"]
        assert on_node["processes"][0]["env"]["MASTER_PORT"] == str(first["master_port"])
    status = job.fab("status").stdout
    assert f"master_port {first['master_port']} (auto, drawn in the allocation)" in status, status
    # The next attempt draws again, in its own allocation: its ports of the first attempt are now held by
    # another program there (here, this test), and the job must come up on others.
    assert job.slurm.run("scontrol", "requeue", job.slurm_job).returncode == 0
    assert job.wait_state("PENDING", timeout=30) == "PENDING", job.describe()
    held = []
    try:
        for port in first.values():
            def bound():
                try:
                    held.append(socket.create_server(("127.0.0.1", port)))
                    return True
                except OSError:  # the first attempt's coordinator is still going
                    return False
            assert wait_for(bound, timeout=30), f"port {port} was not let go by the first attempt"
        job.requeued_and_back()
        assert wait_for(lambda: len(job.starts(0)) == 2, timeout=60), job.describe()
        second = drawn_ports(job)
        # Every node reported the ports this test holds as busy (the stand-in nodes share 127.0.0.1), and the
        # draw kept off them (tests/unit/test_allocports.py: the draw never takes a port reported busy).
        reports = [json.loads((job.ws / "slurm" / job.job_id / f"busy-{k}.json").read_text()) for k in range(3)]
        assert sorted(r["node"] for r in reports) == [0, 1, 2], reports
        assert all(set(first.values()) <= set(r["busy"]) for r in reports), (first, reports)
        assert not set(second.values()) & set(first.values()), (first, second)
        assert job.running(), job.describe()
        assert json.loads((job.jd(1) / "job.json").read_text())["watchdog"]["coordinator"]["port"] == \
            second["watchdog_port"]
        assert job.wait_state("COMPLETED", "FAILED", "CANCELLED", timeout=60) == "COMPLETED", job.describe()
    finally:
        for s in held:
            s.close()
    assert job.slurm_output().count("fabtrain: auto ports drawn in the allocation:") == 2, job.slurm_output()
