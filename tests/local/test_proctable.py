"""procfs.ProcTable between two listings of /proc, on real processes: what an agent sees of its job
when it lists /proc only every few seconds (200 local nodes on one machine).

The table re-reads the hot pids (the job's processes) and finds their new descendants through
/proc/<pid>/task/<tid>/children. Through the real launcher (a child subreaper) that includes a
grandchild that left its session and whose parent died: without a listing, it is still found.
A process unrelated to every hot pid waits for the next listing; a hot one that ends is dropped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fabtrain.contract.launcher import SCRIPT
from fabtrain.node import launch, procfs
from tests.support.procscan import wait_for

pytestmark = pytest.mark.timeout(60)

# Forks a child that starts its own session and forks the real escapee, then exits: the escapee
# is re-parented (to the launcher, a child subreaper), and writes its pid for the test.
ESCAPE = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(60)
    os._exit(0)
os.wait()
time.sleep(60)
"""


def test_a_table_that_is_not_listed_follows_the_hot_pids_children_even_one_that_left_its_session(tmp_path):
    script = tmp_path / SCRIPT
    script.write_text(launch.source())
    escapee_file = tmp_path / "escapee.pid"
    launcher = subprocess.Popen([sys.executable, "-I", "-S", str(script), "--exit", str(tmp_path / "p.exit"), "--",
                                 sys.executable, "-c", ESCAPE, str(escapee_file)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    unrelated = None
    try:
        table = procfs.ProcTable(full_every=1000, list_period=3600)
        table.refresh({launcher.pid})  # the first refresh lists /proc: the one listing of this test
        assert wait_for(escapee_file.exists, timeout=10)
        escapee = int(escapee_file.read_text())
        assert procfs.stat(escapee).ppid == launcher.pid  # re-parented to the subreaper, not PID 1
        unrelated = subprocess.Popen(["sleep", "60"])

        procs = table.refresh({launcher.pid})
        assert escapee in procs and procs[escapee].sid != procs[launcher.pid].sid  # another session, still found
        program = procfs.descendants(launcher.pid, procfs.children_map(procs))
        assert escapee in program and len(program) == 2  # the program and the escapee, nothing else
        assert unrelated.pid not in procs  # no listing yet: only what is below a hot pid

        hot = {launcher.pid, *program}
        os.kill(escapee, signal.SIGKILL)
        assert wait_for(lambda: procfs.stat(escapee) is None or procfs.stat(escapee).dead, timeout=5)

        def dropped():
            procs = table.refresh(hot)
            return escapee not in procs or procs[escapee].dead

        assert wait_for(dropped, timeout=5)  # a hot pid that ended is seen to end without a listing

        table.list_period = 0  # the next refresh lists: the unrelated process is seen
        assert unrelated.pid in table.refresh(hot)
    finally:
        for p in (launcher, unrelated):
            if p is not None:
                p.kill()
                p.wait()
        if escapee_file.exists():
            try:
                os.kill(int(escapee_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_without_children_files_every_refresh_lists_proc(monkeypatch):
    """A kernel built without CONFIG_PROC_CHILDREN: the table lists /proc each time, as before."""
    table = procfs.ProcTable(full_every=1000, list_period=3600)
    table.refresh({os.getpid()})
    monkeypatch.setattr(procfs, "children", lambda pid: None)
    started = subprocess.Popen(["sleep", "60"])  # below no hot pid: found only by a listing
    try:
        time.sleep(0.05)
        assert started.pid in table.refresh({1})
    finally:
        started.kill()
        started.wait()


def test_a_settling_table_reads_an_unrelated_process_only_once_it_has_lived_through_a_listing():
    """The agent's table: of 200 nodes' short-lived processes on one machine, none is ever read."""
    table = procfs.ProcTable(full_every=1000, list_period=0, settle=True)  # every refresh lists here
    table.refresh(set())  # the first listing reads everything there is
    lasting = subprocess.Popen(["sleep", "60"], start_new_session=True)
    brief = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        procs = table.refresh(set())  # listed once: pending, not read
        assert lasting.pid not in procs and brief.pid not in procs
        assert {lasting.pid, brief.pid} <= table.pending
        brief.kill()
        brief.wait()
        procs = table.refresh(set())  # listed again: the one still there is read, the other never was
        assert lasting.pid in procs and procs[lasting.pid].ppid == os.getpid()
        assert brief.pid not in procs and brief.pid not in table.pending
        assert lasting.pid in table.read
    finally:
        for p in (lasting, brief):
            p.kill()
            p.wait()
