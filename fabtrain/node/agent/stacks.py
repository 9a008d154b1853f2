"""Every thread's Python stack of every Python process of this node's job processes, taken before a
hang's teardown.

The launcher (fabtrain/node/launch.py) has every Python process of a job
process (the program, torchrun's workers, forked workers) register
``faulthandler`` for its stack signal, each writing into its own
``<job_dir>/stacks/<name>.<pid>.txt``. Here the agent sends that signal to
every process of the program's tree whose /proc status says it catches it (a
non-Python program would die of it) and that can run its handler now: a
stopped process (state T, t) cannot, so it is not waited for. faulthandler
dumps from its C signal handler, so a rank spinning in Python or blocked in a
system call answers within milliseconds; the agent waits at most WAIT for
all of them together, so a rank that cannot answer costs the teardown no
more than that. Each process's rank is its ``RANK`` (torchrun's workers get
theirs from torchrun), and each file gets a first line naming it.
Standard library only.
"""
from __future__ import annotations

import os
import re
import time

from fabtrain.node import launch, procfs
from fabtrain.node.kill import send

WAIT = 0.3  # seconds the teardown waits, at most, for every process's stacks
SETTLE = 0.03  # a file that has not grown for this long after it grew is complete
POLL = 0.01
CANNOT = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger (traced)"}  # states that run no handler now
FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>.+)$')
# A frame in one of these is a rank waiting for the others (the function named is the collective).
COLLECTIVE_PATHS = ("/torch/distributed/", "/paddle/distributed/", "/horovod/", "/mpi4py/", "/deepspeed/comm/")
RANK_KEYS = (b"RANK", b"LOCAL_RANK", b"TORCHELASTIC_RUN_ID")


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler installed for the signal (/proc/<pid>/status SigCgt)."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def main_frames(text: str) -> list:
    """The main thread's frames, innermost first, as (path, line, function): faulthandler lists the
    threads newest first, so the main thread is the last block that holds a frame."""
    blocks = [b for b in re.split(r"\n\s*\n", text.strip()) if b.strip()]
    for block in reversed(blocks):
        frames = [(m["path"], m["line"], m["func"].strip()) for m in map(FRAME.match, block.splitlines()) if m]
        if frames:
            return frames
    return []


def top_frame(text: str) -> str | None:
    """The main thread's innermost frame, ``path:line in function``."""
    frames = main_frames(text)
    return "%s:%s in %s" % frames[0] if frames else None


def collective(frames) -> str | None:
    """The collective the main thread waits in (all_reduce, barrier, ...): the function of its
    innermost frame in a communication library's Python code (decorators' wrappers passed over)."""
    for path, _, func in frames:
        if any(p in path for p in COLLECTIVE_PATHS) and func not in ("wrapper", "_wrapper", "inner"):
            return func
    return None


def rank_processes(pids: list, environ=procfs.environ_raw) -> dict:
    """{pid: rank or None} of the processes that are a rank of their own: the topmost of each
    (RANK, LOCAL_RANK, TORCHELASTIC_RUN_ID) in `pids` (the program first, then descendants, each
    after its parent), unless a rank of its own runs below it (then it is a launcher: torchrun)."""
    keys, parents = {}, {}
    for pid in pids:
        env = procfs.parse_environ(environ(pid))
        keys[pid] = tuple(env.get(k) for k in RANK_KEYS)
        p = procfs.stat(pid)
        parents[pid] = p.ppid if p else None
    tops = [pid for pid in pids if parents[pid] not in keys or keys[parents[pid]] != keys[pid]]
    launchers = set()
    for pid in tops:
        q = parents[pid]
        while q in keys:
            launchers.add(q)
            q = parents[q]
    out = {}
    for pid in tops:
        if pid in launchers:
            continue
        rank = keys[pid][0]
        out[pid] = int(rank) if rank is not None and rank.isdigit() else None
    return out


