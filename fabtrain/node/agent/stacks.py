"""Every thread's Python stack of this node's job processes, taken before a hang's teardown.

The launcher (fabtrain/node/launch.py) has every Python program register
``faulthandler`` for its stack signal, writing into ``<job_dir>/stacks/<name>.txt``.
Here the agent sends that signal only to a process whose /proc status says it
catches it (a non-Python program would die of it), waits a bounded time for
the file, and reads the main thread's top frame from it. faulthandler dumps
from its C signal handler, so a rank spinning in Python or blocked in a
system call answers at once. Standard library only.
"""
from __future__ import annotations

import os
import re
import time

from fabtrain.node import launch, procfs
from fabtrain.node.kill import send

WAIT = 2.0  # seconds the teardown waits, at most, for every process's stacks
SETTLE = 0.1  # a file that has not grown for this long is complete
FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>.+)$')


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


def top_frame(text: str) -> str | None:
    """The main thread's innermost frame, ``path:line in function``: faulthandler lists the
    threads newest first, so the main thread is the last block; its first frame is the innermost."""
    blocks = [b for b in re.split(r"\n\s*\n", text.strip()) if b.strip()]
    for block in reversed(blocks):
        for line in block.splitlines():
            m = FRAME.match(line)
            if m:
                return "%s:%s in %s" % (m["path"], m["line"], m["func"].strip())
    return None


def dump(targets, job_dir: str, wait: float = WAIT) -> dict:
    """Stacks of `targets` ((name, [pids: the program first, then its descendants])) into job_dir/stacks.

    Returns {name: {"frame": "path:line in function"} or {"why": "..."}}; never waits more than `wait`.
    """
    sig = launch.stack_signal()
    out, sent = {}, {}
    for name, pids in targets:
        pid = next((p for p in pids if p and catches(p, sig)), None)
        if pid is None:
            out[name] = {"why": "no stack: %s installed no stack handler (not a Python program, or run with "
                                "-I, -E or -S)" % ("its program (pid %s)" % pids[0] if pids else "no process")}
            continue
        path = launch.stacks_path(job_dir, name)
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.truncate(path, 0) if os.path.exists(path) else open(path, "w").close()
        except OSError as e:
            out[name] = {"why": "no stack: cannot write %s: %s" % (path, e.strerror)}
            continue
        send(pid, sig)
        sent[name] = (pid, path)
    deadline, sizes = time.monotonic() + wait, {}
    while sent and time.monotonic() < deadline:
        time.sleep(SETTLE)
        for name, (pid, path) in list(sent.items()):
            size = _size(path)
            if size and sizes.get(name) == size:
                text = _read(path)
                frame = top_frame(text)
                out[name] = {"frame": frame} if frame else {"why": "no stack: %s holds no Python frame" % path}
                del sent[name]
            sizes[name] = size
    for name, (pid, path) in sent.items():
        out[name] = {"why": "no stack: pid %d did not answer within %g s (stopped, or the signal is blocked)"
                            % (pid, wait)}
    return out


def targets_of(contexts, names, kids: dict) -> list:
    """(name, [program pid, then its descendants]) of the named live processes."""
    out = []
    for ctx in contexts:
        if ctx.name in names and ctx.program:
            out.append((ctx.name, [ctx.program] + procfs.descendants(ctx.program, kids)))
        elif ctx.name in names:
            out.append((ctx.name, []))
    return out


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
