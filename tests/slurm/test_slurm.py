"""fabtrain on a real Slurm cluster (munged, slurmctld, three slurmd on this machine; accounting off).

The same node agent, launcher and verdict as on SSH nodes; Slurm places the
job, fab submits it, reads its state with squeue/scontrol and cancels it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from fabtrain.node import procfs
from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, wait_for
from tests.support.slurm_job import SlurmJob
from tests.support.webhook import Receiver


@pytest.fixture(scope="module")
def job(slurm, tmp_path_factory):
    j = SlurmJob(tmp_path_factory.mktemp("project"), slurm)
    j.configure("python allreduce.py --steps 10")
    j.fab("deploy", check=True)
    yield j
    j.fab("kill-all")


@pytest.fixture(autouse=True)
def no_job_left_behind(job, slurm):
    """A test that fails halfway leaves its Slurm job queued or running, and every later test's start
    would be refused for it: the failure stays the one test's."""
    def left() -> bool:
        return bool(slurm.run("squeue", "--noheader", "--states=PENDING,RUNNING,SUSPENDED",
                              f"--user={os.getuid()}", check=False).stdout.strip())
    yield
    if left():
        job.fab("kill-all")
    if left():  # a job of another cluster file (the tests that make their own)
        slurm.run("scancel", "--full", "--quiet", f"--user={os.getuid()}", check=False)


def test_collective_job_all_reduces_across_three_slurm_nodes(job, tmp_path):
    hook = Receiver()
    job.configure("python allreduce.py --steps 40 --period 0.1", notify={"webhook": hook.url, "on": ["finished"]})
    try:
        out = job.submit()
        assert "RUNNING" in out.stdout or "COMPLETED" in out.stdout, out.stdout
        follow = subprocess.Popen([FAB, "logs", "--follow"], cwd=REPO, env=job.env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        # fab watch follows the job to its end as on SSH nodes (exit 0: finished), with Slurm's state under it.
        watched = job.fab("watch", "--timeout=120", check=True)
        assert f"job {job.job_id}: finished" in watched.stdout, watched.stdout
        assert f"slurm job {job.slurm_job}: RUNNING" in watched.stdout, watched.stdout
        streamed, _ = follow.communicate(timeout=60)  # --follow ends with the job
        assert follow.returncode == 0 and all(f"[node{i} trainer-{i}] rank {i}/3 step 39" in streamed
                                              for i in range(3)), streamed
        assert job.wait_state("COMPLETED", "FAILED", "CANCELLED") == "COMPLETED", job.describe()
        # The alert: one POST for the job (every agent sees it finish; the first node's sends it).
        assert wait_for(lambda: hook.got, timeout=10), "no alert"
        time.sleep(1)
        assert [(b["kind"], b["job_id"]) for _, b in hook.got] == [("finished", job.job_id)], hook.got
    finally:
        hook.close()
    tensorboard = tmp_path / "tb"
    exported = job.fab("export", f"--tensorboard={tensorboard}", check=True).stdout.splitlines()
    assert sorted(exported) == [f"{tensorboard}/{job.job_id}/trainer-{i}: 40 points" for i in range(3)], exported
    assert all(list((tensorboard / job.job_id / f"trainer-{i}").glob("events.out.tfevents.*")) for i in range(3))
    results = [json.loads((job.node_ws(i) / f"allreduce-{i}.json").read_text()) for i in range(3)]
    assert [r["sum"] for r in results] == [6.0, 6.0, 6.0]  # 1 + 2 + 3 on every rank
    assert {r["node"] for r in results} == {"n1", "n2", "n3"}  # one rank on each Slurm node
    assert {r["master"] for r in results} == {"127.0.0.1"}  # the first node's NodeAddr
    status = job.fab("status", check=True).stdout
    assert "finished" in status.lower(), status
    assert f"slurm job {job.slurm_job}: COMPLETED" in status, status
    assert not job.leftovers()


def test_one_rank_killed_tears_down_every_node_and_ends_the_slurm_job(job):
    job.configure("python standin.py --period 0.2")
    job.submit()
    assert job.running(), job.describe()
    victim = job.program(1, "trainer-1")
    everything = [pid for pid, _ in job.leftovers()]
    procfs_before = {pid: procfs.stat(pid).create_time for pid in everything if procfs.stat(pid)}
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    gone = wait_for(lambda: not job.leftovers(), timeout=10, interval=0.05)
    took = time.monotonic() - t0
    assert gone, f"left: {job.leftovers()}"
    assert took < 2.0, f"{took:.2f} s"  # every process on every node
    assert all(not procfs.alive(pid, ct) for pid, ct in procfs_before.items())
    assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=30) == "FAILED", job.describe()
    status = job.fab("status")
    assert status.returncode == 1
    assert "trainer-1" in status.stdout and "SIGKILL" in status.stdout, status.stdout
    assert f"slurm job {job.slurm_job}: FAILED" in status.stdout, status.stdout


