"""Fault injection on three real sshd nodes with a real job and the node agents.

Each test starts a job (pserver on node1 = the coordinator's node, trainers on
node2 and node3) of tests/programs/fakejob.py, breaks something the way it
breaks in real life, and checks that: no process with the job marker is left
on any node, events.jsonl explains what happened, `fab status` shows it, and
(the next test) a new job starts cleanly afterwards.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, stat, wait_for
from tests.support.ssh_job import HANG_TIMEOUT, NODES, assert_failed_status, deployed, pids, ppid

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]

@pytest.fixture(scope="module")
def job(sshd, tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("faults"), sshd, "python tests/programs/fakejob.py") as j:
        yield j


@pytest.fixture
def fresh(job):
    """Each test leaves the nodes clean; if it fails half-way, clean up for the next one."""
    yield job
    job.clean()


def test_normal_end_stops_pservers_and_agents_and_watch_exits_0(fresh):
    job = fresh
    job.start("--steps 25 --period 0.1", wait=False)  # may be over before every agent met every other
    out = job.fab("watch", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "finished" in out.stdout and "trainer-0" in out.stdout
    job.wait_gone(time.time())
    assert "finished" in job.kinds("node1")
    stopped = [e for e in job.events("node1") if e["kind"] == "killed" and e.get("name") == "pserver-0"]
    assert stopped and "the job finished" in stopped[0]["reason"]
    assert "job_failed" not in job.kinds()
    status = job.fab("status")
    assert status.returncode == 0, status.stdout  # a pserver stopped at the end is not a failure
    assert "job finished" in status.stdout


def test_sigkill_of_a_trainer_tears_down_every_node(fresh):
    job = fresh
    job.start()
    watcher = subprocess.Popen([FAB, "watch", "--timeout", "60"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "FABTRAIN_CLUSTER": str(job.path), "FABTRAIN_STATE_DIR": str(job.state)})
    time.sleep(1.5)
    t0 = time.time()
    os.kill(job.program("node3", "trainer-1"), signal.SIGKILL)
    took = job.wait_gone(t0)
    assert took < 5.0, f"teardown took {took:.2f} s"  # the target is 2 s (bench/teardown.py measures it)
    ev = job.events()
    failed = [e for e in ev if e["kind"] == "job_failed"]
    assert failed and all("trainer-1 on node3 killed by SIGKILL" in e["reason"] for e in failed)
    assert {e["node"] for e in failed} == set(NODES)  # every agent heard of it and says why
    assert {(e["node"], e["name"]) for e in ev if e["kind"] == "killed"} >= {("node1", "pserver-0"), ("node2", "trainer-0")}
    assert {e["node"] for e in ev if e["kind"] == "teardown"} == set(NODES)
    out, _ = watcher.communicate(timeout=30)
    assert watcher.returncode == 1, out
    assert "job_failed" in out and "failed" in out.splitlines()[-1]
    assert_failed_status(job, "trainer-1 on node3 killed by SIGKILL")


def test_sigkill_of_a_pserver_tears_down_every_node(fresh):
    job = fresh
    job.start()  # a new job starts cleanly after the previous test's failure
    t0 = time.time()
    os.kill(job.program("node1", "pserver-0"), signal.SIGKILL)
    assert job.wait_gone(t0) < 5.0
    assert {e["node"] for e in job.events() if e["kind"] == "teardown"} == set(NODES)
    assert_failed_status(job, "pserver-0 on node1 killed by SIGKILL")


def test_sigstop_of_a_trainer_is_a_hang(fresh):
    job = fresh
    job.start()
    t0 = time.time()
    os.kill(job.program("node2", "trainer-0"), signal.SIGSTOP)
    took = job.wait_gone(t0, timeout=HANG_TIMEOUT + 15)
    assert took < HANG_TIMEOUT + 4, f"hang teardown took {took:.2f} s"  # target: hang_timeout + 2 s
    hang = [e for e in job.events("node2") if e["kind"] == "hang"]
    assert hang and hang[0]["name"] == "trainer-0" and "stopped (SIGSTOP)" in hang[0]["reason"]
    assert hang[0]["signal"] == "SIGTERM"
    assert_failed_status(job, "trainer-0 on node2 hung")


def test_a_trainer_that_stops_progressing_is_a_hang(fresh):
    job = fresh
    job.start("--hang trainer-1:8")  # stops writing metrics and sleeps: no output, no CPU
    assert wait_for(lambda: "hang" in job.kinds("node3"), timeout=HANG_TIMEOUT + 15), job.describe()
    job.wait_gone(time.time())
    hang = next(e for e in job.events("node3") if e["kind"] == "hang")
    assert "no progress" in hang["reason"], hang


def test_sigkill_of_the_coordinators_agent_restarts_it_and_the_job_goes_on(fresh):
    job = fresh
    job.start()
    old = job.agent("node1")
    os.kill(old, signal.SIGKILL)
    assert wait_for(lambda: "agent_restarted" in job.kinds("node1"), timeout=10), job.describe()
    restarted = next(e for e in job.events("node1") if e["kind"] == "agent_restarted")
    assert "SIGKILL" in restarted["reason"]
    # The job goes on: nothing failed, the trainers keep training, every agent meets the new coordinator.
    steps = len(job.metrics("node2", "trainer-0"))
    time.sleep(3)
    assert len(job.metrics("node2", "trainer-0")) > steps
    assert "job_failed" not in job.kinds()
    assert job.agent("node1") != old
    status = job.fab("status")
    assert status.returncode == 0, status.stdout
    assert "restarted" in status.stdout, status.stdout
    # ...and the restarted agent (the coordinator) still tears the job down.
    t0 = time.time()
    os.kill(job.program("node3", "trainer-1"), signal.SIGKILL)
    assert job.wait_gone(t0) < 5.0
    assert {e["node"] for e in job.events() if e["kind"] == "teardown"} == set(NODES)


def test_an_agent_gone_for_good_is_a_lost_node(fresh):
    job = fresh
    job.start()
    agent = job.agent("node2")
    keeper = next(p for p in pids() if ppid(p) == agent)
    os.kill(keeper, signal.SIGKILL)
    os.kill(agent, signal.SIGKILL)
    t0 = time.time()
    # The coordinator declares node2 lost after peer_timeout (5 intervals, at least 5 s); node1 and node3 tear down.
    assert wait_for(lambda: not live_marked([job.ws["node1"], job.ws["node3"]]), timeout=20), job.describe()
    assert time.time() - t0 < 5 + 1 + 4
    lost = [e for e in job.events("node1") if e["kind"] == "peer_lost"]
    assert lost and lost[0]["peer"] == "node2"
    assert any("node node2 lost" in e["reason"] for e in job.events("node3") if e["kind"] == "job_failed")
    # Nothing is left to watch node2's trainer: status says so, and kill-all is the last resort.
    assert live_marked([job.ws["node2"]])
    status = assert_failed_status(job, "NO WATCHDOG", "node node2 lost")
    assert "node2" in status
    job.fab("kill-all", "--grace", "1", check=True)
    assert not job.leftovers()


def ignores_sigterm(pid: int) -> bool:
    """SIGTERM is in the process's ignored-signal mask (/proc/<pid>/status SigIgn)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def gone(pid: int) -> bool:
    """No such process, or only its zombie waiting to be reaped (it can run no more)."""
    st = stat(pid)
    return st is None or st[0] in "ZX"


