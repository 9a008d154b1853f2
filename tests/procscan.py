"""Scanning /proc for job processes, as a user would check that nothing is left."""
from __future__ import annotations

import os
import time


def wait_for(predicate, timeout=10.0, interval=0.05):
    """Poll until predicate() is truthy or the time is up; return its last value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat(pid: int):
    """(state, ppid, CPU seconds used, start time in clock ticks) of a process, or None."""
    try:
        data = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    return rest[0], int(rest[1]), (int(rest[11]) + int(rest[12])) / CLK_TCK, int(rest[19])


def live_marked(workspaces) -> list[tuple[int, str]]:
    """Processes whose environment carries one of these workspaces' job marker.

    A state-Z process whose parent is PID 1 is already dead (PID 1 here reaps
    lazily), so it does not count.
    """
    markers = [f"FABTRAIN_WORKSPACE={os.path.realpath(w)}".encode() + b"\0" for w in workspaces]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if any(env.startswith(m) or b"\0" + m in env for m in markers):
            st = stat(pid)
            if st is None or (st[0] in "ZX" and st[1] == 1):
                continue
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                cmd = "?"
            found.append((pid, f"{st[0]} {cmd}"))
    return found
