"""Faults the watchdog must catch (kill -9, escapes from the process group, spinning and chatty hangs,
a full disk, a silent start), performed the way the world performs them, on three real sshd nodes.

The stand-in trainer (tests/programs/standin.py) prints a line and appends a
metrics record every 0.2 s and has a child `sleep`; the watchdog runs with
interval 1 s, hang_timeout 3 s, grace 2 s. Each test checks /proc for every
process it can name (not only the job marker), events.jsonl, `fab status`, and
that the next job starts clean (Job.start refuses leftovers). Teardown: at most
2 s after a failure, hang_timeout + 2 s after a hang.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from fabtrain.node import procfs
from tests.support.procscan import wait_for
from tests.support.ssh_job import HANG_TIMEOUT, NODES, Job, assert_failed_status, deployed

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(150)]

STANDIN = "python tests/programs/standin.py"
TEARDOWN = 2.0


@pytest.fixture(scope="module")
def job(sshd, tmp_path_factory):
    with deployed(tmp_path_factory.mktemp("watchdog"), sshd, STANDIN) as j:
        yield j


@pytest.fixture
def fresh(job):
    yield job
    job.clean()


def printed_pids(out: str) -> dict[tuple[str, str], int]:
    """{(node, name): pid} from `fab start-*`'s "node3: started trainer-1 (pid 123), ..." lines."""
    found = {}
    for node, names in re.findall(r"^(\S+): started (.*)$", out, re.M):
        for name, pid in re.findall(r"(\S+) \(pid (\d+)\)", names):
            found[(node, name)] = int(pid)
    return found


def start_printing(job: Job, trainer_args: str = "", pserver_args: str = "", **watchdog) -> dict[tuple[str, str], int]:
    """Start a job as a user does and return the pids `fab` printed."""
    job.configure(trainer_args, pserver_args, **watchdog)
    assert not job.leftovers(), job.leftovers()
    for ws in job.ws.values():
        for f in ws.glob("*.pid"):
            f.unlink()
    out = job.fab("start-pserver", "start-trainers", check=True)
    job.job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    assert wait_for(lambda: all(len(job.metrics(n, f"trainer-{i}")) >= 2 for i, n in enumerate(("node2", "node3")))
                    and all(set((job.health(n) or {}).get("peers") or {}) == set(NODES) for n in NODES),
                    timeout=20), job.describe()
    job.collect()
    return printed_pids(out.stdout)


def pid_file(job: Job, node: str, what: str) -> int:
    path = job.ws[node] / f"{what}.pid"
    assert wait_for(lambda: path.exists() and path.read_text().strip(), timeout=5), path
    return int(path.read_text())


def alive(pid: int) -> bool:
    return procfs.alive(pid)


# -- 1. the pid fabtrain prints is the program -------------------------------------------------


def test_kill_9_of_the_pid_fabtrain_prints_fails_the_job_and_tears_down(fresh):
    job = fresh
    shown = start_printing(job, "--escape trainer-1")
    pid = shown[("node3", "trainer-1")]
    record = job.run("node3", "trainer-1")
    assert pid == record["program_pid"] != record["pid"]
    assert "tests/programs/standin.py" in " ".join(procfs.cmdline(pid))  # the program, not a wrapper
    child, escaped = pid_file(job, "node3", "child-trainer-1"), pid_file(job, "node3", "escaped-trainer-1")
    assert procfs.stat(escaped).sid == escaped and b"FABTRAIN" not in procfs.environ_raw(escaped)
    assert procfs.stat(escaped).ppid == record["pid"]  # re-parented to its launcher, not to PID 1
    job.collect()
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    took = job.wait_gone(t0)
    assert took <= TEARDOWN, f"teardown took {took:.2f} s"
    assert not any(alive(p) for p in (pid, record["pid"], child, escaped))
    exited = next(e for e in job.events("node3") if e["kind"] == "exited")
    assert exited["name"] == "trainer-1" and exited["pid"] == pid and exited["signal"] == "SIGKILL"
    assert {e["node"] for e in job.events() if e["kind"] == "teardown"} == set(NODES)
    status = assert_failed_status(job, "trainer-1 on node3 killed by SIGKILL (exit code 137)")
    assert re.search(r"^node3\s+trainer-1\s+killed\s", status, re.M), status
    assert " lost " not in status