def test_kill_all_escalates_to_sigkill_for_a_process_that_ignores_sigterm(fresh):
    job = fresh
    job.start(pserver_args="--ignore-term pserver-0")
    stubborn = job.program("node1", "pserver-0")
    assert ignores_sigterm(stubborn)
    t0 = time.time()
    job.fab("kill-all", "--grace", "2", check=True)
    took = time.time() - t0
    assert gone(stubborn), f"pid {stubborn} survived kill-all: {stat(stubborn)}"
    assert took >= 2, f"kill-all took {took:.2f} s: it did not wait the grace before SIGKILL"
    assert wait_for(lambda: not job.leftovers(), timeout=10), job.describe()
    by_kill_all = {e["name"] if "name" in e else f"{e['role']}-{e['rank']}": e for e in job.events()
                   if e["kind"] == "killed" and e["reason"].startswith("fab kill-all")}
    assert by_kill_all["pserver-0"]["signal"] == "SIGKILL", by_kill_all
    assert stubborn in by_kill_all["pserver-0"]["pids"]
    # The trainers obey SIGTERM (an agent that saw the job fail may have stopped one before kill-all got there).
    assert all(by_kill_all[n]["signal"] == "SIGTERM" for n in ("trainer-0", "trainer-1") if n in by_kill_all)


