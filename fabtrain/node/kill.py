"""How a job process is stopped: the one kill escalation on a node, for the agent and node ops alike.

`send` and `signal_all` signal pids (with SIGCONT after, so a stopped process
acts on its SIGTERM); `family` finds what a job process started (its
launcher's descendants and its group); `trusted` says whether a run record
may be acted on at all; `stop_all` is SIGTERM -> grace -> SIGKILL, blocking,
for ``fab kill-all``. The agent's process contexts (agent/supervisor.py)
escalate through the same helpers, one step per loop.

Standard library only: node ops ship this module to nodes with no deployed code.
"""
from __future__ import annotations

import os
import signal
import time

from fabtrain.node import procfs


def send(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_all(pids, sig: int) -> None:
    """sig, then SIGCONT, so a stopped process acts on its SIGTERM."""
    for pid in pids:
        send(pid, sig)
    if sig != signal.SIGCONT:
        for pid in pids:
            send(pid, signal.SIGCONT)


def family(record: dict, procs: dict, kids: dict) -> list[int]:
    """Live processes of one job process, its launcher excepted: the launcher's descendants and its group."""
    launcher = record.get("pid")
    if not procfs.alive(launcher, record.get("create_time"), procs):
        launcher = None
    found = set(procfs.descendants(launcher, kids)) if launcher else set()
    pgid = record.get("pgid") or record.get("pid")
    if pgid:
        found.update(procfs.group(pgid, procs))
    found.discard(record.get("pid"))
    return sorted(p for p in found if p in procs and not procs[p].dead)


def trusted(record: dict, procs: dict, workspace: str) -> bool:
    """A run record may be acted on: its pid is alive, started when the record says, leads its own
    process group, and carries this workspace's job marker. A planted or stale record names none of ours,
    and fabtrain never signals a group on its word."""
    pid = record.get("pid")
    p = procs.get(pid) if isinstance(pid, int) else None
    return (p is not None and not p.dead and p.is_(record.get("create_time")) and p.pgid == record.get("pgid") == pid
            and procfs.carries(procfs.environ_raw(pid), procfs.marker(workspace)))


def stop_all(find, grace: float, settle: float = 5.0) -> tuple[dict[int, str], list[int]]:
    """SIGTERM whatever find() returns, grace, SIGKILL what is left; blocking (``fab kill-all``).

    find() is asked again while waiting, so a process forked during the grace
    is stopped too. Returns ({pid: the signal that ended it}, pids still alive).
    """
    sent: dict[int, str] = {}
    deadline = time.time() + grace
    while True:
        alive = find()
        fresh = [p for p in alive if p not in sent]
        signal_all(fresh, signal.SIGTERM)
        sent.update((p, "SIGTERM") for p in fresh)
        if not alive or time.time() >= deadline:
            break
        time.sleep(0.05)
    deadline = time.time() + settle
    while alive and time.time() < deadline:
        signal_all(alive, signal.SIGKILL)
        sent.update((p, "SIGKILL") for p in alive)
        time.sleep(0.05)
        alive = find()
    return sent, alive