def dump(targets, job_dir: str, wait: float = WAIT) -> dict:
    """Stacks of `targets` ((name, [pids: the program first, then its descendants])) into job_dir/stacks.

    Returns {name: {"frame": the main process's top frame, or "why": why none, "ranks": [per rank
    process: {"pid", "rank", "frame" or "why", "collective"}]}}; never waits more than `wait`.
    The main process of a name is its program, or, under a launcher such as torchrun, the rank that
    is not in a collective (else its lowest rank).
    """
    sig = launch.stack_signal()
    views, sent = {}, {}
    for name, pids in targets:
        views[name] = []
        if not pids:
            continue
        ranks = rank_processes(pids)
        for pid in pids:
            view = {"pid": pid, "rank": ranks.get(pid)} if pid in ranks else {"pid": pid, "helper": True}
            views[name].append(view)
            p = procfs.stat(pid)
            if p is None or p.dead:
                view["why"] = "no stack: pid %d has ended" % pid
                continue
            if not catches(pid, sig):
                view["why"] = "no stack: %s installed no stack handler (not a Python program, or run with " \
                              "-I, -E or -S)" % ("its program (pid %d)" % pid if pid == pids[0] else "pid %d" % pid)
                continue
            if p.state in CANNOT:
                view["why"] = "no stack: pid %d is %s and cannot answer" % (pid, CANNOT[p.state])
                continue
            path = launch.stacks_path(job_dir, name, pid)
            if not os.path.exists(path):
                # It caught the handler from its parent by a fork the hook did not see: it would write into
                # another process's file.
                view["why"] = "no stack: pid %d has no stack file of its own" % pid
                continue
            head = "fabtrain: %s pid %d%s\n" % (name, pid, " rank %s" % view["rank"] if view.get("rank") is not None
                                                else "")
            try:
                with open(path, "w") as f:
                    f.write(head)
            except OSError as e:
                view["why"] = "no stack: cannot write %s: %s" % (path, e.strerror)
                continue
            send(pid, sig)
            sent[pid] = (view, path, len(head.encode()))
    deadline, sizes = time.monotonic() + wait, {}
    while sent and time.monotonic() < deadline:
        time.sleep(POLL)
        for pid, (view, path, empty) in list(sent.items()):
            size = _size(path)
            if size > empty and sizes.get(pid, (0, 0))[0] == size and time.monotonic() - sizes[pid][1] >= SETTLE:
                _read_into(view, path)
                del sent[pid]
            elif sizes.get(pid, (0, 0))[0] != size:
                sizes[pid] = (size, time.monotonic())
    for pid, (view, path, empty) in sent.items():
        if _size(path) > empty:
            _read_into(view, path)  # what it wrote so far
        else:
            view["why"] = "no stack: pid %d did not answer within %g s (the signal is blocked, or it waits " \
                          "in the kernel)" % (pid, wait)
    return {name: summary(ranks) for name, ranks in views.items()}


def summary(views: list) -> dict:
    """A name's entry: its main process's frame (or why there is none) and its ranks' views."""
    if not views:
        return {"why": "no stack: no process"}
    ranks = [v for v in views if not v.get("helper")]
    main = ranks[0] if ranks else views[0]
    if len(ranks) > 1 or (ranks and ranks[0]["pid"] != views[0]["pid"]):  # under a launcher: pick a rank
        answered = [v for v in ranks if v.get("frame")]
        outside = [v for v in answered if not v.get("collective")]
        main = min(outside or answered or ranks, key=lambda v: (v.get("rank") is None, v.get("rank") or 0))
    out = {"frame": main["frame"]} if main.get("frame") else {"why": main.get("why") or "no stack"}
    out["ranks"] = [{k: v for k, v in r.items() if k != "helper"} for r in ranks]
    return out


def _read_into(view: dict, path: str) -> None:
    frames = main_frames(_read(path))
    if not frames:
        view["why"] = "no stack: %s holds no Python frame" % path
        return
    view["frame"] = "%s:%s in %s" % frames[0]
    where = collective(frames)
    if where:
        view["collective"] = where


def targets_of(contexts, names, kids: dict) -> list:
    """(name, [program pid, then its descendants, each after its parent]) of the named live processes."""
    out = []
    for ctx in contexts:
        if ctx.name in names and ctx.program:
            out.append((ctx.name, [ctx.program] + tree(ctx.program, kids)))
        elif ctx.name in names:
            out.append((ctx.name, []))
    return out


def tree(pid: int, kids: dict) -> list:
    """pid's descendants, breadth first (each after its parent)."""
    return procfs.descendants(pid, kids, breadth_first=True)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
