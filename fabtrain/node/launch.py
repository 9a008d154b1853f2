"""The one launcher: how every job process, and the node agent, is started.

    python -I -S <job_dir>/launch.py --exit <job_dir>/run/<name>.exit [--no-subreaper] [--deadline FILE] -- ARGV...

fabtrain.contract.launcher builds that argv (the plan puts it in job.json); node ops writes
this very file into the job directory at start, so it runs before and without
`fab deploy`, with nothing but the standard library. The launcher:

- starts its own session (setsid): the process's group id is the launcher's pid;
- reserves the exit record before anything runs (``<name>.exit.pending.<pid>``,
  written and fsync'ed), so the exit code can be recorded on a full disk: it
  is overwritten in place and renamed to ``<name>.exit``, which needs no new
  disk block;
- becomes a child subreaper (prctl PR_SET_CHILD_SUBREAPER): whatever the
  program orphans, even a process that starts its own session and clears its
  environment, is re-parented to the launcher instead of PID 1, so the agent
  and ``fab kill-all`` still find it among the launcher's descendants;
- forks the program with PR_SET_PDEATHSIG = SIGKILL: a launcher killed
  outright takes the program with it, so nothing runs unsupervised;
- forwards SIGTERM and SIGINT to the program, so stopping either pid stops
  the process; SIGHUP is ignored by both (nohup);
- records the program's exit status the shell's way (128 + n for signal n),
  then reaps orphans until it has no child left, and exits with that status;
- where whoever started it asked (``FABTRAIN_LAUNCH_READY``: a pipe's
  descriptor, taken out of the environment before anything else runs), writes
  the program's pid there the moment it has forked it and closes the pipe, so
  node ops learn the pid by waiting on the pipe instead of polling /proc;
- with ``--deadline FILE`` (a job whose agents fence: the agent never gets it), is the node's dead-man:
  every DEADMAN_POLL s it reads FILE, where the agent publishes the moment (CLOCK_MONOTONIC) by which it
  would have begun its fence (node/deadman.py), and once that moment has passed it ends its program as a
  fence does (SIGTERM and SIGCONT to its group and everything under the launcher, the file's grace,
  SIGKILL) and records FENCED after the exit code, which the agent reports as a fence when it runs
  again. So a node whose agent is stopped (SIGSTOP) or frozen still fences itself in time
  (coordination/fence.py's stop_bound). A missing or unreadable file is no deadline: nothing is ended.

The program is run under ``stdbuf -oL -eL`` where stdbuf exists, so C stdio
writes the log a line at a time.

Stacks on request: the program's environment gets ``FABTRAIN_STACKS``
(``<job_dir>/stacks/<name>``) and ``PYTHONPATH`` led by
``<job_dir>/stacks/hook``, whose ``sitecustomize.py`` (written here) has
every Python process of it (torchrun's workers, forked workers too) register
``faulthandler`` for STACK_SIGNAL, all threads, into its own file
``<job_dir>/stacks/<name>.<pid>.txt``, then imports the user's own ``sitecustomize`` if there is one. The
user's code is unchanged; a program that is not Python, or runs with ``-I``,
``-E`` or ``-S``, installs no handler, and the agent (which checks the
signal's handler in /proc before sending it) leaves it alone.
"""
from __future__ import annotations

import os
import sys

try:  # the C module under `signal`: the same calls and numbers, without the enum module (~8 ms a launcher)
    import _signal as signal
except ImportError:  # an interpreter without it
    import signal