def test_kill_all_cancels_the_running_job_and_leaves_nothing(job):
    job.configure("python standin.py --period 0.2")
    job.submit()
    assert job.running(), job.describe()
    out = job.fab("kill-all", check=True)
    assert f"slurm job {job.slurm_job}: CANCELLED" in out.stdout, out.stdout
    assert wait_for(lambda: not job.leftovers(), timeout=5), job.leftovers()
    status = job.fab("status").stdout
    assert "killed" in status.lower(), status
    assert "CANCELLED" in status, status


def test_a_job_asking_for_more_nodes_than_exist_stays_pending_and_kill_all_cancels_it(job):
    job.configure("python allreduce.py", nodes=5)
    out = job.fab("start-trainers", "--no-wait", check=True)
    job.slurm_job = out.stdout.split("slurm job ")[1].split()[0]
    status = job.fab("status").stdout
    assert f"slurm job {job.slurm_job}: PENDING" in status, status
    assert "(PartitionConfig)" in status or "(Resources)" in status, status
    # fab watch waits for a queued job (no node has it yet) instead of saying there is none.
    watched = job.fab("watch", "--timeout=3")
    assert watched.returncode == 124 and f"the job is not on any node yet (slurm job {job.slurm_job}: PENDING" \
        in watched.stdout, watched
    out = job.fab("kill-all", check=True)
    assert f"slurm job {job.slurm_job}: CANCELLED" in out.stdout, out.stdout
    job.configure("python allreduce.py")


def test_a_hung_rank_is_caught_by_the_hang_rule_and_the_slurm_job_fails(job):
    job.configure("python standin.py --period 0.2 --spin trainer-2:5", hang_timeout=3)
    job.submit()
    assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=90) == "FAILED", job.describe()
    assert wait_for(lambda: not job.leftovers(), timeout=5), job.leftovers()
    status = job.fab("status").stdout
    assert "trainer-2 on node2 hung" in status, status
    assert f"slurm job {job.slurm_job}: FAILED" in status, status


def test_on_failure_restart_brings_the_next_generation_up_inside_the_same_allocation(job):
    job.configure("python standin.py --period 0.2", on_failure="restart", restart_backoff=0.5, max_restarts=2)
    job.submit()
    assert job.running(), job.describe()
    first = job.program(0, "trainer-0")
    os.kill(job.program(1, "trainer-1"), signal.SIGKILL)

    def next_generation():
        records = [job.run_record(i, f"trainer-{i}") for i in range(3)]
        return all(r and r.get("program_pid") and procfs.alive(r["program_pid"]) for r in records) and \
            records[0]["program_pid"] != first
    assert wait_for(next_generation, timeout=60), job.describe()
    # An agent says "restarted" once its start of the generation returns, after the launcher's record.
    restarted = lambda: {e["node"] for i in range(3) for e in job.events(i) if e["kind"] == "restarted"}  # noqa: E731
    assert wait_for(lambda: restarted() == {"node0", "node1", "node2"}, timeout=10), (restarted(), job.describe())
    assert job.slurm_state() == "RUNNING"  # the same allocation, not a new job
    status = job.fab("status").stdout
    assert "generation 1" in status, status
    job.fab("kill-all", check=True)
    assert wait_for(lambda: not job.leftovers(), timeout=5), job.leftovers()


