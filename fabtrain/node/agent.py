"""The node agent (watchdog): ``python -m fabtrain.node.agent <job_dir>``.

Started with the job on every node by ``node_ops start`` (one per node per
job, cwd ``<workspace>/code``). Every ``watchdog.interval`` it writes
``health.json`` (host, GPUs, every job process); it acts on what it sees and
writes each action, with its reason, to ``events.jsonl``:

- a job process that exits non-zero (or is killed by a signal) fails the job;
- a process that is stopped, or makes no progress (no metrics record, no log
  output, no CPU time) for ``hang_timeout`` is hung: SIGTERM to its group,
  ``grace``, SIGKILL; the job has failed;
- defunct children are reported; a parent that leaves them unreaped while
  the job is ending is killed so they are reaped;
- processes with this workspace's job marker that belong to no running job,
  or that outlived their main process, are killed (orphans);
- a failed job is torn down on every node at once (``on_failure: kill-job``)
  or left for debugging (``keep``); a job whose trainers all exited 0 is
  finished: the pservers are stopped and the agents exit.

Cluster-wide fail-fast needs no controller: the agents share the job's status
through the first node's agent (see coordination/). The agent exits once
nothing of its job is left on the node, after a last snapshot. A "keeper"
(an idle ``sh`` holding a pipe to the agent) starts it again if it is killed
outright. See docs/watchdog.md.

Kept small on purpose: stdlib only (plus nvidia-ml-py where an NVIDIA driver
is present); no torch, no psutil.
"""
from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback

from . import health
from .coordination import FINAL, Client, Coordinator

# The launch wrapper (orchestrator/plan.py LAUNCH_PREFIX), used only if the
# agent's own wrapper cannot be read from /proc to restart the agent the same way.
_WRAPPER = ('stdbuf -oL -eL "$@"; rc=$?; '
            'echo $rc > "$FABTRAIN_EXIT_FILE.tmp" && mv -f "$FABTRAIN_EXIT_FILE.tmp" "$FABTRAIN_EXIT_FILE"; '
            "exit $rc")
# The keeper: waits on a pipe only the agent writes to. A line ("stop") means
# the agent ended on purpose; end of file means it died: start it again.
_KEEPER = 'if read line; then exit 0; fi; exec "$@" </dev/null'
MAX_RESTARTS = 5
ORPHAN_MIN_AGE = 5.0  # a process younger than this may be one node_ops is starting right now
CPU_PROGRESS = 0.01  # CPU seconds per second (1% of a core) that count as progress


def signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "signal %d" % sig


def read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def atomic_write(path: str, text: str) -> None:
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def mtime(path: str | None) -> float | None:
    if not path:
        return None
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Tracked:
    """One process of the job on this node (job.json `processes` entry)."""

    def __init__(self, spec: dict, jd: str, ws: str):
        self.name, self.role, self.rank = spec["name"], spec["role"], spec["rank"]
        self.spec = spec
        self.run_path = os.path.join(jd, "run", self.name + ".json")
        self.exit_path = os.path.join(jd, "run", self.name + ".exit")
        self.metrics_path = (spec.get("metrics") or "").replace("$WS", ws) or None
        self.log_path = (spec.get("log") or "").replace("$WS", ws) or None
        self.run: dict | None = None
        self.wrapper: int | None = None  # the sh wrapper: session and group leader
        self.program: int | None = None  # its child, the real program
        self.program_ctime: float | None = None
        self.state = "not started"
        self.exit_code: int | None = None
        self.signal: str | None = None
        self.ended = False
        self.ended_at: float | None = None
        self.members: list[int] = []  # live pids of its process group
        self.tree: list[int] = []  # live descendants of the program
        self.cpu_seen: float | None = None
        self.cpu_progress: float | None = None
        self.last_progress: float | None = None
        self.stopped_since: float | None = None
        self.cpu_percent = 0.0
        self.rss = 0
        self.zombies: list[int] = []
        self.kill_reason: str | None = None
        self.kill_signal: str | None = None
        self.term_at: float | None = None
        self.hung = False
        self.reported = False  # its end is in events.jsonl
        self.children = 0
        self.gpu_mem = None
        self.pidfds: dict[int, int] = {}  # pid -> fd

    @property
    def started(self) -> bool:
        return self.run is not None

    @property
    def live(self) -> bool:
        return self.started and not self.ended


