"""The one /proc reader of the node side: node ops, the agent and the tests use it.

Standard library only; psutil would do the same with more memory and an
import the nodes may not have.
"""
from __future__ import annotations

import os
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def _boot_time() -> float:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


BOOT_TIME = _boot_time()


class Proc:
    """The fields of /proc/<pid>/stat that fabtrain uses."""

    __slots__ = ("pid", "state", "ppid", "pgid", "sid", "cpu", "create_time", "start_ticks", "rss")

    def __init__(self, pid, state, ppid, pgid, sid, cpu, start_ticks, rss):
        self.pid, self.state, self.ppid, self.pgid, self.sid = pid, state, ppid, pgid, sid
        self.cpu, self.start_ticks, self.rss = cpu, start_ticks, rss
        self.create_time = BOOT_TIME + start_ticks / CLK_TCK

    @property
    def dead(self) -> bool:
        # A zombie holds no memory, port or GPU; PID 1 reaps lazily in containers.
        return self.state in ("Z", "X")

    def is_(self, create_time: float | None) -> bool:
        """This is the process started at create_time, not another that reuses its pid."""
        return create_time is None or abs(self.create_time - create_time) < 1.0


def stat(pid: int) -> Proc | None:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        rest = data[data.rindex(b")") + 2:].split()  # the command name may hold spaces and ')'
        return Proc(pid, rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3]),
                    (int(rest[11]) + int(rest[12])) / CLK_TCK, int(rest[19]), int(rest[21]) * PAGE_SIZE)
    except (ValueError, IndexError):
        return None


def pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def scan() -> dict[int, Proc]:
    """Every process on the machine, by pid."""
    procs = {}
    for pid in pids():
        p = stat(pid)
        if p is not None:
            procs[pid] = p
    return procs


def alive(pid: int | None, create_time: float | None = None, procs: dict[int, Proc] | None = None) -> bool:
    """pid is a live (not zombie) process, and the one started at create_time if given."""
    if not pid:
        return False
    p = procs.get(pid) if procs is not None else stat(pid)
    return p is not None and not p.dead and p.is_(create_time)