def test_kill_9_of_a_launcher_is_that_processs_failure_not_a_lost_process(fresh):
    job = fresh
    start_printing(job, "--escape trainer-1")
    record = job.run("node3", "trainer-1")
    launcher, program = record["pid"], record["program_pid"]
    child, escaped = pid_file(job, "node3", "child-trainer-1"), pid_file(job, "node3", "escaped-trainer-1")
    job.collect()
    t0 = time.time()
    os.kill(launcher, signal.SIGKILL)
    took = job.wait_gone(t0)
    assert took <= TEARDOWN, f"teardown took {took:.2f} s"
    assert not any(alive(p) for p in (launcher, program, child, escaped))
    reason = f"trainer-1 on node3 killed: its launcher (pid {launcher}) died without recording an exit code"
    assert all(e["reason"] == reason for e in job.events() if e["kind"] == "job_failed"), job.describe()
    orphans = [e for e in job.events("node3") if e["kind"] == "orphan"]
    assert {child, escaped} <= {e["pid"] for e in orphans}, orphans  # what it left is found without its launcher
    status = assert_failed_status(job, reason)
    assert re.search(r"^node3\s+trainer-1\s+killed\s", status, re.M) and " lost " not in status, status


# -- 2. descendants do not escape ----------------------------------------------------------------


