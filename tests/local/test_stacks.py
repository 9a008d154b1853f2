"""Stacks before the kill: a hung rank's stack, and every rank's, are in the job's directory before teardown."""
import json
import re
import time

import pytest

from fabtrain.controller import records
from tests.support.local_job import FAKE
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port

HANG_TIMEOUT = 4


def saved(jd, name):
    """What the processes of `name` dumped (each its own stacks/<name>.<pid>.txt)."""
    return "".join(p.read_text() for p in sorted((jd / "stacks").glob(name + ".*.txt")))


@pytest.mark.parametrize("fault, func", [("--spin", "spin_forever"), ("--block", "wait_for_peer")])
def test_a_hang_names_the_stuck_function_and_saves_every_ranks_stack(local_job, fault, func):
    job = local_job([("n0", ["trainer"]), ("n1", ["trainer"])], mode="collective", master_port="auto",
                    trainer={"command": f"{FAKE} --period 0.2 {fault} trainer-1:5"},
                    watchdog={"interval": 0.5, "hang_timeout": HANG_TIMEOUT, "grace": 1,
                              "port": free_port(["127.0.0.1"])})
    job.fab("deploy", "start-trainers", check=True)
    assert wait_for(lambda: any(e["kind"] == "hang" for e in job.events("n1")), timeout=HANG_TIMEOUT + 20), \
        job.events("n1")
    hang = next(e for e in job.events("n1") if e["kind"] == "hang")
    assert hang["name"] == "trainer-1" and hang["first"] == "trainer-1", hang
    assert re.fullmatch(r".*fakejob\.py:\d+ in " + func, hang["frame"]), hang
    assert wait_for(lambda: not live_marked(job.ws.values()), timeout=HANG_TIMEOUT + 5), "teardown too slow"
    assert time.time() - hang["ts"] < HANG_TIMEOUT + 5
    stuck = saved(job.jd("n1"), "trainer-1")
    assert f"in {func}" in stuck and stuck.count("Thread 0x") + stuck.count("Current thread") >= 1, stuck
    if fault == "--spin":
        assert "in sleep_forever" in stuck, stuck  # every thread, not only the main one
    # The other node's rank was torn down for that hang: its stack too, named in its teardown event.
    teardown = next(e for e in job.events("n0") if e["kind"] == "teardown")
    assert "in main" in teardown["stacks"]["trainer-0"]["frame"] or "sleep" in teardown["stacks"]["trainer-0"]["frame"]
    assert "fakejob.py" in saved(job.jd("n0"), "trainer-0")
    out = job.fab("logs", "--stacks", check=True)
    assert f"in {func}" in out.stdout and "trainer-0" in out.stdout, out.stdout
    # The controller keeps both events whole (the dashboard shows their stacks), not as malformed.
    for line in (job.jd("n1") / "events.jsonl").read_text().splitlines() + \
            (job.jd("n0") / "events.jsonl").read_text().splitlines():
        if '"stacks"' in line:
            assert records.event(line)["stacks"] == json.loads(line)["stacks"], line


def test_a_program_that_is_not_python_gets_no_signal_and_the_event_says_why(local_job):
    job = local_job([("n0", ["trainer"])], mode="collective", master_port="auto", trainer={"command": "sleep 300"},
                    watchdog={"interval": 0.5, "hang_timeout": 3, "startup_timeout": 300, "grace": 1,
                              "port": free_port(["127.0.0.1"])})
    job.fab("deploy", "start-trainers", check=True)
    assert wait_for(lambda: any(e["kind"] == "hang" for e in job.events("n0")), timeout=20), job.events("n0")
    hang = next(e for e in job.events("n0") if e["kind"] == "hang")
    assert hang["frame"].startswith("no stack: its program (pid ") and "installed no stack handler" in hang["frame"]
    killed = wait_for(lambda: next((e for e in job.events("n0") if e["kind"] in ("exited", "killed")
                                    and e.get("name") == "trainer-0"), None), timeout=10)  # the teardown after it
    assert killed, job.events("n0")
    assert killed.get("signal") == "SIGTERM", killed  # stopped by the teardown, not by the stack signal
