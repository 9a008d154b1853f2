"""Scanning /proc for job processes, as a user would check that nothing is left (through fabtrain's one /proc reader)."""
from __future__ import annotations

import os
import time

from fabtrain.node import procfs


def wait_for(predicate, timeout=10.0, interval=0.05):
    """Poll until predicate() is truthy or the time is up; return its last value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def stat(pid: int):
    """(state, ppid, CPU seconds used, start time in clock ticks) of a process, or None."""
    p = procfs.stat(pid)
    return None if p is None else (p.state, p.ppid, p.cpu, p.start_ticks)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return procfs.alive(pid)


def group(pgid: int) -> list[int]:
    """The live (not defunct) processes of process group `pgid`, read from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = procfs.stat(int(name))
            if st is not None and st.pgid == pgid and not st.dead:
                found.append(int(name))
    return found


def live_marked(workspaces) -> list[tuple[int, str]]:
    """Processes whose environment carries one of these workspaces' job marker.

    A state-Z process whose parent is PID 1 is already dead (PID 1 here reaps
    lazily), so it does not count.
    """
    procs = procfs.scan()
    found = []
    for w in workspaces:
        for pid in procfs.marked(os.path.realpath(w), procs):
            cmd = " ".join(procfs.cmdline(pid))
            if not cmd:
                # No command line: it is exiting (its memory is gone); a moment later it is a zombie, or gone.
                time.sleep(0.02)
                if not procfs.alive(pid, procs[pid].create_time):
                    continue
            found.append((pid, f"{procs[pid].state} {cmd or '?'}"))
    return sorted(set(found))