def children(pid: int) -> list[int] | None:
    """pid's children, from /proc/<pid>/task/<tid>/children (a child is listed under the thread
    that forked it); [] if pid is gone; None if this kernel has no such file (CONFIG_PROC_CHILDREN)."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as f:
                out.extend(int(k) for k in f.read().split())
        except FileNotFoundError:
            if not os.path.isdir("/proc/%d/task/%s" % (pid, tid)):
                continue  # the thread ended between the listing and the read
            return None
        except (OSError, ValueError):
            continue
    return out


class ProcTable:
    """/proc, read cheaply once a second.

    Reading every /proc/<pid>/stat costs ~20 µs a process, every tick, on a
    busy machine most of the agent's CPU. Instead: list /proc (new pids are
    read once, gone ones dropped) and re-read only the `hot` pids the agent
    cares about (its job's processes and their families); the others keep the
    ppid/pgid they were born with, which is all the agent asks of them (a
    process can join a job's process group or family only by being forked
    into it: then it is new). Every `full_every` listings, everything is
    re-read, in case a pid was reused between two listings.

    With `list_period` (seconds), /proc is listed at most that often. Listing
    it costs ~1 µs an entry in the kernel (1.2 ms at 1,250 processes here,
    most of an agent's step where 200 local nodes share one machine). Between
    listings the hot pids are re-read and their children found through
    /proc/<pid>/task/<tid>/children, read down to every new descendant: a
    process forked into a job's family is seen at the next refresh, as with a
    listing (the launcher is a child subreaper, so even a process that leaves
    its session stays in that family). Only a process unrelated to every hot
    pid (a stray of an earlier job, started from elsewhere) waits for the next
    listing, and other pids' entries may be that old. With `list_first` False
    the first listing, too, waits `list_period`: for a process that starts
    with every other node of a job and cares first about its own. A kernel
    without the children files gets a listing at every refresh.

    With `settle` (the agent), the hot pids are followed at every refresh, and
    a pid a listing finds that no hot pid leads to is read only at the next
    listing, if it is still there: the many short-lived processes of a busy
    machine (a shell's `sleep`, a node-side call; 200 nodes' of them on one
    host) are never read at all, and what is read has lived `list_period`.
    """

    def __init__(self, full_every: int = 10, list_period: float = 0.0, list_first: bool = True,
                 settle: bool = False):
        self.procs: dict[int, Proc] = {}
        self.full_every = full_every
        self.list_period = list_period
        self.settle = settle
        self.count = 0
        self.listed_at: float | None = None if list_first else time.monotonic()
        self.read: set[int] | None = None  # the pids the last refresh read (None: every pid)
        # parent -> children: after a listing, of every process; between listings, of the followed
        # ones (all that descendants() of a hot pid needs), from their children files
        self.kids: dict[int, list[int]] = {}
        self.pending: set[int] = set()  # settle: pids the last listing found, to read at the next

    def refresh(self, hot=()) -> dict[int, Proc]:
        now = time.monotonic()
        listing = self.listed_at is None or now - self.listed_at >= self.list_period
        if self.settle and self._follow(hot):
            if listing:
                self.listed_at = now
                self._list_settled()
        elif listing or not self._follow(hot):
            self.listed_at = now
            self._list(hot)
        return self.procs

    def _list_settled(self) -> None:
        """After _follow: drop what is gone, read what the last listing found and still lives (all, every
        `full_every` listings), and keep what is new for the next listing."""
        full = self.count % self.full_every == 0
        self.count += 1
        now = set(pids())
        for pid in [p for p in self.procs if p not in now]:
            del self.procs[pid]
        followed = self.read or set()
        ripe = (now - followed) if full else (self.pending & now) - followed
        for pid in ripe:
            p = stat(pid)
            if p is None:
                self.procs.pop(pid, None)
            else:
                self.procs[pid] = p
        self.pending = now - self.procs.keys() - followed
        self.read = followed | ripe

    def _list(self, hot) -> None:
        full = self.count % self.full_every == 0
        self.count += 1
        now = set(pids())
        for pid in [p for p in self.procs if p not in now]:
            del self.procs[pid]
        new = now - self.procs.keys()
        self.read = None if full else new | (set(hot) & now)
        for pid in (now if full else self.read):
            p = stat(pid)
            if p is None:
                self.procs.pop(pid, None)
            else:
                self.procs[pid] = p
        self.kids = children_map(self.procs)

    def _follow(self, hot) -> bool:
        """Re-read the hot pids and everything below them, without listing /proc (False: no children files)."""
        todo, done, found = list(hot), set(), {}
        while todo:
            pid = todo.pop()
            if pid in done:
                continue
            done.add(pid)
            p = stat(pid)
            if p is None:
                self.procs.pop(pid, None)
                continue
            self.procs[pid] = p
            if p.dead:
                continue
            kids = children(pid)
            if kids is None:
                return False
            if kids:
                found[pid] = kids
            todo.extend(kids)
        self.read, self.kids = done, found
        return True


def below(pids) -> dict[int, Proc]:
    """These pids and every live process below them, read without listing /proc (where the kernel
    has no children files, with one listing): what a job's run records lead to, at a few reads a
    process instead of a read of every process on the machine."""
    return ProcTable(list_period=float("inf"), list_first=False).refresh(pids)


class Sweep:
    """/proc as a stop polls it, cheaply: a ProcTable that re-reads only the `hot`
    pids (what is being stopped; new pids once), and each process's job marker
    read once (a program's environment is fixed when it starts). So a process
    read mid-exec may be missed here: a stop ends only once a full scan() and
    marked() find nothing either (node ops' kill).

    A full scan() with marked() costs ~20 ms at 500 processes; polled every
    50 ms on a machine running many nodes' stops, that was most of their wait.
    /proc itself is listed every `list_period` s (what is forked under a hot
    pid is followed at every poll, see ProcTable). `procs`: a scan() just
    made, taken as the first view instead of reading every process again.
    """

    def __init__(self, workspace: str, full_every: int = 10, list_period: float = 0.5,
                 procs: dict[int, Proc] | None = None):
        self.table = ProcTable(full_every, list_period, list_first=procs is None)
        if procs is not None:
            self.table.procs, self.table.count = dict(procs), 1
        self.mark = marker(workspace)
        self.carrying: dict[tuple[int, int], bool] = {}
        self.hot: set[int] = set()

    def scan(self) -> dict[int, Proc]:
        return self.table.refresh(self.hot)

    def marked(self, procs: dict[int, Proc], skip=()) -> list[int]:
        out = []
        for pid, p in procs.items():
            if pid in skip or p.dead:
                continue
            key = (pid, p.start_ticks)
            if key not in self.carrying:
                raw = environ_raw(pid)
                if not raw:  # mid-exec (the kernel sets up the new environment after Popen's return) or gone:
                    continue  # read again at the next poll, not remembered as not ours
                self.carrying[key] = carries(raw, self.mark)
            if self.carrying[key]:
                out.append(pid)
        return out


ENVIRON_READ = 1 << 18  # bytes a read(2) of /proc/PID/environ asks for: a whole environment, nearly always


def environ_raw(pid: int) -> bytes:
    """The environment block `pid` was exec'd with. One read(2) reads one image's block, old or new; a read
    split over calls (a file object's, 8 KiB first) that meets an exec returns the old block's start and
    then nothing: a launcher's child becoming stdbuf, then the program, seemed to have half its variables."""
    try:
        fd = os.open("/proc/%d/environ" % pid, os.O_RDONLY)
    except OSError:
        return b""
    try:
        chunks = [os.read(fd, ENVIRON_READ)]
        while len(chunks[-1]) == ENVIRON_READ:  # more than 256 KiB of environment: the rest, as it comes
            chunks.append(os.read(fd, ENVIRON_READ))
        return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)


def environ(pid: int) -> dict[bytes, bytes]:
    return parse_environ(environ_raw(pid))


def parse_environ(raw: bytes) -> dict[bytes, bytes]:
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def cmdline(pid: int) -> list[str]:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def marker(workspace: str) -> bytes:
    """The job marker every job process carries in its environment."""
    return ("FABTRAIN_WORKSPACE=%s" % workspace).encode()


def carries(env: bytes, mark: bytes) -> bool:
    entry = mark + b"\0"
    return env.startswith(entry) or (b"\0" + entry) in env or env == mark or env.endswith(b"\0" + mark)


def marked(workspace: str, procs: dict[int, Proc] | None = None, skip=()) -> list[int]:
    """Every live process whose environment carries this workspace's job marker."""
    mark = marker(workspace)
    procs = scan() if procs is None else procs
    return [pid for pid, p in procs.items()
            if pid not in skip and not p.dead and carries(environ_raw(pid), mark)]


def children_map(procs: dict[int, Proc]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in procs.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    return kids


def descendants(pid: int, kids: dict[int, list[int]], breadth_first: bool = False) -> list[int]:
    """pid's descendants; breadth first: each after its parent (the order a stack dump names them in)."""
    out, todo, seen = [], list(kids.get(pid, ())), {pid}
    while todo:
        p = todo.pop(0 if breadth_first else -1)
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def group(pgid: int, procs: dict[int, Proc]) -> list[int]:
    """Live members of a process group."""
    return [p.pid for p in procs.values() if p.pgid == pgid and not p.dead]


def ancestors(pid: int | None = None) -> set[int]:
    """pid (default: this process) and every process above it."""
    out, pid = set(), pid or os.getpid()
    while pid and pid > 1 and pid not in out:
        out.add(pid)
        p = stat(pid)
        if p is None:
            break
        pid = p.ppid
    return out