def test_the_exported_script_runs_the_whole_job_when_submitted_by_hand(job):
    job.configure("python allreduce.py --steps 3 --period 0.1")
    script = job.root / "by-hand.sh"
    out = job.fab("export", f"--slurm={script}", check=True)
    job_id = out.stdout.split("job ")[1].split(",")[0]
    for i in range(3):
        (job.node_ws(i) / f"allreduce-{i}.json").unlink(missing_ok=True)
    submitted = job.slurm.run("sbatch", "--parsable", str(script))
    job.job_id, job.slurm_job = job_id, submitted.stdout.strip()
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED") == "COMPLETED", job.describe()
    assert [json.loads((job.node_ws(i) / f"allreduce-{i}.json").read_text())["sum"] for i in range(3)] == [6.0] * 3
    status = job.fab("status", check=True).stdout
    assert f"job {job_id}: finished" in status and f"slurm job {job.slurm_job}: COMPLETED" in status, status


def test_a_pserver_job_of_the_reference_workload_trains_in_one_allocation(slurm, tmp_path):
    j = SlurmJob(tmp_path, slurm)
    j.configure("python -m workload.trainer --model word2vec --num_passes 50", mode="pserver",
                pserver="python -m workload.pserver", job={"code": str(REPO), "sgd": "sync",
                                                           "data": {"dir": str(tmp_path / "data"), "input": "sample"}},
                hang_timeout=60)
    j.fab("split-data", "deploy", "copy-data", timeout=300, check=True)
    out = j.fab("start-pserver", "start-trainers", check=True)
    assert "recorded" in out.stdout  # start-pserver records the job; start-trainers submits pservers and trainers
    j.job_id, j.slurm_job = re.search(r"job (\S+): submitted as slurm job (\d+)", out.stdout).groups()
    try:
        def learned():
            recs = [json.loads(line) for line in (j.jd(2) / "metrics" / "trainer-2.jsonl").read_text().splitlines()
                    if line.strip()] if (j.jd(2) / "metrics" / "trainer-2.jsonl").exists() else []
            steps = [r for r in recs if isinstance(r.get("step"), int)]
            return steps if len(steps) >= 2 and steps[-1]["step"] >= 20 else None
        recs = wait_for(learned, timeout=180, interval=0.5)
        assert recs, j.describe()
        assert recs[-1]["loss"] < recs[0]["loss"]  # it learns
        assert (j.jd(0) / "run" / "pserver-0.json").exists()  # the pserver ran on the allocation's first node
        status = j.fab("status", check=True).stdout
        assert "pserver-0" in status and f"slurm job {j.slurm_job}: RUNNING" in status, status
    finally:
        j.fab("kill-all")
    assert wait_for(lambda: not j.leftovers(), timeout=10), j.leftovers()


def test_programs_get_sigterm_before_the_time_limit_and_status_says_so(job):
    # slurmctld checks time limits every 30 s and sends the warning at the first check within term_before + 30 s
    # of the end: with a 60 s limit and term_before 15 that is 15 to 45 s after the start, after the trainers are up.
    job.configure("python standin.py --period 0.2", scheduler={"time": "1", "term_before": 15})
    job.submit()
    assert wait_for(lambda: all((job.jd(i) / "metrics" / f"trainer-{i}.jsonl").exists() for i in range(3)),
                    timeout=15), job.describe()
    assert wait_for(lambda: (job.ws / "slurm" / job.job_id / "time-limit").exists(), timeout=70), job.describe()
    assert wait_for(lambda: not job.leftovers(), timeout=15), job.leftovers()
    # SIGTERM first, so a program can checkpoint (each node's stop, or its agent's teardown when a peer went first).
    assert [(job.jd(i) / "run" / f"trainer-{i}.exit").read_text().strip() for i in range(3)] == ["143"] * 3
    assert wait_for(lambda: any("time limit" in e.get("reason", "") for i in range(3) for e in job.events(i)
                                if e["kind"] == "killed"), timeout=5)
    # The batch shell then lets Slurm end the job at its limit: Slurm's own state says TIMEOUT.
    assert job.wait_state("TIMEOUT", "FAILED", "COMPLETED", "CANCELLED", timeout=90) == "TIMEOUT", job.describe()
    status = job.fab("status").stdout
    assert f"slurm job {job.slurm_job}: TIMEOUT" in status and "15 s before its time limit" in status, status


