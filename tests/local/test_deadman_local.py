"""The dead-man with real processes: a launcher started as node ops start it (spawn, the real launcher, its
`--deadline` as the plan gives it) ends its program and everything in its group once the deadline in the file
passes, and leaves them alone while the file is renewed, or where there is no file. The pure parts:
tests/unit/test_deadman.py."""
from __future__ import annotations

import os
import threading
import time

import pytest

from fabtrain.contract.jobfolder import JobFolder
from fabtrain.contract.launcher import deadline_text, launch_command
from fabtrain.node import atomic, launch, procfs
from fabtrain.node.spawn import name_programs, spawn
from tests.support.launched import make_job_dir, plain_env, process_spec
from tests.support.procscan import group

pytestmark = pytest.mark.timeout(60)

# A program that ignores SIGTERM (so only the SIGKILL after the grace ends it) and leaves a child of its own in
# its group, and one in a session of its own (under the launcher, a subreaper, when its parent is gone).
STUBBORN = 'trap "" TERM; sleep 300 & setsid sleep 300 & wait'


@pytest.fixture
def job_dir(tmp_path):
    jd = make_job_dir(str(tmp_path / "job"))
    yield jd
    record = atomic.read_json(os.path.join(jd, "run", "trainer-0.json")) or {}
    for pid in [record.get("pid")] + group(record.get("pid") or -1):
        try:
            os.kill(pid, 9)
        except (OSError, TypeError):
            pass


def start(jd: str) -> tuple[dict, list[int]]:
    """trainer-0 started the real way with a deadline: its run record, and the pids under its launcher."""
    spec = process_spec(jd, "trainer-0", ["sh", "-c", STUBBORN])
    spec["launch"] = launch_command(os.sys.executable, jd, f"{jd}/run/trainer-0.exit", spec["argv"],
                                    deadline=JobFolder(jd).deadline)
    started = [spawn(spec, jd, plain_env())]
    name_programs(started, jd, {"trainer-0": spec}, time.time() + 20)
    record = atomic.read_json(os.path.join(jd, "run", "trainer-0.json"))
    deadline = time.time() + 10
    while len(below(record["pid"])) < 3 and time.time() < deadline:  # sh, its two sleeps (one via setsid)
        time.sleep(0.05)
    return record, below(record["pid"])


def below(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for kid in launch._children(todo.pop()):
            out.append(kid)
            todo.append(kid)
    return out


def publish(jd: str, at: float, grace: float = 1.0) -> None:
    atomic.write(JobFolder(jd).deadline, deadline_text(at, grace), durable=False)


def gone(pids) -> bool:
    return all(procfs.stat(p) is None or procfs.stat(p).dead for p in pids)


def test_a_deadline_that_passes_ends_the_program_and_its_group_then_the_launcher_says_fenced(job_dir):
    publish(job_dir, time.monotonic() + 30)
    record, family = start(job_dir)
    assert len(family) >= 3 and not gone([record["program_pid"]]), family
    t0 = time.monotonic()
    publish(job_dir, t0 + 1.5)  # the agent's last word: it stops renewing it
    while not gone(family + [record["pid"]]) and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert gone(family) and procfs.stat(record["program_pid"]) is None, (family, [procfs.stat(p) for p in family])
    assert group(record["pid"]) == [], "the program's group outlived the dead-man"
    # SIGTERM (ignored) at the deadline, the grace (1 s), SIGKILL: within a poll of each
    assert took < 1.5 + 1.0 + 2 * launch.DEADMAN_POLL + 2.0, took
    code, fenced = launch.read_exit_record(JobFolder(job_dir).exit_record("trainer-0"))
    assert (code, fenced) == (137, True)
    with open(JobFolder(job_dir).log("trainer-0")) as f:
        assert "fence deadline" in f.read()


def test_a_renewed_deadline_or_none_at_all_ends_nothing(job_dir):
    stop = threading.Event()

    def renew():  # as a running agent does: the deadline stays ahead
        while not stop.wait(0.2):
            publish(job_dir, time.monotonic() + 1.0)

    publish(job_dir, time.monotonic() + 1.0)
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    record, family = start(job_dir)
    time.sleep(3.0)
    stop.set()
    renewer.join()
    assert not any(procfs.stat(p) is None for p in family + [record["pid"]]), "ended under a renewed deadline"
    os.unlink(JobFolder(job_dir).deadline)  # the agent ended on purpose: no file, no dead-man
    time.sleep(2.0)
    assert not any(procfs.stat(p) is None for p in family + [record["pid"]]), "ended with no deadline at all"
    assert launch.read_exit(JobFolder(job_dir).exit_record("trainer-0")) is None
    publish(job_dir, time.monotonic() - 1.0)  # and then one that has passed: it ends them
    t0 = time.monotonic()
    while not gone(family + [record["pid"]]) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert gone(family) and group(record["pid"]) == []
    assert launch.read_exit_record(JobFolder(job_dir).exit_record("trainer-0")) == (137, True)