RESERVE = 64  # bytes reserved for the exit record
FENCED = "fenced"  # the exit record's word after the code: the dead-man ended the program (contract/launcher.py)
# Seconds between two reads of the deadline: a SIGTERM at most this late, and the SIGKILL at most this long
# after the grace; two of them fit in coordination/fence.py's KILL_AFTER, so the dead-man keeps stop_bound.
DEADMAN_POLL = 0.5
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
READY_ENV = "FABTRAIN_LAUNCH_READY"  # the descriptor of the pipe that is told the program's pid (spawn.py)
STACK_SIGNAL_OFFSET = 6  # SIGRTMIN + 6: a real-time signal no runtime we know of uses
STACK_HOOK = """\
import os, sys
try:
    import _fabtrain_progress  # progress records (fabtrain/node/progress.py, written here by node ops at start)
except ImportError:
    pass
def _fabtrain_stacks():
    import faulthandler, signal
    prefix = os.environ.get("FABTRAIN_STACKS")
    def register():  # one file a process (every rank of a torchrun, every worker): <prefix>.<pid>.txt
        try:
            faulthandler.register(signal.SIGRTMIN + %d, file=open("%%s.%%d.txt" %% (prefix, os.getpid()), "a"),
                                  all_threads=True)
        except (OSError, ValueError, AttributeError, RuntimeError):
            pass
    if prefix:
        register()
        os.register_at_fork(after_in_child=register)  # a forked child (a DataLoader worker) writes its own
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    spec = PathFinder.find_spec("sitecustomize", sys.path)  # the user's own, if any
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(module_from_spec(spec))
_fabtrain_stacks()
del _fabtrain_stacks
""" % STACK_SIGNAL_OFFSET


def stack_signal() -> int:
    """The signal a program of ours answers with its stacks (see the module's docstring)."""
    return signal.SIGRTMIN + STACK_SIGNAL_OFFSET


def stacks_prefix(job_dir: str, name: str) -> str:
    """FABTRAIN_STACKS: each Python process of `name` writes its stacks into ``<prefix>.<pid>.txt``."""
    return os.path.join(job_dir, "stacks", name)


def stacks_path(job_dir: str, name: str, pid: int) -> str:
    return "%s.%d.txt" % (stacks_prefix(job_dir, name), pid)


def hook_dir(job_dir: str) -> str:
    """Where the program's sitecustomize.py (STACK_HOOK) and the progress hook it imports are written."""
    return os.path.join(job_dir, "stacks", "hook")


def _stack_hook(exit_path: str) -> None:
    """In the program's child, before exec: the environment that makes a Python program dump stacks on request."""
    run = os.path.dirname(os.path.abspath(exit_path))
    job_dir, name = os.path.dirname(run), os.path.basename(exit_path)[:-len(".exit")]
    hook = hook_dir(job_dir)
    try:
        os.makedirs(hook, mode=0o700, exist_ok=True)
        target = os.path.join(hook, "sitecustomize.py")
        tmp = "%s.%d" % (target, os.getpid())
        with open(tmp, "w") as f:
            f.write(STACK_HOOK)
        os.replace(tmp, target)
    except OSError:
        return  # no stacks for this one; it runs all the same
    os.environ["FABTRAIN_STACKS"] = stacks_prefix(job_dir, name)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != hook]
    os.environ["PYTHONPATH"] = os.pathsep.join([hook] + old)


def source() -> str:
    """This file's text, which node ops writes into the job directory."""
    loader = globals().get("__loader__")  # node ops' bundle (fabtrain.remote.rpc) has no file to read
    text = loader.get_source(__name__) if hasattr(loader, "get_source") else None
    if text:
        return text
    with open(__file__) as f:
        return f.read()


def read_exit(path: str):
    """The exit code recorded at path, or None while the process has not ended."""
    return read_exit_record(path)[0]