def test_fab_check_reads_a_token_on_every_node_and_refuses_too_many_nodes(job):
    job.configure("python allreduce.py")
    out = job.fab("check", check=True, timeout=300)  # torch is imported on every node to find its GPUs
    assert "slurm: 3 nodes, partition debug, commands here: ok" in out.stdout, out.stdout
    assert "the workspace is shared: every node read a token written here" in out.stdout, out.stdout
    job.configure("python allreduce.py", nodes=5)
    out = job.fab("check", timeout=300)
    assert out.returncode == 1
    assert "scheduler.nodes is 5 but partition debug has 3 nodes: the job would stay PENDING" in out.stdout, out.stdout
    job.configure("python allreduce.py")


def test_a_second_job_is_refused_while_one_is_queued_and_force_cancels_it(job):
    job.configure("python allreduce.py", nodes=5)  # stays PENDING: the partition has 3 nodes
    out = job.fab("start-trainers", "--no-wait", check=True)
    first = re.search(r"submitted as slurm job (\d+)", out.stdout).group(1)
    job.configure("python allreduce.py --steps 3 --period 0.1")
    out = job.fab("start-trainers", "--no-wait")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"fab start-trainers: slurm job {first} of this cluster is still queued or running; "
        "stop it with `fab kill-all` or pass --force"], out.stderr
    job.submit("--force")
    assert job.slurm_job != first
    job.slurm_job, second = first, job.slurm_job
    assert job.slurm_state() == "CANCELLED"
    job.slurm_job = second
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED") == "COMPLETED", job.describe()


def test_fab_off_the_cluster_drives_slurm_through_the_login_node_over_ssh(slurm, tmp_path):
    from tests.support.sshd import SshdCluster
    login = SshdCluster(tmp_path / "sshd", count=1, first=60)
    try:
        node = login.nodes[0]
        login.stop(node)  # the login node's sessions find this cluster's slurm.conf, as /etc/slurm's on a real one
        node.config.write_text(node.config.read_text() + f"SetEnv SLURM_CONF={slurm.conf}\n")
        login.start(node)
        j = SlurmJob(tmp_path / "project", slurm)
        j.configure("python standin.py --period 0.2", scheduler={"login": node.address})
        doc = yaml.safe_load(j.path.read_text())
        doc["cluster"].update(ssh=login.ssh_settings(), python=sys.executable)
        j.path.write_text(yaml.safe_dump(doc))
        env = {k: v for k, v in j.env().items() if k != "SLURM_CONF"}  # nothing of Slurm on this side
        fab = lambda *a: subprocess.run([FAB, *a], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        out = fab("deploy")
        assert out.returncode == 0, out.stdout + out.stderr
        out = fab("start-trainers")
        assert out.returncode == 0 and "RUNNING" in out.stdout, out.stdout + out.stderr
        j.job_id, j.slurm_job = re.search(r"job (\S+): submitted as slurm job (\d+)", out.stdout).groups()
        assert j.running(), j.describe()
        out = fab("status")
        assert f"slurm job {j.slurm_job}: RUNNING" in out.stdout and "trainer-2" in out.stdout, out.stdout
        out = fab("kill-all")
        assert out.returncode == 0 and f"slurm job {j.slurm_job}: CANCELLED" in out.stdout, out.stdout + out.stderr
        assert wait_for(lambda: not j.leftovers(), timeout=5), j.leftovers()
    finally:
        login.close()


def node_tasks(slurm_job: str, node_id: int) -> list[int]:
    """The Slurm step task of one node (fabtrain.node.allocation) of a job."""
    found = []
    for pid in procfs.scan():
        env = procfs.environ(pid)
        if b"fabtrain.node.allocation" in b" ".join(a.encode() for a in procfs.cmdline(pid)) and \
                env.get(b"SLURM_JOB_ID") == slurm_job.encode() and env.get(b"SLURM_NODEID") == str(node_id).encode():
            found.append(pid)
    return found


def test_a_frozen_node_fails_the_job_naming_it_and_the_slurm_job_ends(job):
    job.configure("python standin.py --period 0.2")
    job.submit()
    assert job.running(), job.describe()
    frozen = node_tasks(job.slurm_job, 2) + [pid for pid, _ in live_marked([job.node_ws(2)])]
    assert len(frozen) >= 4  # its task, the agent, its keeper, the trainer (and launchers)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)  # a machine that stopped answering: nothing of it runs, nothing exits
    try:
        assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=60) == "FAILED", job.describe()
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert wait_for(lambda: not job.leftovers(), timeout=15), job.leftovers()
    status = job.fab("status")
    assert status.returncode == 1 and "node2" in status.stdout and "killed" not in status.stdout.split("\n")[0], \
        status.stdout
    assert "JOB FAILED" in status.stdout and "node2" in status.stdout.split("JOB FAILED")[1].split("\n")[0], status.stdout