class Agent:
    def __init__(self, job_dir: str, restarted: bool = False):
        self.jd = os.path.abspath(job_dir)
        self.ws = os.path.dirname(os.path.dirname(self.jd))
        self.job = self._load_job()
        self.job_id = self.job["job_id"]
        self.node = self.job["node"]
        w = self.job.get("watchdog") or {}
        self.interval = float(w.get("interval", 1.0))
        self.hang_timeout = float(w.get("hang_timeout", 120.0))
        self.grace = float(w.get("grace", 5.0))
        self.on_failure = w.get("on_failure", "kill-job")
        coord = w.get("coordinator") or {}
        nodes = [n["name"] for n in self.job.get("nodes", [])] or [self.node]
        self.coord_host = coord.get("host", "127.0.0.1")
        self.coord_port = int(coord.get("port", 7180))
        self.coord_secret = coord.get("secret")
        self.is_coordinator = nodes[0] == self.node
        self.peer_timeout = max(5 * self.interval, 5.0)
        self.restarted = restarted
        self.started = time.time()
        self.pid = os.getpid()
        self.events_path = os.path.join(self.jd, "events.jsonl")
        self.health_path = os.path.join(self.jd, "health.json")
        self.event_lock = threading.Lock()

        self.tracked = [Tracked(p, self.jd, self.ws) for p in self.job.get("processes", [])]
        self.by_name = {t.name: t for t in self.tracked}
        self.trainers_expected = self._trainers_expected()

        # The job's status as this agent knows it.
        self.status = {"status": "running", "reason": None, "node": None}
        self.acted = False  # teardown / keep decided for a final status
        self.local_failure: dict | None = None
        self.coord_view: dict = {}
        self.coord_lost_reported = False

        self.procs: dict[int, health.Proc] = {}
        self.table = health.ProcTable()
        self.hot: set[int] = set()  # pids re-read every step: the job's processes and their families
        self.gpu_pids: dict[int, int] = {}
        self.is_done = False
        self.kids: dict[int, list[int]] = {}
        self.env_cache: dict[tuple[int, float], tuple | None] = {}
        self.orphans: dict[int, dict] = {}  # pid -> {reason, term_at, signal}
        self.zombies_seen: set[tuple[int, float]] = set()
        self.zombie_parents_killed: set[int] = set()
        self.recent: list[dict] = []  # the last few events, for health.json

        self.host = health.HostSampler(self.ws if os.path.isdir(self.ws) else "/")
        self.gpus = health.GpuSampler()
        self.own_cpu = self._own_cpu()
        self.own_t = time.monotonic()
        self.agent_cpu_percent = 0.0

        self.stop_signal: int | None = None
        self.keeper: subprocess.Popen | None = None
        self.keeper_w: int | None = None
        self.lock_fd: int | None = None
        self.write_exit_file = False  # no wrapper of ours writes run/agent.exit
        self.wrapper: int | None = None
        self.coordinator: Coordinator | None = None
        self.client: Client | None = None
        self.msgs: list[dict] = []
        self.msgs_lock = threading.Lock()
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None, None))
        self.done_since: float | None = None
        self.final_since: float | None = None

    # -- setup -----------------------------------------------------------------------------

    def _load_job(self) -> dict:
        path = os.path.join(self.jd, "job.json")
        deadline = time.time() + 5
        while True:
            job = read_json(path)
            if isinstance(job, dict) and job.get("job_id"):
                return job
            if time.time() > deadline:
                raise SystemExit("agent: no job.json in %s" % self.jd)
            time.sleep(0.1)

    def _trainers_expected(self) -> int | None:
        for p in self.job.get("processes", []):
            env = p.get("env") or {}
            for key in ("PADDLE_INIT_NUM_GRADIENT_SERVERS", "PADDLE_TRAINERS_NUM", "WORLD_SIZE"):
                if str(env.get(key, "")).isdigit():
                    if p["role"] == "trainer" and any(a.startswith("--nnodes") for a in p.get("argv", [])):
                        break  # torchrun: one trainer process per node, not per rank
                    return int(env[key])
        return None

    def setup(self) -> None:
        self._take_lock()
        self._register()
        self._start_keeper()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self._replay_events()
        if self.is_coordinator:
            self.coordinator = Coordinator(self.job_id, self.coord_host, self.coord_port,
                                           [n["name"] for n in self.job.get("nodes", [])], self.interval,
                                           self.peer_timeout, os.path.join(self.jd, "coordinator.json"),
                                           on_event=self._coordinator_event, secret=self.coord_secret)
            self.coordinator.start()
            if not self.coordinator.wait_listening(self.coordinator.bind_wait + 5):
                # The coordinator wrote why (coordinator_error). Agents refuse whatever holds the
                # port, so this job has no coordinator: fail the start (node_ops reports it).
                self._shutdown(exit_code=1)
                raise SystemExit(1)
        self.client = Client(self.coord_host, self.coord_port, self.interval, self._on_message,
                             secret=self.coord_secret, job_id=self.job_id, node=self.node,
                             on_event=self._coordinator_event)
        self.client.start()

    def _take_lock(self) -> None:
        """One agent per job per node: a lock held for the agent's whole life."""
        os.makedirs(os.path.join(self.jd, "run"), exist_ok=True)
        fd = os.open(os.path.join(self.jd, "run", "agent.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.time() + 3  # a previous agent may still be on its way out
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.lock_fd = fd
                return
            except OSError:
                if time.time() > deadline:
                    os.close(fd)
                    print("agent: another agent of job %s is running on this node; exiting" % self.job_id, flush=True)
                    raise SystemExit(0)
                time.sleep(0.1)

    def _register(self) -> None:
        """Make run/agent.json name this agent (after a restart, or if its wrapper is gone)."""
        path = os.path.join(self.jd, "run", "agent.json")
        exit_path = os.path.join(self.jd, "run", "agent.exit")
        ppid = os.getppid()
        wrapper = ppid if "fabtrain-run" in health.cmdline(ppid) else None
        record = read_json(path)
        if record is None and wrapper:
            # node_ops writes agent.json just after starting us: give it a moment.
            deadline = time.time() + 2
            while record is None and time.time() < deadline:
                time.sleep(0.05)
                record = read_json(path)
        if record and wrapper and record.get("pid") == wrapper:
            self.wrapper = wrapper
            return  # started by node_ops: all in order
        previous = record.get("pid") if record else None
        if previous and previous not in (wrapper, self.pid):
            deadline = time.time() + 2  # let the old wrapper write agent.exit and go
            while time.time() < deadline:
                p = health.read_proc(previous)
                if p is None or p.dead or abs(p.create_time - record.get("create_time", 0)) > 1:
                    break
                time.sleep(0.05)
        old_exit = None
        try:
            with open(exit_path) as f:
                old_exit = f.read().strip()
            os.unlink(exit_path)
        except OSError:
            pass
        self._write_record(wrapper)
        if record is not None:
            how = ("exit code %s" % old_exit) if old_exit else "gone without an exit code"
            if old_exit and old_exit.isdigit() and int(old_exit) > 128:
                how = "killed by %s" % signame(int(old_exit) - 128)
            self.event("agent_restarted", reason="the previous agent (group %s) died (%s); this one (pid %d) took over"
                       % (previous, how, self.pid))

    def _write_record(self, wrapper: int | None) -> None:
        """run/agent.json: the wrapper that will write agent.exit, or the agent itself if it has none."""
        self.wrapper = wrapper
        me = wrapper or self.pid
        proc = health.read_proc(me)
        atomic_write(os.path.join(self.jd, "run", "agent.json"), json.dumps({
            "name": "agent", "role": "agent", "rank": self.job.get("node_index", 0), "pid": me,
            "pgid": os.getpgid(me), "create_time": proc.create_time if proc else time.time(),
            "argv": [sys.executable, "-m", "fabtrain.node.agent", self.jd], "started_at": time.time()}))
        self.write_exit_file = wrapper is None

    def _restart_argv(self) -> list[str]:
        argv = health.cmdline(os.getppid())
        if len(argv) > 4 and argv[3] == "fabtrain-run":
            prefix = argv[:4]  # sh -c <wrapper> fabtrain-run
        else:
            prefix = ["sh", "-c", _WRAPPER, "fabtrain-run"]
        # The keeper is a session leader already (start_new_session): the wrapper it execs is one too.
        return ["nohup", *prefix, sys.executable, "-m", "fabtrain.node.agent", self.jd, "--restarted"]

    def _start_keeper(self) -> None:
        restarts = int(os.environ.get("FABTRAIN_AGENT_RESTARTS", "0") or 0)
        if restarts >= MAX_RESTARTS:
            self.event("agent_error", reason="the agent was restarted %d times; no keeper this time" % restarts)
            return
        r, w = os.pipe()
        env = dict(os.environ, FABTRAIN_AGENT_RESTARTS=str(restarts + 1))
        try:
            self.keeper = subprocess.Popen(["sh", "-c", _KEEPER, "fabtrain-keeper", *self._restart_argv()],
                                           stdin=r, env=env, close_fds=True, start_new_session=True)
        except OSError as e:
            self.event("agent_error", reason="cannot start the keeper: %s" % e)
            os.close(w)
            return
        finally:
            os.close(r)
        self.keeper_w = w

    def _stop_keeper(self) -> None:
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

    def _check_keeper(self) -> None:
        if self.wrapper is not None and os.getppid() != self.wrapper:
            # Someone killed our wrapper (the pid in run/agent.json): name ourselves there instead.
            gone = self.wrapper
            self._write_record(None)
            self.write_exit_file = True
            self.event("agent_wrapper_lost", "the agent's wrapper (pid %d) is gone; run/agent.json now names the "
                       "agent itself (pid %d)" % (gone, self.pid))
        if self.keeper is not None and self.keeper.poll() is not None:
            self.keeper = None
            if self.keeper_w is not None:
                os.close(self.keeper_w)
                self.keeper_w = None
            self._start_keeper()

    def _replay_events(self) -> None:
        """A restarted agent (or one started into an ended job) learns the job's status from events.jsonl."""
        try:
            with open(self.events_path) as f:
                lines = f.readlines()
        except OSError:
            return
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("kind") == "job_failed" and self.status["status"] == "running":
                self.status = {"status": "failed", "reason": ev.get("reason"), "node": ev.get("origin")}
            elif ev.get("kind") == "finished" and self.status["status"] == "running":
                self.status = {"status": "finished", "reason": ev.get("reason"), "node": None}
            elif ev.get("kind") in ("teardown", "kept", "finished"):
                self.acted = True
            if ev.get("kind") in ("exited", "killed") and ev.get("name") in self.by_name and ev.get("node") == self.node:
                self.by_name[ev["name"]].reported = True

    def _on_signal(self, sig, frame) -> None:
        self.stop_signal = sig
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _on_message(self, msg: dict) -> None:
        with self.msgs_lock:
            self.msgs.append(msg)
        self._wake()

    # -- events ------------------------------------------------------------------------------

    def event(self, kind: str, reason: str, t: Tracked | None = None, **fields) -> dict:
        ev = {"ts": round(time.time(), 3), "node": self.node, "kind": kind}
        if t is not None:
            ev.update(role=t.role, rank=t.rank, name=t.name)
        ev["reason"] = reason
        ev.update({k: v for k, v in fields.items() if v is not None})
        line = json.dumps(ev) + "\n"
        with self.event_lock:
            fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())  # one write of one line: never interleaved with kill-all's
            finally:
                os.close(fd)
            self.recent = (self.recent + [ev])[-5:]
        who = (" " + t.name) if t is not None else ""
        sys.stdout.write("%s %s%s: %s\n" % (time.strftime("%H:%M:%S"), kind, who, reason))
        sys.stdout.flush()
        return ev

    def _coordinator_event(self, kind: str, reason: str, node: str | None = None) -> None:
        self.event(kind, reason, peer=node)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        self.setup()
        self.event("agent_started", reason="watching %d process(es) of job %s; interval %g s, hang_timeout %g s, "
                   "on_failure %s; coordinator %s:%d%s" % (
                       len(self.tracked), self.job_id, self.interval, self.hang_timeout, self.on_failure,
                       self.coord_host, self.coord_port, " (hosted here)" if self.is_coordinator else ""))
        next_tick = 0.0
        needed = True
        while True:
            now = time.monotonic()
            tick = now >= next_tick
            if tick:
                next_tick = now + self.interval
            if tick or needed:
                self.step(tick)
            if self.stop_signal is not None:
                return self.stop(signame(self.stop_signal))
            if self.should_exit():
                return self.finish()
            deadline = min(next_tick, self.next_deadline())
            needed = False
            for key, _ in self.sel.select(max(0.0, deadline - time.monotonic())):
                kind, t, pid = key.data
                if kind == "wake":
                    try:
                        while os.read(self.wake_r, 4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                else:  # a pidfd: that process has ended
                    self._close_pidfd(t, pid)
                    needed = True
            # A reply to a beat changes nothing; a new job status, a signal or a deadline does.
            needed = needed or self._handle_messages() or self.stop_signal is not None or \
                time.monotonic() >= deadline - 0.001

    def next_deadline(self) -> float:
        """The soonest moment something must be checked between ticks (grace ends, hang deadlines)."""
        now_m, now = time.monotonic(), time.time()
        soon = now_m + self.interval
        watching = self.status["status"] == "running" or self.on_failure == "keep"
        for t in self.tracked:
            if t.term_at is not None and t.live and t.kill_signal == "SIGTERM":
                soon = min(soon, now_m + max(0.02, t.term_at + self.grace - now))
            elif watching and t.live and t.term_at is None and t.last_progress is not None and not t.hung:
                soon = min(soon, now_m + max(0.02, t.last_progress + self.hang_timeout - now))
        for o in self.orphans.values():
            if o["signal"] == "SIGTERM":
                soon = min(soon, now_m + max(0.02, o["term_at"] + self.grace - now))
        return soon

    def step(self, tick: bool) -> None:
        self._handle_messages()
        self.procs, _ = self.table.refresh(self.hot)
        self.kids = health.children_map(self.procs)
        if tick and self.gpus.nvml is not None:
            self.gpu_pids = self.gpus.pids()
        now = time.time()
        for t in self.tracked:
            self._update(t, now, tick)
        self._check_exits(now)
        if self.status["status"] == "running" or self.on_failure == "keep":
            self._check_hangs(now)
        self._check_orphans(now)
        self._act()
        self._check_zombies()
        self._escalate(now)
        if tick:
            self._check_keeper()
            self._check_coordinator_contact()
            self.write_health(now)
        self._beat(urgent=not tick)
        self._update_hot()

    def _update_hot(self) -> None:
        hot = {self.pid}
        for t in self.tracked:
            if t.wrapper:
                hot.add(t.wrapper)
                hot.update(health.descendants(t.wrapper, self.kids))
            hot.update(t.members)
            hot.update(t.tree)
        hot.update(self.orphans)
        marked = [key[0] for key, m in self.env_cache.items() if m is not None]
        hot.update(marked)
        for pid in marked:
            hot.update(health.descendants(pid, self.kids))
        self.hot = hot

    # -- process states ---------------------------------------------------------------------------

    def _alive(self, pid: int | None, ctime: float | None = None) -> bool:
        if pid is None:
            return False
        p = self.procs.get(pid)
        return p is not None and not p.dead and (ctime is None or abs(p.create_time - ctime) < 1.0)

    def _update(self, t: Tracked, now: float, tick: bool) -> None:
        if t.run is not None:
            pgid = t.run.get("pgid", t.wrapper)
            t.members = [p.pid for p in self.procs.values() if p.pgid == pgid and not p.dead]
        if t.run is None:
            run = read_json(t.run_path)
            if not run or "pid" not in run:
                return
            t.run, t.wrapper = run, run["pid"]
            if t.wrapper not in self.procs:
                # Started after this step's /proc listing (node_ops starts the coordinator's agent
                # before the job): read it now, or it would look like it had already ended.
                p = health.read_proc(t.wrapper)
                if p is not None:
                    self.procs[t.wrapper] = p
            t.state = "running"
            t.last_progress = max(run.get("started_at") or now, self.started if self.restarted else 0)
            self._open_pidfd(t, t.wrapper)
            pgid = run.get("pgid", t.wrapper)
            t.members = [p.pid for p in self.procs.values() if p.pgid == pgid and not p.dead]
        if t.ended:
            return
        wrapper_alive = self._alive(t.wrapper, t.run.get("create_time"))
        if t.program is None and wrapper_alive:
            # The program is the wrapper's child (stdbuf execs it).
            kids = [k for k in self.kids.get(t.wrapper, ()) if k in self.procs and not self.procs[k].dead]
            if kids:
                t.program, t.program_ctime = kids[0], self.procs[kids[0]].create_time
                self._open_pidfd(t, t.program)
        program_alive = self._alive(t.program, t.program_ctime)
        if program_alive or wrapper_alive:
            main = self.procs[t.program if program_alive else t.wrapper]
            t.state = health.STATE_NAMES.get(main.state, "running")
            t.tree = ([t.program] + health.descendants(t.program, self.kids)) if program_alive else []
            t.tree = [p for p in t.tree if p in self.procs]
            t.zombies = [p for p in t.tree if self.procs[p].dead]
            live_tree = [p for p in t.tree if not self.procs[p].dead]
            cpu = sum(self.procs[p].cpu for p in live_tree)
            t.rss = sum(self.procs[p].rss for p in live_tree)
            t.children = len(live_tree) - 1 if live_tree else 0
            if self.gpu_pids:
                t.gpu_mem = sum(self.gpu_pids.get(p, 0) for p in live_tree)
            if t.cpu_seen is not None and tick:
                dt = max(1e-3, self.interval)
                delta = cpu - t.cpu_seen
                t.cpu_percent = round(100.0 * max(0.0, delta) / dt, 1)
                if delta >= max(CPU_PROGRESS * dt, 1.0 / health.CLK_TCK):
                    t.cpu_progress = now
            if t.cpu_seen is None or tick:
                t.cpu_seen = cpu
            if t.state == "stopped":
                t.stopped_since = t.stopped_since or now
            else:
                t.stopped_since = None
            t.last_progress = max(x for x in (t.last_progress, t.cpu_progress, mtime(t.metrics_path),
                                              mtime(t.log_path)) if x is not None)
            return
        # Neither the wrapper nor the program lives: the process has ended.
        t.ended, t.ended_at = True, now
        t.tree, t.zombies, t.cpu_percent, t.rss = [], [], 0.0, 0
        code = None
        try:
            with open(t.exit_path) as f:
                code = int(f.read().strip())
        except (OSError, ValueError):
            pass
        t.exit_code = code
        if code is not None and code > 128 and code - 128 < 65:
            t.state, t.signal = "killed", signame(code - 128)
        elif code is not None:
            t.state = "exited"
        else:
            t.state, t.signal = "killed", t.kill_signal  # the wrapper itself was killed: no exit code
        for pid in list(t.pidfds):
            self._close_pidfd(t, pid)

    def _open_pidfd(self, t: Tracked, pid: int) -> None:
        if pid in t.pidfds or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        t.pidfds[pid] = fd
        self.sel.register(fd, selectors.EVENT_READ, ("pidfd", t, pid))

    def _close_pidfd(self, t: Tracked, pid: int) -> None:
        fd = t.pidfds.pop(pid, None)
        if fd is not None:
            try:
                self.sel.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)

    def _check_exits(self, now: float) -> None:
        for t in self.tracked:
            if not t.ended or t.reported:
                continue
            t.reported = True
            how = ("exited with code %d" % t.exit_code) if t.state == "exited" else (
                "killed by %s" % t.signal if t.signal else "ended without an exit code (its wrapper was killed)")
            if t.exit_code is not None and t.state == "killed":
                how += " (exit code %d)" % t.exit_code
            if t.kill_reason:
                self.event("killed", "%s: %s" % (how, t.kill_reason), t, signal=t.kill_signal, exit_code=t.exit_code,
                           pid=t.program or t.wrapper)
                continue
            killed_by_fab = os.path.exists(os.path.join(self.jd, "killed"))
            if killed_by_fab:
                self.event("exited", "%s: stopped by fab kill-all" % how, t, exit_code=t.exit_code, signal=t.signal)
                self.fail("%s on %s: stopped by fab kill-all" % (t.name, self.node))
                continue
            self.event("exited", how, t, exit_code=t.exit_code, signal=t.signal, pid=t.program or t.wrapper)
            if t.exit_code != 0:
                self.fail("%s on %s %s" % (t.name, self.node, how))

    def _check_hangs(self, now: float) -> None:
        running_trainers = any(t.role == "trainer" and t.live for t in self.tracked) or \
            bool(self.coord_view.get("trainers_running"))
        for t in self.tracked:
            if not t.live or t.hung or t.term_at is not None or t.last_progress is None:
                continue
            if t.role != "trainer" and not running_trainers and t.state != "stopped":
                # A pserver waits for trainers in silence: only a hang while trainers run counts.
                t.last_progress = now
                continue
            reason = None
            if t.stopped_since is not None and now - min(t.stopped_since, t.last_progress) >= self.hang_timeout:
                reason = "stopped (SIGSTOP) for %.0f s; hang_timeout %g s" % (
                    now - min(t.stopped_since, t.last_progress), self.hang_timeout)
            elif now - t.last_progress >= self.hang_timeout:
                reason = "no progress for %.0f s (no metrics record, no log output, no CPU time; hang_timeout %g s)" % (
                    now - t.last_progress, self.hang_timeout)
            if reason is None:
                continue
            t.hung = True
            if self.on_failure == "keep":
                self.event("hang", reason + "; not killed: on_failure is keep", t, pid=t.program or t.wrapper)
            else:
                self.event("hang", reason, t, signal="SIGTERM", pid=t.program or t.wrapper)
                self.terminate(t, "hang: " + reason)
            self.fail("%s on %s hung: %s" % (t.name, self.node, reason))

    def _check_zombies(self) -> None:
        ending = self.status["status"] in FINAL and self.on_failure != "keep" or self.status["status"] == "finished"
        for t in self.tracked:
            for z in t.zombies:
                p = self.procs.get(z)
                if p is None or p.ppid == 1:
                    continue
                key = (z, p.create_time)
                if key not in self.zombies_seen:
                    self.zombies_seen.add(key)
                    self.event("zombie", "pid %d is defunct: its parent pid %d has not reaped it" % (z, p.ppid), t,
                               pid=z, parent=p.ppid)
                if p.ppid == t.program:
                    # The program itself gets its SIGTERM first, and `interval` to act on it.
                    ending_here = t.term_at is not None and time.time() - t.term_at >= min(self.grace, self.interval)
                else:
                    ending_here = ending or t.term_at is not None
                if ending_here and p.ppid not in self.zombie_parents_killed and \
                        self._alive(p.ppid) and p.ppid != self.pid:
                    self.zombie_parents_killed.add(p.ppid)
                    kill(p.ppid, signal.SIGKILL)
                    kill(p.ppid, signal.SIGCONT)
                    self.event("killed", "pid %d left defunct children unreaped while the job is ending; killed so "
                               "they are reaped" % p.ppid, t, pid=p.ppid, signal="SIGKILL")

    # -- orphans -----------------------------------------------------------------------------------

    def _marker_of(self, pid: int) -> tuple | None:
        """(job_id, role, rank) if the process carries this workspace's job marker, else None."""
        p = self.procs[pid]
        key = (pid, p.create_time)
        if key not in self.env_cache:
            env = health.environ(pid)
            if env.get(b"FABTRAIN_WORKSPACE") == self.ws.encode():
                self.env_cache[key] = (env.get(b"FABTRAIN_JOB_ID", b"?").decode(),
                                       env.get(b"FABTRAIN_ROLE", b"?").decode(),
                                       env.get(b"FABTRAIN_RANK", b"?").decode())
            else:
                self.env_cache[key] = None
        return self.env_cache[key]

    def _job_running(self, job_id: str, cache: dict) -> bool:
        if job_id not in cache:
            run_dir = os.path.join(self.ws, "jobs", job_id, "run")
            running = False
            try:
                names = os.listdir(run_dir)
            except OSError:
                names = []
            for name in names:
                if name.endswith(".json"):
                    run = read_json(os.path.join(run_dir, name))
                    if run and self._alive(run.get("pid"), run.get("create_time")):
                        running = True
                        break
            cache[job_id] = running
        return cache[job_id]

    def _check_orphans(self, now: float) -> None:
        live_keys = {(p.pid, p.create_time) for p in self.procs.values()}
        for key in [k for k in self.env_cache if k not in live_keys]:
            del self.env_cache[key]
        mine = {self.pid, os.getppid()}
        if self.keeper is not None:
            mine.add(self.keeper.pid)
        running_jobs: dict[str, bool] = {}
        for pid, p in self.procs.items():
            if pid in mine or p.dead or pid in self.orphans or pid < 2:
                continue
            marker = self._marker_of(pid)
            if marker is None:
                continue
            job_id, role, rank = marker
            if role == "agent":
                continue
            age = now - p.create_time
            reason = None
            if job_id == self.job_id:
                t = self.by_name.get("%s-%s" % (role, rank))
                if t is None:
                    if age > ORPHAN_MIN_AGE:
                        reason = "carries job %s's marker but %s-%s is not a process of this job here" % (job_id, role, rank)
                elif t.ended:
                    how = ("exited with code %s" % t.exit_code) if t.state == "exited" else "was killed"
                    reason = "outlived its main process %s (pid %s, which %s)" % (t.name, t.program or t.wrapper, how)
            elif age > ORPHAN_MIN_AGE and not self._job_running(job_id, running_jobs):
                reason = "belongs to job %s, which is not running" % job_id
            if reason is None:
                continue
            kill(pid, signal.SIGTERM)
            kill(pid, signal.SIGCONT)
            self.orphans[pid] = {"reason": reason, "term_at": now, "signal": "SIGTERM", "ctime": p.create_time,
                                 "name": "%s-%s" % (role, rank), "job_id": job_id}
            self.event("orphan", reason + "; killing it", None, pid=pid, role=role,
                       rank=int(rank) if rank.isdigit() else rank, job=job_id, signal="SIGTERM")
        # Group members left behind by a process that has ended (whatever their environment says).
        for t in self.tracked:
            if not t.ended:
                continue
            for pid in t.members:
                p = self.procs.get(pid)
                if p is None or p.dead or pid in self.orphans or pid in mine or p.create_time > t.ended_at:
                    continue  # created after the end: a new group that reuses the pid, not ours
                how = ("exited with code %s" % t.exit_code) if t.state == "exited" else "was killed"
                reason = "outlived its main process %s (pid %s, which %s); still in its process group" % (
                    t.name, t.program or t.wrapper, how)
                kill(pid, signal.SIGTERM)
                kill(pid, signal.SIGCONT)
                self.orphans[pid] = {"reason": reason, "term_at": now, "signal": "SIGTERM", "ctime": p.create_time,
                                     "name": t.name, "job_id": self.job_id}
                self.event("orphan", reason + "; killing it", t, pid=pid, signal="SIGTERM")
        for pid, o in list(self.orphans.items()):
            if not self._alive(pid, o["ctime"]):
                del self.orphans[pid]
            elif now - o["term_at"] >= self.grace and o["signal"] == "SIGTERM":
                kill(pid, signal.SIGKILL)
                o["signal"] = "SIGKILL"
                self.event("orphan", "pid %d still alive %g s after SIGTERM" % (pid, self.grace), None, pid=pid,
                           signal="SIGKILL")

    # -- failure, teardown -------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """Something on this node failed the job."""
        if self.status["status"] in FINAL:
            return
        self.local_failure = {"reason": reason}
        self.status = {"status": "failed", "reason": reason, "node": self.node}
        self.event("job_failed", reason, None, origin=self.node, on_failure=self.on_failure)

    def _handle_messages(self) -> bool:
        """Take in the coordinator's lines; True if the job's status changed."""
        with self.msgs_lock:
            msgs, self.msgs = self.msgs, []
        before = self.status["status"]
        for msg in msgs:
            if msg.get("op") != "status" or msg.get("job_id") != self.job_id:
                continue
            self.coord_view = msg
            st = msg.get("status")
            if st in FINAL and self.status["status"] == "running":
                self.status = {"status": st, "reason": msg.get("reason"), "node": msg.get("node")}
                if st == "failed":
                    self.event("job_failed", msg.get("reason") or "failed", None, origin=msg.get("node"),
                               on_failure=self.on_failure)
        return self.status["status"] != before

    def _check_coordinator_contact(self) -> None:
        """Losing the coordinator for peer_timeout, after having reached it, fails the job here."""
        c = self.client
        if c is None or not c.ever_connected or self.status["status"] in FINAL:
            return
        if c.last_contact is not None and time.monotonic() - c.last_contact > self.peer_timeout:
            if any(t.live for t in self.tracked) and not self.coord_lost_reported:
                self.coord_lost_reported = True
                reason = "coordinator %s:%d (agent of %s) unreachable for %.0f s: %s" % (
                    self.coord_host, self.coord_port, self.job["nodes"][0]["name"],
                    time.monotonic() - c.last_contact, c.error or "no answer")
                self.event("peer_lost", reason, None, peer=self.job["nodes"][0]["name"])
                self.fail(reason)

    def _act(self) -> None:
        st = self.status["status"]
        if st not in FINAL or self.acted:
            return
        live = [t for t in self.tracked if t.live]
        if st == "finished":
            self.acted = True
            names = ", ".join(t.name for t in live)
            self.event("finished", "every trainer exited with code 0" + ("; stopping %s" % names if names else ""), None)
            for t in live:
                self.terminate(t, "the job finished")
            return
        if self.on_failure == "keep":
            self.acted = True
            names = ", ".join("%s (pid %s)" % (t.name, t.program or t.wrapper) for t in live)
            self.event("kept", "on_failure is keep: leaving %s running for debugging; stop them with `fab kill-all`"
                       % (names or "nothing (no process left here)"), None)
            return
        self.acted = True
        names = ", ".join(t.name for t in live)
        self.event("teardown", "job failed (%s); %s" % (self.status["reason"], ("stopping " + names) if names else
                                                         "nothing else of it runs here"), None,
                   origin=self.status.get("node"))
        for t in live:
            if t.term_at is None:
                self.terminate(t, "teardown: job failed (%s)" % self.status["reason"])

    def terminate(self, t: Tracked, reason: str) -> None:
        """SIGTERM to the process's group (the program first; the wrapper stays to write the exit code)."""
        if t.term_at is not None or not t.live:
            return
        t.kill_reason, t.kill_signal, t.term_at = reason, "SIGTERM", time.time()
        targets = [p for p in t.members if p != t.wrapper]
        targets += [p for p in t.tree if p not in targets and self._alive(p)]  # children that left the group
        if not targets:
            targets = [t.wrapper]
        for pid in targets:
            kill(pid, signal.SIGTERM)
        pgid = t.run.get("pgid", t.wrapper)
        try:
            os.killpg(pgid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        except (ProcessLookupError, PermissionError):
            pass
        if t.program and t.program not in t.members:
            kill(t.program, signal.SIGCONT)

    def _escalate(self, now: float) -> None:
        for t in self.tracked:
            if t.live and t.term_at is not None and t.kill_signal == "SIGTERM" and now - t.term_at >= self.grace:
                t.kill_signal = "SIGKILL"
                targets = set(t.members) | set(p for p in t.tree if self._alive(p))
                targets.discard(t.wrapper)
                if not targets:
                    targets = {t.wrapper}
                for pid in targets:
                    kill(pid, signal.SIGKILL)
                kill(t.wrapper, signal.SIGCONT)
                self.event("killed", "still alive %g s after SIGTERM (grace); SIGKILL" % self.grace, t,
                           signal="SIGKILL", pid=t.program or t.wrapper)
            elif t.live and t.kill_signal == "SIGKILL" and now - t.term_at >= self.grace + 1:
                kill(t.wrapper, signal.SIGKILL)  # a wrapper that cannot even write the exit code

    # -- reporting -----------------------------------------------------------------------------------

    def _own_cpu(self) -> float:
        p = health.read_proc(os.getpid())
        return p.cpu if p else 0.0

    def process_view(self, t: Tracked) -> dict:
        return {"name": t.name, "role": t.role, "rank": t.rank, "pid": t.program or t.wrapper,
                "wrapper_pid": t.wrapper, "state": t.state, "exit_code": t.exit_code, "signal": t.signal,
                "cpu_percent": t.cpu_percent, "rss": t.rss, "children": t.children if t.live else 0,
                "zombies": len([z for z in t.zombies if (self.procs.get(z) and self.procs[z].ppid != 1)]),
                "last_progress": round(t.last_progress, 3) if t.last_progress else None,
                "hung": t.hung, "killed_by_agent": t.kill_reason, "gpu_mem": t.gpu_mem}

    def write_health(self, now: float) -> None:
        cpu, mono = self._own_cpu(), time.monotonic()
        self.agent_cpu_percent = round(100.0 * (cpu - self.own_cpu) / max(1e-3, mono - self.own_t), 2)
        self.own_cpu, self.own_t = cpu, mono
        me = self.procs.get(self.pid)
        c = self.client
        snapshot = {
            "ts": round(now, 3), "node": self.node, "job_id": self.job_id, "interval": self.interval,
            "host": self.host.sample(),
            "gpus": self.gpus.sample(),
            "processes": [self.process_view(t) for t in self.tracked],
            "agent": {"pid": self.pid, "rss": me.rss if me else None, "cpu_percent": self.agent_cpu_percent,
                      "started": round(self.started, 3), "restarted": self.restarted,
                      "keeper_pid": self.keeper.pid if self.keeper else None},
            "peers": (self.coord_view.get("peers") or {}),
            "job": {"status": self.status["status"], "reason": self.status["reason"],
                    "origin": self.status.get("node"), "on_failure": self.on_failure,
                    "kept": self.on_failure == "keep" and self.status["status"] == "failed"},
            "coordinator": {"host": self.coord_host, "port": self.coord_port, "hosted_here": self.is_coordinator,
                            "connected": bool(c and c.connected),
                            "last_contact": round(c.last_contact_epoch, 3) if c and c.last_contact_epoch else None,
                            "error": (c.error if c else None) or (self.coordinator.bind_error if self.coordinator else None),
                            "lost": self.coord_view.get("lost") or [], "done": self.coord_view.get("done") or []},
            "orphans": [{"pid": pid, "name": o["name"], "job_id": o["job_id"], "reason": o["reason"]}
                        for pid, o in self.orphans.items()],
            "zombies": sum(v["zombies"] for v in map(self.process_view, self.tracked)),
            "events": self.recent,
        }
        if self.gpus.error and self.gpus.error != "no NVIDIA driver":
            snapshot["gpu_error"] = self.gpus.error
        try:
            atomic_write(self.health_path, json.dumps(snapshot))
        except OSError:
            pass

    def _beat(self, urgent: bool = False) -> None:
        if self.client is None:
            return
        done = self.is_done
        procs = {t.name: {"role": t.role, "rank": t.rank, "state": t.state, "exit_code": t.exit_code}
                 for t in self.tracked}
        final = None
        if self.status["status"] in FINAL:
            final = dict(self.status)
        beat = {"op": "beat", "job_id": self.job_id, "node": self.node,
                "ts": time.time(), "procs": procs,
                "done": done, "failure": self.local_failure, "final": final,
                "trainers_expected": self.trainers_expected}
        key = json.dumps([procs, done, self.local_failure, final])
        if urgent and key == getattr(self, "_last_beat_key", None):
            return  # nothing new since the last beat; the next tick sends one anyway
        self._last_beat_key = key
        self._last_seq = self.client.update(beat)

    # -- the end -----------------------------------------------------------------------------------------

    def local_done(self) -> bool:
        if any(t.live for t in self.tracked) or self.orphans:
            return False
        if any(self._alive(pid) for t in self.tracked for pid in t.members):
            return False
        pending = any(not t.started for t in self.tracked)
        return not pending or self.status["status"] in FINAL

    def should_exit(self) -> bool:
        if not self.local_done():
            self.done_since, self.is_done = None, False
            return False
        now = time.monotonic()
        if self.done_since is None:
            self.done_since, self.is_done = now, True
            self._beat()
        c = self.client
        acked = c is not None and c.acked_seq >= getattr(self, "_last_seq", 0)
        if self.coordinator is not None:
            # The coordinator stays while others may still need it.
            co = self.coordinator
            if co.superseded:
                return True
            if self.status["status"] not in FINAL:
                # Nothing final, but every node of the job has spoken and is done (a job with no trainers).
                return acked and co.all_peers_settled() and set(co.nodes) <= set(co.peers)
            if self.final_since is None:
                self.final_since = now
            return (acked and co.all_peers_settled()) or now - self.final_since > self.peer_timeout + self.grace + 5
        if acked:
            return True
        # Never reached the coordinator: keep trying a while, or it never learns how this node ended.
        limit = self.peer_timeout if (c and c.ever_connected) else max(60.0, 10 * self.peer_timeout)
        return now - self.done_since > limit

    def finish(self) -> int:
        now = time.time()
        self.procs, _ = self.table.refresh(self.hot)
        self.write_health(now)
        st = self.status["status"]
        self.event("agent_exit", "nothing of job %s is left on this node (job %s)" % (self.job_id, st), None)
        self._shutdown()
        return 0

    def stop(self, why: str) -> int:
        live = [t.name for t in self.tracked if t.live]
        if live and self.status["status"] == "running" and not os.path.exists(os.path.join(self.jd, "killed")):
            self.fail("the agent on %s was stopped (%s) while %s still ran" % (self.node, why, ", ".join(live)))
            self._beat(urgent=True)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and self.client and self.client.acked_seq < getattr(self, "_last_seq", 0):
                time.sleep(0.02)
        self.write_health(time.time())
        self.event("agent_stopped", "stopped by %s" % why, None)
        self._shutdown()
        return 0

    def _shutdown(self, exit_code: int = 0) -> None:
        self._stop_keeper()
        if self.client:
            self.client.stop()
        if self.coordinator:
            self.coordinator.stop()
            self.coordinator.join(2)
        if self.write_exit_file:
            try:
                atomic_write(os.path.join(self.jd, "run", "agent.exit"), "%d\n" % exit_code)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m fabtrain.node.agent <job_dir> [--restarted]", file=sys.stderr)
        return 2
    agent = None
    try:
        agent = Agent(argv[0], restarted="--restarted" in argv[1:])
        return agent.run()
    except SystemExit:
        raise
    except BaseException:
        # A bug, not a kill: say so, and do not let the keeper restart us into the same bug.
        traceback.print_exc()
        if agent is not None:
            try:
                agent.event("agent_error", "the agent crashed: %s" % traceback.format_exc().strip().splitlines()[-1])
                agent._shutdown()
            except Exception:
                pass
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
