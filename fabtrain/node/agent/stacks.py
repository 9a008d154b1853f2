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
# A main thread whose innermost frames are in one of these waits for the other ranks (the function named is the
# collective). DDP's own Python (torch/nn/parallel/distributed.py) waits only in its collectives: the buffers'
# broadcast before a forward, the buckets' rebuild, its start; a forward runs the module's code, whose frames are
# innermost then.
COLLECTIVE_PATHS = ("/torch/distributed/", "/paddle/distributed/", "/horovod/", "/mpi4py/", "/deepspeed/comm/",
                    "/torch/nn/parallel/distributed.py")
NOT_COLLECTIVE = ("/torch/distributed/checkpoint/",)  # in torch.distributed, but its own work is file I/O
WRAPPERS = ("wrapper", "_wrapper", "inner")  # decorators' frames: what they wrap says where the rank is
# torch's backward entry. A main thread still inside backward() at a hang (no new step for hang_timeout) waits
# for its gradients' reduction: DDP's reducer all-reduces them from C++ at the end of backward (FSDP's final
# callback too, on a GPU from the autograd engine's threads), with no Python frame of torch.distributed.
BACKWARD = (("/torch/autograd/graph.py", "_engine_run_backward"), ("/torch/autograd/__init__.py", "backward"),
            ("/torch/autograd/__init__.py", "grad"), ("/torch/_tensor.py", "backward"))
BACKWARD_NAME = "backward"
# Frames that only pass a call on, looked through toward the frame that says where the thread stands:
# Python's standard library (a wait on a lock, a queue, a selector), torch's op dispatch and stream waits, and
# the launcher's progress hook, which wraps backward(), DataLoader batches, DDP's forward and the collectives.
PASS_PATHS = ("/torch/_ops.py", "/torch/cuda/", "/torch/utils/_contextlib.py", "/_fabtrain_progress")
STDLIB = re.compile(r"^<frozen |/lib(?:64)?/python\d+(?:\.\d+)*/(?!(?:site|dist)-packages/)")
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


def stdlib(path: str) -> bool:
    """Whether a frame's file is Python's standard library (not site-packages)."""
    return bool(STDLIB.search(path))


def where(frames) -> str | None:
    """Where the thread stands, ``path:line in function``: its innermost frame outside Python's standard
    library (a rank blocked on a lock, a queue, a selector or a pipe is named by the code that waits:
    `dataloader.py:1291 in _try_get_data` for its DataLoader's workers, the user's own line), else its
    innermost."""
    for frame in frames:
        if not stdlib(frame[0]):
            return "%s:%s in %s" % frame
    return "%s:%s in %s" % frames[0] if frames else None


def top_frame(text: str) -> str | None:
    """Where the main thread stands (`where`)."""
    return where(main_frames(text))


def collective(frames) -> str | None:
    """What the main thread waits in for the other ranks, from its innermost frame outward: the function of a
    communication library's frame (all_reduce, barrier, ...; decorators' wrappers passed over), or `backward`
    for torch's backward entry (DDP's and FSDP's reducers wait from C++ inside it). Frames that only pass a
    call on are looked through; any other frame first (the program's own code, a DataLoader, a file read)
    means the thread is not waiting for the others: None. Only the innermost frames count, so a rank running
    its model's forward under FSDP's or DDP's forward, or its function under torch.distributed.elastic's
    `record`, is not in a collective."""
    for path, _, func in frames:
        if any(path.endswith(p) and func == f for p, f in BACKWARD):
            return BACKWARD_NAME
        if any(p in path for p in COLLECTIVE_PATHS) and not any(p in path for p in NOT_COLLECTIVE):
            if func in WRAPPERS:
                continue
            return func
        if stdlib(path) or any(p in path for p in PASS_PATHS):
            continue
        return None
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
    view["frame"] = where(frames)
    waits_in = collective(frames)
    if waits_in:
        view["collective"] = waits_in


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
