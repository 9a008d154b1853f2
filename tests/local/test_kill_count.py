"""What kill-all says it stopped: the job's programs, once each, never a launcher that is exiting.

A launcher whose program has ended records the exit code and leaves. For a moment
its pid is alive while /proc/<pid>/cmdline already reads empty (the kernel has
freed its memory). Under load kill-all met launchers in that moment, took them for
processes of their own and reported one process more than the job had (the
dashboard's "kill: 4 processes stopped" for three). Real launchers and programs
here; the exiting moment is made to last by making every read of the launcher's
command line come back empty, as it does then.
"""
from __future__ import annotations

import os
import time

import pytest

from fabtrain.node import launch, ops, procfs
from fabtrain.node.spawn import name_programs, spawn
from tests.support.launched import make_job_dir, plain_env, process_spec

pytestmark = pytest.mark.timeout(60)
JOB = "20261127-030000-abcd"


def test_a_launcher_whose_command_line_reads_empty_is_waited_for_not_counted(tmp_path, monkeypatch):
    ws = str(tmp_path / "ws")
    jd = make_job_dir(os.path.join(ws, "jobs", JOB))
    marker = {"FABTRAIN_WORKSPACE": ws, "FABTRAIN_JOB_ID": JOB}  # what kill-all trusts a process by
    specs = {name: process_spec(jd, name, ["sleep", "60"], marker) for name in ("trainer-0", "trainer-1")}
    started = [spawn(spec, ws, plain_env()) for spec in specs.values()]
    name_programs(started, ws, specs, time.time() + 20)
    launchers = {p.pid for p, _ in started}
    programs = {r["program_pid"] for _, r in started}

    real_cmdline = procfs.cmdline
    monkeypatch.setattr(procfs, "cmdline", lambda pid: [] if pid in launchers else real_cmdline(pid))
    try:
        result = ops.op_kill({"workspace": ws, "grace": 2})
    finally:
        for p, _ in started:
            try:
                os.killpg(p.pid, 9)
            except OSError:
                pass
    stopped = [k for k in result["killed"] if not k.get("child")]
    assert sorted(k["pid"] for k in stopped) == sorted(programs), result["killed"]
    assert result["left"] == []
    for p, _ in started:  # the launchers recorded their programs' ends and left
        assert p.wait(10) == 128 + 15
    for name in specs:
        assert launch.read_exit(os.path.join(jd, "run", name + ".exit")) == 128 + 15