def test_kill_all_marks_every_nodes_job_before_it_stops_any_process(fresh):
    """A trainer that dies because another node's process was stopped first is read by its agent as
    stopped by kill-all, not as a failure of its own: every node's `killed` marker is on disk before
    the first process of the job ends (the exit files the launchers write), and no agent wrote a failure."""
    job = fresh
    job.start()
    job.fab("kill-all", "--grace", "2", check=True)
    assert wait_for(lambda: not job.leftovers(), timeout=10), job.describe()
    marked = {n: (job.jd(n) / "killed").stat().st_mtime for n in job.ws}
    ended = {f"{n}/{f.stem}": f.stat().st_mtime for n in job.ws for f in job.jd(n).glob("run/*.exit")}
    assert len(ended) >= 3, ended  # the pserver and every trainer
    assert max(marked.values()) <= min(ended.values()), (marked, ended)
    # An agent that saw a process end before its own was stopped says kill-all stopped it, never that it failed.
    ends = [e["reason"] for e in job.events() if e["kind"] in ("job_failed", "exited")]
    assert all("stopped by fab kill-all" in reason for reason in ends), job.describe()


def test_the_watchdog_escalates_to_sigkill_for_a_process_that_ignores_sigterm(fresh):
    job = fresh
    job.start(pserver_args="--ignore-term pserver-0", grace=2)
    stubborn = job.program("node1", "pserver-0")
    assert ignores_sigterm(stubborn)
    t0 = time.time()
    os.kill(job.program("node3", "trainer-1"), signal.SIGKILL)
    job.wait_gone(t0)
    assert gone(stubborn), f"pid {stubborn} survived the teardown: {stat(stubborn)}"
    events = job.events("node1")
    teardown = next(e for e in events if e["kind"] == "teardown")
    escalated = [e for e in events if e["kind"] == "killed" and e.get("name") == "pserver-0" and "grace" in e["reason"]]
    assert escalated and escalated[0]["signal"] == "SIGKILL", events
    assert escalated[0]["reason"] == "still alive 2 s after SIGTERM (grace); SIGKILL"
    assert escalated[0]["ts"] - teardown["ts"] >= 2 - 0.05            # SIGTERM, the grace, then SIGKILL
    final = [e for e in events if e["kind"] == "killed" and e.get("name") == "pserver-0" and "teardown" in e["reason"]]
    assert final and final[0]["signal"] == "SIGKILL", events
    assert_failed_status(job, "trainer-1 on node3 killed by SIGKILL")


def test_a_child_left_behind_by_a_dead_trainer_is_killed_as_an_orphan(fresh):
    job = fresh
    job.start("--child trainer-1 --crash trainer-1:12:3")
    assert wait_for(lambda: "job_failed" in job.kinds(), timeout=15), job.describe()
    job.wait_gone(time.time())
    orphan = [e for e in job.events("node3") if e["kind"] == "orphan"]
    assert orphan and "outlived its main process trainer-1" in orphan[0]["reason"], job.events("node3")
    exited = next(e for e in job.events("node3") if e["kind"] == "exited")
    assert exited["exit_code"] == 3
    assert_failed_status(job, "trainer-1 on node3 exited with code 3")


def test_zombies_are_reported_and_their_parent_killed_when_the_job_ends(fresh):
    job = fresh
    job.start("--zombies trainer-0:2 --worker-zombies trainer-0:2")
    assert wait_for(lambda: len([e for e in job.events("node2") if e["kind"] == "zombie"]) >= 4, timeout=20)  # each defunct for ZOMBIE_MIN_AGE first
    health = job.health("node2")
    assert wait_for(lambda: job.health("node2")["processes"][0]["zombies"] >= 4, timeout=5), health
    status = job.fab("status")
    assert "ZOMBIE" in status.stdout, status.stdout
    t0 = time.time()
    os.kill(job.program("node3", "trainer-1"), signal.SIGKILL)
    job.wait_gone(t0)
    killed = [e for e in job.events("node2") if e["kind"] == "killed" and "defunct children" in e["reason"]]
    assert killed, job.events("node2")  # the worker ignores SIGTERM and sits on its zombies: SIGKILL
    assert killed[0]["signal"] == "SIGKILL"


def test_a_node_whose_sshd_stops_still_tears_down(fresh, sshd):
    job = fresh
    job.start()
    node3 = next(n for n in sshd.nodes if n.name == "node3")
    sshd.stop(node3)
    try:
        status = job.fab("status")
        assert status.returncode == 1
        assert re.search(r"node3 +- +UNREACHABLE", status.stdout), status.stdout
        assert "node3 (root@127.0.0.4" in status.stdout and "unreachable" in status.stdout
        t0 = time.time()
        os.kill(job.program("node2", "trainer-0"), signal.SIGKILL)
        assert job.wait_gone(t0) < 5.0  # node3's agent needs no SSH to hear of it
        assert "teardown" in job.kinds("node3")
        watch = job.fab("watch", "--timeout", "30")
        assert watch.returncode == 1
        assert "node3" in watch.stdout and "UNREACHABLE" in watch.stdout
    finally:
        sshd.start(node3)
    assert_failed_status(job, "trainer-0 on node2 killed by SIGKILL")


