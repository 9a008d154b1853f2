"""How a start learns its programs' pids: the launcher tells them on a pipe, and nothing of it leaks.

spawn() gives each launcher the write end of a pipe (launch.READY_ENV names the
descriptor); the launcher writes its program's pid there as soon as it has
forked it, and name_programs waits on the pipes instead of polling /proc. Real
launchers, real programs: each program reports its own pid, environment and open
descriptors, and the run records must name those very pids.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from fabtrain.contract.launcher import launch_command
from fabtrain.node import atomic, launch, procfs
from fabtrain.node.spawn import name_programs, spawn
from tests.support.launched import make_job_dir, plain_env, process_spec

pytestmark = pytest.mark.timeout(60)

# Writes what it is (pid, environment, open descriptors) where it is told, then lives on a while.
PROGRAM = """
import json, os, sys, time
fds = {}
for f in os.listdir("/proc/self/fd"):
    try:
        fds[f] = os.readlink("/proc/self/fd/" + f)
    except OSError:
        pass  # the listing's own descriptor, closed by now
out = {"pid": os.getpid(), "env": dict(os.environ), "fds": fds}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(out, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(float(sys.argv[2]))
"""


def wait_for_file(path: str, timeout: float = 20.0) -> dict:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


@pytest.fixture
def job_dir(tmp_path):
    jd = make_job_dir(str(tmp_path / "job"))
    yield jd
    for name in os.listdir(os.path.join(jd, "run")):
        if name.endswith(".json"):
            record = atomic.read_json(os.path.join(jd, "run", name))
            try:
                os.killpg(record["pid"], 9)
            except OSError:
                pass


def test_each_record_names_the_program_the_launcher_forked_and_the_pipe_reaches_no_program(job_dir):
    script = os.path.join(job_dir, "program.py")
    with open(script, "w") as f:
        f.write(PROGRAM)
    specs = {name: process_spec(job_dir, name, [sys.executable, script, os.path.join(job_dir, name + ".out"), "30"])
             for name in ("trainer-0", "trainer-1", "trainer-2")}
    started = [spawn(spec, job_dir, plain_env()) for spec in specs.values()]
    name_programs(started, job_dir, specs, time.time() + 20)
    for p, _ in started:  # node ops keep no end of any pipe once they know the pids
        with pytest.raises(OSError):
            os.fstat(p.ready_fd)

    for name in specs:
        seen = wait_for_file(os.path.join(job_dir, name + ".out"))
        record = atomic.read_json(os.path.join(job_dir, "run", name + ".json"))
        # The record names the program itself (the launcher's child), as it was when it started.
        assert record["program_pid"] == seen["pid"] != record["pid"]
        assert procfs.stat(seen["pid"]).ppid == record["pid"]
        assert procfs.alive(record["program_pid"], record["program_create_time"])
        # The program inherits neither the variable nor the pipe (stdin is /dev/null, the log a file).
        assert launch.READY_ENV not in seen["env"]
        assert not [link for link in seen["fds"].values() if link.startswith("pipe:")], seen["fds"]
        assert seen["fds"]["1"] == os.path.join(job_dir, "logs", name + ".log")


def test_a_launcher_that_cannot_start_its_program_ends_the_wait_at_once(job_dir, tmp_path):
    """A launcher that exits before forking (its exit record cannot be reserved) closes the pipe: the
    start does not wait out the deadline for a pid that will never come, and the record has none."""
    spec = process_spec(job_dir, "trainer-0", ["sleep", "30"])
    spec["launch"] = launch_command(sys.executable, job_dir, str(tmp_path / "no" / "such" / "dir" / "trainer-0.exit"),
                                    ["sleep", "30"])
    started = [spawn(spec, job_dir, plain_env())]
    t0 = time.time()
    name_programs(started, job_dir, {"trainer-0": spec}, time.time() + 30)
    assert time.time() - t0 < 15  # far from the 30 s deadline: the closed pipe ended the wait
    assert started[0][0].wait(10) == 1
    assert "program_pid" not in atomic.read_json(os.path.join(job_dir, "run", "trainer-0.json"))