def read_exit_record(path: str):
    """(the exit code recorded at path or None, whether the dead-man ended the program: FENCED after it)."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None, False
    try:
        return (int(words[0]) if words else None), words[1:2] == [FENCED]
    except ValueError:
        return None, False


class ExitRecord:
    """An exit code that survives a full disk: space reserved first, overwritten in place, renamed."""

    def __init__(self, path: str):
        # Its own pending name: a restarted agent's launcher may reserve while the old one records.
        self.path, self.pending = path, "%s.pending.%d" % (path, os.getpid())
        self.fd = None

    def reserve(self) -> None:
        fd = os.open(self.pending, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b" " * (RESERVE - 1) + b"\n")
            os.fsync(fd)
        except OSError:
            os.close(fd)
            raise
        self.fd = fd

    def write(self, code: int, fenced: bool = False) -> None:
        data = b"%d%s\n" % (code, b" " + FENCED.encode() if fenced else b"")  # contract/launcher.py's exit_text
        if self.fd is None:
            self.reserve()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))  # frees the rest: needs no space
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.pending, self.path)


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except Exception:  # no ctypes, not Linux: run without it
        return False


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _parse(argv):
    exit_path, subreaper, deadline = None, True, None
    while argv and argv[0] != "--":
        flag = argv.pop(0)
        if flag == "--exit" and argv:
            exit_path = argv.pop(0)
        elif flag == "--no-subreaper":
            subreaper = False
        elif flag == "--deadline" and argv:
            deadline = argv.pop(0)
        else:
            raise SystemExit("fabtrain launch: unknown flag %s" % flag)
    program = argv[1:]
    if not exit_path or not program:
        raise SystemExit("usage: launch.py --exit FILE [--no-subreaper] [--deadline FILE] -- ARGV...")
    return exit_path, subreaper, deadline, program


def _on_path(name: str) -> bool:
    """name is an executable in $PATH (shutil.which's answer, without importing shutil and re)."""
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return True
    return False


CPUS_ENV = "FABTRAIN_CPUS"  # the CPUs this process is bound to (a Slurm step's share of its mask: allocation.py)


def _bind_cpus(cpus) -> None:
    """In the program's child, before exec: run on these CPUs only (a list like "2,3"), or say why not."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    except (OSError, ValueError) as e:
        os.write(2, ("fabtrain launch: cannot bind to CPUs %s: %s\n" % (cpus, getattr(e, "strerror", e))).encode())


def _start(program, exit_path: str = "") -> int:
    parent = os.getpid()
    if _on_path("stdbuf"):
        program = ["stdbuf", "-oL", "-eL"] + program
    pid = os.fork()
    if pid:
        return pid
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(128 + signal.SIGKILL)
        # Python ignores SIGPIPE and SIGXFSZ; a program expects the defaults. SIGHUP stays ignored (nohup).
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if exit_path.endswith(".exit"):
            _stack_hook(exit_path)
        _bind_cpus(os.environ.get(CPUS_ENV))
        os.execvp(program[0], program)
    except OSError as e:
        os.write(2, ("fabtrain launch: cannot run %s: %s\n" % (program[0], e.strerror)).encode())
        os._exit(127 if e.errno == 2 else 126)
    except BaseException:
        pass
    os._exit(127)


def _ready_pipe():
    """The pipe spawn.py waits on, if it gave one: out of the environment and closed on exec, so the
    program inherits neither."""
    value = os.environ.pop(READY_ENV, None)
    try:
        fd = int(value)
        os.set_inheritable(fd, False)
        return fd
    except (TypeError, ValueError, OSError):
        return None


def _tell_ready(fd, child: int) -> None:
    try:
        os.write(fd, b"%d\n" % child)
    except OSError:
        pass  # nobody waits any more: the pid is still found among the launcher's children
    os.close(fd)


def main(argv) -> int:
    ready = _ready_pipe()  # first: an early exit below closes it, which tells the waiter as much
    exit_path, subreaper, deadline, program = _parse(list(argv))
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader (started by the agent's keeper)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    record = ExitRecord(exit_path)
    try:
        record.reserve()
    except OSError as e:
        sys.stderr.write("fabtrain launch: cannot reserve the exit record %s: %s\n" % (record.pending, e.strerror))
        return 1
    if subreaper:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    child = _start(program, exit_path)
    if ready is not None:
        _tell_ready(ready, child)
    state = {"code": None}

    def forward(sig, frame):
        if state["code"] is None:
            targets = [child]
        else:  # the program is gone: pass it on to what it left behind
            targets = _children(os.getpid())
        for pid in targets:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    deadman = Deadman(deadline, os.getpid()) if deadline else None
    if deadman is not None:  # after the fork: the program inherits no timer (and exec resets the handler)
        signal.signal(signal.SIGALRM, deadman.on_alarm)
        signal.setitimer(signal.ITIMER_REAL, DEADMAN_POLL, DEADMAN_POLL)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child and state["code"] is None:
            state["code"] = _exit_code(status)
            try:
                record.write(state["code"], deadman is not None and deadman.term_at is not None)
            except OSError as e:
                sys.stderr.write("fabtrain launch: cannot record exit code %d in %s: %s\n"
                                 % (state["code"], exit_path, e.strerror))
    if deadman is not None:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return state["code"] if state["code"] is not None else 1


def _children(pid: int):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _monotonic() -> float:
    import time  # only a launcher with a deadline needs it
    return time.monotonic()  # CLOCK_MONOTONIC: system-wide, the agent's clock too


def read_deadline(text: str):
    """(deadline, grace), or None: contract/launcher.py's read_deadline (this file imports nothing of fabtrain)."""
    try:
        at, grace = (float(x) for x in text.split())
    except ValueError:
        return None
    if not (at == at and abs(at) != float("inf") and 0 <= grace < 3600):  # NaN, inf: no deadline
        return None
    return at, grace


def deadline_due(path: str, now: float):
    """The grace to end the program with, where the deadline published at `path` has passed; else None. A
    missing or unreadable file is no deadline (a read error never ends anything)."""
    try:
        with open(path) as f:
            found = read_deadline(f.read(200))
    except (OSError, UnicodeDecodeError):
        return None
    return found[1] if found is not None and now >= found[0] else None


def _family(me: int, group: int):
    """Every live process of the launcher's group and under it (its program, what the program started,
    orphans re-parented to it), the launcher excepted."""
    found, todo = set(), [me]
    while todo:
        for kid in _children(todo.pop()):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    try:
        names = os.listdir("/proc")
    except OSError:
        names = []
    for name in names:
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                if int(fields[2]) == group:  # the launcher's process group (it leads it: setsid)
                    found.add(int(name))
            except (OSError, IndexError, ValueError):
                continue
    found.discard(me)
    return sorted(found)


class Deadman:
    """The dead-man (the module's docstring): checked every DEADMAN_POLL s from SIGALRM, in the main thread."""

    def __init__(self, path: str, me: int):
        self.path, self.me = path, me
        self.term_at = None  # when it sent SIGTERM: the program is ending, whatever the file says next
        self.grace = 0.0
        self.killed = False

    def on_alarm(self, sig, frame) -> None:
        try:
            self.check(_monotonic())
        except Exception:  # noqa: BLE001 - never in the way of the launcher's own work (waitpid, the record)
            pass

    def check(self, now: float) -> None:
        if self.term_at is None:
            grace = deadline_due(self.path, now)
            if grace is None:
                return
            self.term_at, self.grace = now, grace
            # os.write: this runs in a signal handler, maybe while the main code writes to sys.stderr
            os.write(2, ("fabtrain launch: the agent's fence deadline in %s passed unrenewed (the agent is stopped "
                         "or frozen): ending the program (SIGTERM, %g s, SIGKILL)\n" % (self.path, grace)).encode())
            self._send(signal.SIGTERM)
            self._send(signal.SIGCONT)  # a stopped process acts on its SIGTERM
        elif not self.killed and now - self.term_at >= self.grace:
            self.killed = True
            self._send(signal.SIGKILL)

    def _send(self, sig: int) -> None:
        for pid in _family(self.me, os.getpgrp()):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