def test_on_failure_keep_leaves_the_survivors_and_says_so(fresh):
    job = fresh
    job.start("--crash trainer-1:10:4", on_failure="keep")
    assert wait_for(lambda: "kept" in job.kinds("node2"), timeout=15), job.describe()
    time.sleep(1)
    assert live_marked([job.ws["node1"]]) and live_marked([job.ws["node2"]])  # pserver-0 and trainer-0 kept
    kept = next(e for e in job.events("node2") if e["kind"] == "kept")
    assert "trainer-0" in kept["reason"] and "fab kill-all" in kept["reason"]
    assert "teardown" not in job.kinds()
    assert_failed_status(job, "survivors left running for debugging")
    out = job.fab("watch", "--timeout", "20")
    assert out.returncode == 1 and "on_failure keep" in out.stdout
    job.fab("kill-all", "--grace", "1", check=True)
    assert wait_for(lambda: not job.leftovers(), timeout=10), job.describe()


@pytest.mark.timeout(300)  # two starts, a refused one, four statuses and a kill-all on a shared 2-core machine
def test_a_start_refused_on_one_node_stops_the_rest_of_the_job_at_once(fresh):
    """All or nothing: node2's workspace is group-writable (refused, rightly); the pserver and the
    agents of node1 and node3 that had started are stopped within the grace, with an event saying why."""
    job = fresh
    job.configure(pserver_args="--ignore-term pserver-0")  # the escalation must reach SIGKILL
    assert not job.leftovers(), job.leftovers()
    job.ws["node2"].chmod(0o770)
    try:
        out = job.fab("start-pserver", "start-trainers")
    finally:
        job.ws["node2"].chmod(0o700)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "node2: FAILED" in out.stdout and "is writable by group or others" in out.stdout, out.stdout
    assert "what had started was stopped (all or nothing)" in out.stderr, out.stderr
    assert "nothing of it is left running" in out.stdout, out.stdout
    job.job_id = re.search(r"job (\S+): trainer NOT started", out.stdout).group(1)
    # When fab returns, nothing of the job is alive on any node: /proc, by the marker and by the run records.
    assert live_marked(job.ws.values()) == [], live_marked(job.ws.values())
    for node in ("node1", "node3"):
        for name in [f.stem for f in job.jd(node).glob("run/*.json")]:
            record = job.run(node, name)
            for pid in (record["pid"], record.get("program_pid")):
                assert pid is None or gone(pid), f"{name} on {node}: pid {pid} alive: {stat(pid)}"
    for node in ("node1", "node3"):
        said = [e for e in job.events(node) if e["kind"] == "start_failed"]
        assert len(said) == 1 and "node2:" in said[0]["reason"] and "writable by group" in said[0]["reason"], \
            job.describe()
        # The agents did not take it for a failure of their own: one that saw a process end before it was
        # stopped itself (every process of the node is signalled at once) says the failed start stopped it,
        # as one says so of `fab kill-all` (test_kill_all_marks_every_nodes_job_before_it_stops_any_process).
        ends = [e["reason"] for e in job.events(node) if e["kind"] in ("job_failed", "exited")]
        assert all("stopped by a start that failed on some node" in reason for reason in ends), job.describe()
    stopped = {e["name"]: e for e in job.events("node1") if e["kind"] == "killed"}
    assert stopped["pserver-0"]["signal"] == "SIGKILL" and "node2:" in stopped["pserver-0"]["reason"], stopped
    assert_failed_status(job, "JOB FAILED: the start failed: node2: workspace",
                         "stopped because its start failed (all or nothing)")
    # The next job starts cleanly; a start that every node refuses (it is running) started nothing: it stops nothing.
    job.start()
    again = job.fab("start-pserver")
    said = again.stdout + again.stderr
    assert again.returncode == 1 and f"nothing was started: job {job.job_id} is running" in said, said
    assert "stopping job" not in again.stdout and "start_failed" not in job.kinds(), again.stdout
    assert job.fab("status").returncode == 0
    assert not gone(job.program("node1", "pserver-0")) and not gone(job.program("node2", "trainer-0"))
    job.fab("kill-all", "--grace", "1", check=True)