def test_kill_all_stops_descendants_that_left_their_session_and_environment(fresh):
    job = fresh
    start_printing(job, "--escape *", "--escape *")
    escaped = [pid_file(job, n, f"escaped-trainer-{i}") for i, n in enumerate(("node2", "node3"))]
    escaped.append(pid_file(job, "node1", "escaped-pserver-0"))
    assert all(alive(p) and b"FABTRAIN" not in procfs.environ_raw(p) for p in escaped)
    out = job.fab("kill-all", "--grace", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not any(alive(p) for p in escaped), out.stdout
    assert not job.leftovers(), job.leftovers()
    assert "STILL ALIVE" not in out.stdout


# -- 3. the hang rule: after the first record, only records are progress -----------------------


@pytest.mark.parametrize("fault", ["spin", "chatter"])
def test_a_trainer_busy_or_chatty_without_new_metrics_is_hung(fresh, fault):
    job = fresh
    start_printing(job, f"--{fault} trainer-0:8")  # from step 8 (~1.6 s): 100% CPU, or `waiting...`; no records
    assert wait_for(lambda: "hang" in job.kinds("node2"), timeout=HANG_TIMEOUT + 10), job.describe()
    job.wait_gone(time.time())
    last_record = job.metrics("node2", "trainer-0")[-1]["ts"]
    gone = max(e["ts"] for e in job.events() if e["kind"] in ("killed", "exited"))
    assert gone - last_record <= HANG_TIMEOUT + 2, f"hang teardown {gone - last_record:.2f} s after the last record"
    hang = next(e for e in job.events("node2") if e["kind"] == "hang")
    assert hang["name"] == "trainer-0" and "no new metrics record" in hang["reason"], hang
    if fault == "chatter":
        assert "waiting..." in (job.jd("node2") / "logs" / "trainer-0.log").read_text()
    assert_failed_status(job, "trainer-0 on node2 hung: no progress")


def test_a_trainer_silent_before_its_first_record_is_judged_by_the_old_rule(fresh):
    """No output, no CPU, no record for hang_timeout during its startup: hung."""
    job = fresh
    job.configure("--silent-start trainer-1:30")
    assert not job.leftovers(), job.leftovers()
    out = job.fab("start-pserver", "start-trainers", check=True)
    job.job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    assert wait_for(lambda: "hang" in job.kinds("node3"), timeout=HANG_TIMEOUT + 15), job.describe()
    hang = next(e for e in job.events("node3") if e["kind"] == "hang")
    assert "no metrics record, no log output, no CPU time" in hang["reason"], hang
    job.wait_gone(time.time())


# -- 4. a start that dies halfway ------------------------------------------------------------------


def test_a_start_that_dies_halfway_fails_naming_the_missing_node(fresh, sshd):
    job = fresh
    job.configure(startup_timeout=4)
    node3 = next(n for n in sshd.nodes if n.name == "node3")
    sshd.stop(node3)
    try:
        out = job.fab("start-pserver", "start-trainers")
    finally:
        sshd.start(node3)
    assert out.returncode == 1, out.stdout
    assert "node3: FAILED" in out.stdout and "trainer NOT started on every node" in out.stdout, out.stdout
    assert "trainer started" not in out.stdout
    job.job_id = re.search(r"job (\S+): trainer NOT started", out.stdout).group(1)
    # All or nothing: fab stops what started (node1's pserver, node2's trainer) at once, not after startup_timeout.
    assert "stopping job" in out.stdout and "node2: killed" in out.stdout, out.stdout
    assert not job.leftovers(), job.describe()
    said = [e for e in job.events() if e["kind"] == "start_failed"]
    assert {e["node"] for e in said} == {"node1", "node2"} and all("node3:" in e["reason"] for e in said), said
    assert_failed_status(job, "JOB FAILED: the start failed: node3:")


def test_start_trainers_refuses_a_job_whose_pservers_are_not_running(fresh):
    job = fresh
    job.configure()
    job.fab("start-pserver", check=True)
    job.fab("kill-all", "--grace", "1", check=True)
    out = job.fab("start-trainers")
    assert out.returncode == 2 and "its pservers are not running (pserver-0 on node1 killed (143))" in out.stderr
    assert not job.leftovers()


def test_a_refused_start_pserver_does_not_become_the_current_job(fresh):
    job = fresh
    start_printing(job)
    running = job.job_id
    out = job.fab("start-pserver")
    said = out.stdout + out.stderr
    assert out.returncode == 1 and f"nothing was started: job {running} is running" in said, said
    assert "pserver started" not in out.stdout, out.stdout
    assert json.loads((job.state / "test.json").read_text())["job_id"] == running  # the refused id was not saved
    job.fab("kill-all", "--grace", "1", check=True)


# -- 5. a full disk ----------------------------------------------------------------------------------


def can_mount() -> bool:
    return os.geteuid() == 0 and subprocess.run(["which", "mount"], capture_output=True).returncode == 0


@pytest.mark.skipif(not can_mount(), reason="needs root to mount a small tmpfs")
def test_a_trainer_killed_by_a_full_disk_records_its_exit_code_and_says_so(fresh):
    job = fresh
    # The job's directory on its own small disk (and so on another file system than the code it snapshots).
    jobs = job.ws["node2"] / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(jobs)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {out.stderr.strip()}")
    try:
        start_printing(job, "--fill-disk trainer-0:15")  # at step 15 (~3 s) it writes a checkpoint until ENOSPC
        assert wait_for(lambda: "teardown" in job.kinds("node3"), timeout=20), job.describe()
        job.wait_gone(time.time())
        assert (job.jd("node2") / "run" / "trainer-0.exit").read_text().strip() == "1"
        exited = next(e for e in job.events("node2") if e["kind"] == "exited")
        assert exited["exit_code"] == 1 and "No space left on device" in exited["reason"], exited
        assert f"{job.ws['node2']} on node2 is full" in exited["reason"]
        failed = [e for e in job.events() if e["kind"] == "job_failed"]
        assert {e["node"] for e in failed} == set(NODES)
        assert all("No space left on device" in e["reason"] and "node2" in e["reason"] for e in failed)
        assert_failed_status(job, "trainer-0 on node2 exited with code 1 (No space left on device")
    finally:
        if job.leftovers():
            job.fab("kill-all", "--grace", "1")
        subprocess.run(["umount", "-l", str(jobs)], capture_output=True)
