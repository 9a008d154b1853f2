"""How a job process is stopped: the one kill escalation on a node, for the agent and node ops alike.

`send` and `signal_all` signal pids (with SIGCONT after, so a stopped process
acts on its SIGTERM); `family` finds what a job process started (its
launcher's descendants and its group); `trusted` says whether a run record
may be acted on at all; `starter` finds the daemon that started a process
from elsewhere (Open MPI's orted), which outlives the job when mpirun fails; `stop_all` is SIGTERM -> grace -> SIGKILL, blocking,
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


# The daemons that may start a job process on a node from outside fabtrain (`job.launcher: mpirun`:
# Open MPI's per-node daemon, orted in Open MPI 4, prted in 5). sshd started them, without the job
# marker; a run record names one only under these names, so a planted record cannot aim a stop elsewhere.
STARTERS = ("orted", "prted")


def starter(record: dict, procs: dict) -> tuple[int, float] | None:
    """The daemon a run record says started the process (mpirank.py records its parent), if it is alive,
    started when the record says and still runs a daemon of that name: (pid, create time)."""
    s = record.get("starter")
    if not isinstance(s, dict) or not isinstance(s.get("pid"), int) or s.get("command") not in STARTERS:
        return None
    p = procs.get(s["pid"]) or procfs.stat(s["pid"])  # the agent's table may not have read it yet
    if p is None or p.dead or not p.is_(s.get("create_time")) or s["pid"] < 2:
        return None
    cmd = procfs.cmdline(s["pid"])
    return (s["pid"], p.create_time) if cmd and os.path.basename(cmd[0]) == s["command"] else None


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
