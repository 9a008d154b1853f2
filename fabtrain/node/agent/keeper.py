"""The agent's own life: one agent per job per node, its run record, and the keeper that restarts it.

An agent killed outright (SIGKILL, the OOM killer) cannot clean up, and a node
without its agent is a node nobody watches. So each agent starts a keeper: an
idle ``sh`` in its own session, blocked in ``read`` on a pipe only the agent
writes to. The agent writes a line when it ends on purpose (the keeper exits);
when it dies the kernel closes the pipe and the keeper execs a new agent
through the launcher, exactly as job.json's ``agent.launch`` says.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from fabtrain.contract.launcher import SCRIPT, is_launcher, launch_command
from fabtrain.node import atomic, gpulease, launch, procfs
from fabtrain.contract.states import describe_end
from fabtrain.contract.jobfolder import JobFolder

_KEEPER = 'if read line; then exit 0; fi; exec "$@" </dev/null'
MAX_RESTARTS = 5


class AgentLife:
    def __init__(self, job_dir: str, job: dict, workspace: str):
        self.jd, self.job, self.ws = job_dir, job, workspace
        self.run_dir = JobFolder(job_dir).run
        self.record_path = os.path.join(self.run_dir, "agent.json")
        self.exit_path = os.path.join(self.run_dir, "agent.exit")
        self.pid = os.getpid()
        self.launcher: int | None = None  # our launcher, which records our exit code
        self.lock_fd: int | None = None
        self.keeper: subprocess.Popen | None = None
        self.keeper_w: int | None = None

    # -- one agent per job per node -------------------------------------------------------------

    def lock(self) -> bool:
        """Hold run/agent.lock for our whole life; False if another agent of this job holds it."""
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(os.path.join(self.run_dir, "agent.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.time() + 3  # a previous agent may still be on its way out
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.lock_fd = fd
                return True
            except OSError:
                if time.time() > deadline:
                    os.close(fd)
                    return False
                time.sleep(0.1)

    # -- run/agent.json ---------------------------------------------------------------------

    def register(self) -> str | None:
        """Make run/agent.json name this agent; a sentence for the event if we took over from a dead one."""
        ppid = os.getppid()
        launcher = ppid if is_launcher(procfs.cmdline(ppid)) else None
        record = atomic.read_json(self.record_path)
        if record is None and launcher:
            deadline = time.time() + 2  # node ops writes agent.json just after starting us
            while record is None and time.time() < deadline:
                time.sleep(0.05)
                record = atomic.read_json(self.record_path)
        if record and launcher and record.get("pid") == launcher:
            self.launcher = launcher
            return None  # started by node ops: all in order
        previous = record.get("pid") if record else None
        if previous and previous not in (launcher, self.pid):
            deadline = time.time() + 2  # let the old launcher record its agent's end and go
            while time.time() < deadline and procfs.alive(previous, record.get("create_time")):
                time.sleep(0.05)
        old_exit = launch.read_exit(self.exit_path)
        try:
            os.unlink(self.exit_path)
        except OSError:
            pass
        self.write_record(launcher)
        if record is None:
            return None
        how = describe_end(old_exit) if old_exit is not None else "gone without an exit code"
        return "the previous agent (launcher %s) ended (%s); this one (pid %d) took over" % (previous, how, self.pid)

    def write_record(self, launcher: int | None) -> None:
        self.launcher = launcher
        me = launcher or self.pid
        proc, mine = procfs.stat(me), procfs.stat(self.pid)
        atomic.write_json(self.record_path, {
            "name": "agent", "role": "agent", "rank": self.job.get("node_index", 0), "pid": me,
            "pgid": os.getpgid(me), "create_time": proc.create_time if proc else time.time(),
            "program_pid": self.pid, "program_create_time": mine.create_time if mine else time.time(),
            "argv": [sys.executable, "-m", "fabtrain.node.agent", self.jd], "started_at": time.time()})

    def launcher_gone(self) -> int | None:
        """Our launcher's pid if it has gone (someone killed it); we then name ourselves."""
        if self.launcher is None or os.getppid() == self.launcher:
            return None
        gone = self.launcher
        self.write_record(None)
        return gone

    def record_exit(self, code: int) -> None:
        """With no launcher of ours, we record our own exit code."""
        if self.launcher is None:
            try:
                launch.ExitRecord(self.exit_path).write(code)
            except OSError:
                pass

    # -- the keeper ---------------------------------------------------------------------------

    def restart_argv(self) -> list[str]:
        spec = self.job.get("agent") or {}
        argv = [a.replace("$WS", self.ws) for a in spec.get("launch") or []]
        if not argv:
            argv = launch_command(sys.executable, self.jd, self.exit_path,
                                  [sys.executable, "-m", "fabtrain.node.agent", self.jd], subreaper=False)
        script = os.path.join(self.jd, SCRIPT)
        if not os.path.exists(script):
            atomic.write(script, launch.source())
        return argv + ["--restarted"]

    def start_keeper(self) -> str | None:
        """Start the keeper; a sentence for an agent_error event if there is none."""
        restarts = int(os.environ.get("FABTRAIN_AGENT_RESTARTS", "0") or 0)
        if restarts >= MAX_RESTARTS:
            return "the agent was restarted %d times; no keeper this time" % restarts
        r, w = os.pipe()
        env = dict(os.environ, FABTRAIN_AGENT_RESTARTS=str(restarts + 1))
        try:
            self.keeper = subprocess.Popen(["sh", "-c", _KEEPER, "fabtrain-keeper", *self.restart_argv()],
                                           stdin=r, env=env, close_fds=True, start_new_session=True,
                                           pass_fds=gpulease.inherited())  # a restarted agent holds them too
        except OSError as e:
            os.close(w)
            return "cannot start the keeper: %s" % e
        finally:
            os.close(r)
        self.keeper_w = w
        return None

    def stop_keeper(self) -> None:
        if self.keeper_w is not None:
            try:
                os.write(self.keeper_w, b"stop\n")
            except OSError:
                pass
            os.close(self.keeper_w)
            self.keeper_w = None
        if self.keeper is not None:
            try:
                self.keeper.wait(2)
            except subprocess.TimeoutExpired:
                self.keeper.kill()
            self.keeper = None

    def check_keeper(self) -> str | None:
        """Start a new keeper if ours died."""
        if self.keeper is None or self.keeper.poll() is None:
            return None
        self.keeper = None
        if self.keeper_w is not None:
            os.close(self.keeper_w)
            self.keeper_w = None
        return self.start_keeper()

    @property
    def keeper_pid(self) -> int | None:
        return self.keeper.pid if self.keeper else None