def test_a_pserver_job_whose_trainers_finish_ends_completed_though_the_agents_stop_its_pservers(job):
    # Every trainer exits 0; the agents then stop the pservers (SIGTERM, 143). The step tasks exit with the
    # agents' verdict (finished), not the processes' exit codes: Slurm says COMPLETED.
    job.configure("python -c 'import time; time.sleep(2)'", mode="pserver", pserver="python standin.py --period 0.2")
    out = job.fab("start-pserver", "start-trainers", check=True)
    job.job_id, job.slurm_job = re.search(r"job (\S+): submitted as slurm job (\d+)", out.stdout).groups()
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED", timeout=90) == "COMPLETED", job.describe()
    assert (job.jd(0) / "run" / "pserver-0.exit").read_text().strip() == "143"  # stopped by the agents
    status = job.fab("status", check=True).stdout
    assert f"job {job.job_id}: finished" in status and f"slurm job {job.slurm_job}: COMPLETED" in status, status
    job.configure("python allreduce.py")


def test_a_job_cancelled_in_slurm_by_hand_says_so_and_never_reads_as_kill_all(job):
    job.configure("python standin.py --period 0.2")
    job.submit()
    assert job.running(), job.describe()
    job.slurm.run("scancel", job.slurm_job)  # not fab kill-all: no `killed` mark before Slurm's SIGTERM
    assert wait_for(lambda: not job.leftovers(), timeout=30), job.leftovers()
    status = job.fab("status")
    assert status.returncode == 1 and "cancelled in Slurm (scancel)" in status.stdout, status.stdout
    assert "kill-all" not in status.stdout, status.stdout
    assert not [e for i in range(3) for e in job.events(i) if "kill-all" in json.dumps(e)]


def test_a_coordinator_that_cannot_listen_fails_the_job_and_stops_what_started(job):
    # Every node's part starts at once in an allocation: the coordinator's node starts its trainer without
    # waiting for its agent to listen. Another program holds the watchdog port, so the agent cannot: that
    # node's start fails as a failed start, what it had started is stopped, and the step fails the job.
    job.configure("python standin.py --period 0.2")
    port = yaml.safe_load(job.path.read_text())["job"]["watchdog"]["port"]
    squatter = socket.create_server(("127.0.0.1", port))
    try:
        job.submit("--no-wait")
        assert job.wait_state("FAILED", "COMPLETED", "CANCELLED", timeout=60) == "FAILED", job.describe()
        assert wait_for(lambda: not job.leftovers(), timeout=10), job.leftovers()
    finally:
        squatter.close()
    # The trainer of node0 did start (not after its coordinator) and was stopped by the failed start.
    assert (job.jd(0) / "run" / "trainer-0.json").exists()
    failed = [e for e in job.events(0) if e["kind"] == "start_failed"]
    assert failed and f"cannot listen on 127.0.0.1:{port}" in failed[0]["reason"], job.events(0)
    said = job.slurm_output()
    assert f"cannot listen on 127.0.0.1:{port}" in said and "what had started of job" in said, said
    status = job.fab("status")
    assert status.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in status.stdout, status.stdout
    assert "Traceback" not in status.stdout + status.stderr + said
    # The port free again, the next job of the same cluster file starts and runs, its coordinator on it.
    job.submit()
    assert job.running(), job.describe()
    assert wait_for(lambda: any(e["kind"] == "agent_started" for e in job.events(0)), timeout=30), job.events(0)
    job.fab("kill-all", check=True)
    assert wait_for(lambda: not job.leftovers(), timeout=10), job.leftovers()
    job.configure("python allreduce.py")
