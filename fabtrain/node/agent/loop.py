"""The agent's run loop: observe, decide (policy.py, pure), execute; nothing else.

Every ``watchdog.interval`` -- or at once when a job process ends (a pidfd
becomes readable), the coordinator pushes a status line, or a deadline falls
due -- the loop reads /proc, lets each process context poll, hands the
observation to the policy, and executes the actions it returns: events,
SIGTERM/SIGKILL through the supervisor, signals to orphans. Then health.json
and a heartbeat. See docs/watchdog.md.
"""
from __future__ import annotations

import os
import selectors
import signal
import threading
import time
from dataclasses import replace

from fabtrain.node import procfs
from fabtrain.node.atomic import read_json
from fabtrain.node.coordination import FINAL, Client, Coordinator
from fabtrain.node.coordination.restart import RestartPolicy
from fabtrain.node.states import read_killer, signame

from . import policy, snapshot
from .events import EventLog
from .keeper import AgentLife
from .relaunch import start_generation
from .samplers import GpuSampler, HostSampler
from .supervisor import Markers, ProcessContext, job_running, send

DISK_FULL_BYTES = 1 << 20  # less than this free in the workspace: a full disk, for the events' reasons


def load_job(job_dir: str) -> dict:
    path = os.path.join(job_dir, "job.json")
    deadline = time.time() + 5
    while True:
        job = read_json(path)
        if isinstance(job, dict) and job.get("job_id"):
            return job
        if time.time() > deadline:
            raise SystemExit("agent: no job.json in %s" % job_dir)
        time.sleep(0.1)


class PidWatch:
    """pidfds in a selector: a job process's end wakes the loop at once, not at the next tick."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.fds: dict[int, int] = {}
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)

    def follow(self, pids) -> None:
        pids = set(pids)
        for pid in [p for p in self.fds if p not in pids]:
            self._close(pid)
        for pid in pids - self.fds.keys():
            if hasattr(os, "pidfd_open"):
                try:
                    self.fds[pid] = os.pidfd_open(pid)
                except OSError:
                    continue
                self.sel.register(self.fds[pid], selectors.EVENT_READ, pid)

    def _close(self, pid: int) -> None:
        fd = self.fds.pop(pid)
        try:
            self.sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        os.close(fd)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def wait(self, seconds: float) -> bool:
        """Sleep until woken, a process ends, or the time is up; True if a process ended."""
        ended = False
        for key, _ in self.sel.select(max(0.0, seconds)):
            if key.data is None:
                try:
                    while os.read(self.wake_r, 4096):
                        pass
                except OSError:
                    pass
            else:
                self._close(key.data)
                ended = True
        return ended


class Agent:
    def __init__(self, job_dir: str, restarted: bool = False):
        self.jd = os.path.abspath(job_dir)
        self.ws = os.path.dirname(os.path.dirname(self.jd))
        self.job = load_job(self.jd)
        self.job_id, self.node = self.job["job_id"], self.job["node"]
        w = self.job.get("watchdog") or {}
        coord = w.get("coordinator") or {}
        self.nodes = [n["name"] for n in self.job.get("nodes", [])] or [self.node]
        self.coord_host, self.coord_port = coord.get("host", "127.0.0.1"), int(coord.get("port", 7180))
        self.coord_secret = coord.get("secret")
        self.cfg = policy.Config(
            node=self.node, job_id=self.job_id, interval=float(w.get("interval", 1.0)),
            hang_timeout=float(w.get("hang_timeout", 120.0)), startup_timeout=float(w.get("startup_timeout", 600.0)),
            grace=float(w.get("grace", 5.0)), on_failure=w.get("on_failure", "kill-job"),
            coordinator_node=self.nodes[0], coordinator="%s:%d" % (self.coord_host, self.coord_port))
        self.must_join = tuple(n["name"] for n in self.job.get("nodes", []) if n.get("roles", True))
        self.restarted, self.started, self.pid = restarted, time.time(), os.getpid()
        self.startup_deadline = self.started + self.cfg.startup_timeout
        self.events = EventLog(os.path.join(self.jd, "events.jsonl"), self.node)
        self.life = AgentLife(self.jd, self.job, self.ws)
        floor = self.started if restarted else None
        self.contexts = [ProcessContext(p, self.jd, self.ws, floor) for p in self.job.get("processes", [])]
        self.by_name = {ctx.name: ctx for ctx in self.contexts}
        self.ledger = policy.Ledger()
        self.obs = policy.Observation(now=self.started)
        self.table, self.procs, self.kids, self.hot = procfs.ProcTable(), {}, {}, set()
        self.markers = Markers(self.ws)
        self.watch = PidWatch()
        self.host = HostSampler(self.ws if os.path.isdir(self.ws) else "/")
        self.gpus = GpuSampler()
        self.gpu_pids: dict[int, int] = {}
        self.health = snapshot.Health(os.path.join(self.jd, "health.json"))
        self.coordinator: Coordinator | None = None
        self.client: Client | None = None
        self.coord_view: dict = {}
        self.msgs: list[dict] = []
        self.msgs_lock = threading.Lock()
        self.stop_signal: int | None = None
        self.is_done = False
        self.done_since: float | None = None
        self.final_since: float | None = None
        self.last_seq = 0
        self.last_beat_key = None
        self.started_generation = 0  # the job's generation this node last started (beats carry it)
        self.launchers: list = []  # launchers this agent started (a restart): reaped here

    # -- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        took_over = self.life.register()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self._replay()
        if took_over:
            self.events.write("agent_restarted", took_over)
        error = self.life.start_keeper()
        if error:
            self.events.write("agent_error", error)
        self.events.reserve()
        if self.nodes[0] == self.node:
            self.coordinator = Coordinator(
                self.job_id, self.coord_host, self.coord_port, self.nodes, self.cfg.interval, self.cfg.peer_timeout,
                os.path.join(self.jd, "coordinator.json"), secret=self.coord_secret,
                restart=RestartPolicy.from_watchdog(self.job.get("watchdog") or {}),
                on_event=lambda kind, reason, node=None: self.events.write(kind, reason, peer=node))
            self.coordinator.start()
            if not self.coordinator.wait_listening(self.coordinator.bind_wait + 5):
                # The coordinator wrote why (coordinator_error). Agents refuse whatever holds the
                # port, so this job has no coordinator: fail the start (node ops reports it).
                self.shutdown(1)
                raise SystemExit(1)
        self.client = Client(self.coord_host, self.coord_port, self.cfg.interval, self._on_message,
                             secret=self.coord_secret, job_id=self.job_id, node=self.node,
                             on_event=lambda kind, reason, node=None: self.events.write(kind, reason, peer=node))
        self.client.start()

    def _replay(self) -> None:
        """A restarted agent (or one started into an ended job) learns the job's story from events.jsonl."""
        ledger = self.ledger
        for ev in self.events.replay():
            kind = ev.get("kind")
            if kind in (policy.RESTARTING, "restarted") and ev.get("node") == self.node:
                ledger = policy.replay_restart(ev, time.time())
                self.started_generation = ledger.generation if kind == "restarted" else self.started_generation
                continue
            if kind == "agent_started" and ev.get("node") == self.node:
                self.startup_deadline = min(self.startup_deadline, ev.get("ts", self.started) + self.cfg.startup_timeout)
            if kind in ("job_failed", "finished") and ledger.status.status == "running":
                status = "failed" if kind == "job_failed" else "finished"
                ledger = replace(ledger, status=policy.Status(status, ev.get("reason"), ev.get("origin")))
            if kind in ("teardown", "kept", "finished"):
                ledger = replace(ledger, acted=True)
            if kind in ("exited", "killed") and ev.get("name") in self.by_name and ev.get("node") == self.node:
                ledger = replace(ledger, reported=ledger.reported | {ev["name"]})
        self.ledger = ledger

    def _on_signal(self, sig, frame) -> None:
        self.stop_signal = sig
        self.watch.wake()

    def _on_message(self, msg: dict) -> None:
        with self.msgs_lock:
            self.msgs.append(msg)
        self.watch.wake()

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        if not self.life.lock():
            print("agent: another agent of job %s is running on this node; exiting" % self.job_id, flush=True)
            return 0
        self.setup()
        self.events.write("agent_started", "watching %d process(es) of job %s; interval %g s, hang_timeout %g s, "
                          "startup_timeout %g s, on_failure %s; coordinator %s%s" % (
                              len(self.contexts), self.job_id, self.cfg.interval, self.cfg.hang_timeout,
                              self.cfg.startup_timeout, self.cfg.on_failure, self.cfg.coordinator,
                              " (hosted here)" if self.coordinator else ""))
        next_tick, needed = 0.0, True
        while True:
            now = time.monotonic()
            tick = now >= next_tick
            if tick:
                next_tick = now + self.cfg.interval
            if tick or needed:
                self.step(tick)
            if self.stop_signal is not None:
                return self.stop(signame(self.stop_signal))
            if self.should_exit():
                return self.finish()
            deadline = min(next_tick, self.next_deadline())
            needed = self.watch.wait(deadline - time.monotonic())
            # A reply to a beat changes nothing; a new job status, a signal or a deadline does.
            needed = self._take_messages() or needed or self.stop_signal is not None or \
                time.monotonic() >= deadline - 0.001

    def next_deadline(self) -> float:
        mono, now = time.monotonic(), time.time()
        if any(ctx.program_gone_at and not ctx.ended for ctx in self.contexts):
            return mono + 0.02  # its launcher is about to record the exit code
        due = policy.next_deadline(self.obs, self.ledger, self.cfg)
        soon = mono + self.cfg.interval
        return soon if due is None else min(soon, mono + max(0.02, due - now))

    def step(self, tick: bool) -> None:
        self._take_messages()
        self.procs = self.table.refresh(self.hot)
        self.kids = procfs.children_map(self.procs)
        if tick and self.gpus.nvml is not None:
            self.gpu_pids = self.gpus.pids()
        now = time.time()
        for ctx in self.contexts:
            ctx.poll(self.procs, self.kids, now, tick, self.cfg.interval)
        self.obs = observe(self, now)
        actions, self.ledger = policy.decide(self.obs, self.ledger, self.cfg)
        self.execute(actions, now)
        watched = [p for ctx in self.contexts for p in ctx.watched_pids()]
        self.watch.follow(watched + [o.pid for o in self.ledger.orphans])
        if tick:
            gone = self.life.launcher_gone()
            if gone:
                self.events.write("agent_launcher_lost", "the agent's launcher (pid %d) is gone; run/agent.json now "
                                  "names the agent itself (pid %d)" % (gone, self.pid))
            error = self.life.check_keeper()
            if error:
                self.events.write("agent_error", error)
            self.health.write(self, now)
        self.beat(urgent=not tick)
        self._update_hot()
        self.launchers = [p for p in self.launchers if p.poll() is None]  # reap the ones that ended

    # -- execute -------------------------------------------------------------------------------

    def execute(self, actions: list, now: float) -> None:
        protected = {self.pid, os.getppid(), self.life.keeper_pid}
        for a in actions:
            if isinstance(a, policy.Note):
                self.events.write(a.kind, a.reason, a.name, **a.fields)
            elif isinstance(a, policy.Stop):
                self.by_name[a.name].close(a.reason, now, self.procs)
            elif isinstance(a, policy.Escalate):
                self.by_name[a.name].escalate(self.procs)
            elif isinstance(a, policy.KillLauncher):
                self.by_name[a.name].kill_launcher()
            elif isinstance(a, policy.Relaunch):
                start_generation(self, a.generation)
            elif isinstance(a, policy.Signal):
                if a.pid not in protected and (a.ctime is None or procfs.alive(a.pid, a.ctime, self.procs)):
                    send(a.pid, a.signal)

    def _take_messages(self) -> bool:
        """Take in the coordinator's lines; True if the job's status changed."""
        with self.msgs_lock:
            msgs, self.msgs = self.msgs, []
        before = self.ledger.status
        for msg in msgs:
            if msg.get("op") == "status" and msg.get("job_id") == self.job_id:
                self.coord_view = msg
            actions, self.ledger = policy.on_status(msg, self.job_id, self.ledger, self.cfg, time.time())
            self.execute(actions, time.time())
        return self.ledger.status != before

    def _update_hot(self) -> None:
        hot = {self.pid}
        for ctx in self.contexts:
            if ctx.launcher:
                hot.add(ctx.launcher)
                hot.update(procfs.descendants(ctx.launcher, self.kids))
            hot.update(ctx.members)
            hot.update(ctx.family)
        hot.update(o.pid for o in self.ledger.orphans)
        for pid in self.markers.marked():
            hot.add(pid)
            hot.update(procfs.descendants(pid, self.kids))
        self.hot = hot

    def beat(self, urgent: bool = False) -> None:
        if self.client is None:
            return
        msg = snapshot.beat(self)
        key = repr([msg["procs"], msg["done"], msg["failure"], msg["final"]])
        if urgent and key == self.last_beat_key:
            return  # nothing new since the last beat; the next tick sends one anyway
        self.last_beat_key = key
        self.last_seq = self.client.update(msg)

    # -- the end ------------------------------------------------------------------------------

    def local_done(self) -> bool:
        if any(ctx.live for ctx in self.contexts) or self.ledger.orphans:
            return False
        if any(ctx.launcher_alive(self.procs) or ctx.family for ctx in self.contexts):
            return False
        pending = any(not ctx.started for ctx in self.contexts)
        return not pending or self.ledger.status.status in FINAL

    def should_exit(self) -> bool:
        if not self.local_done() or self.ledger.status.status == policy.RESTARTING:
            self.done_since, self.is_done = None, False
            return False
        now = time.monotonic()
        if self.done_since is None:
            self.done_since, self.is_done = now, True
            self.beat()
        if self.cfg.on_failure == "restart" and self.ledger.failure and self.coord_view.get("status") not in FINAL \
                and now - self.done_since < 2 * self.cfg.peer_timeout + self.cfg.grace:
            return False  # our failure may be restarted: wait for the coordinator's word on it
        c = self.client
        acked = c is not None and c.acked_seq >= self.last_seq
        co = self.coordinator
        if co is not None:  # the coordinator stays while others may still need it
            if co.superseded:
                return True
            if self.ledger.status.status not in FINAL:
                # Nothing final, but every node of the job has spoken and is done (a job with no trainers).
                return acked and co.all_peers_settled() and set(co.nodes) <= set(co.peers)
            if self.final_since is None:
                self.final_since = now
            return (acked and co.all_peers_settled()) or now - self.final_since > self.cfg.peer_timeout + self.cfg.grace + 5
        if acked:
            return True
        # Never reached the coordinator: keep trying a while, or it never learns how this node ended.
        limit = self.cfg.peer_timeout if (c and c.ever_connected) else max(60.0, 10 * self.cfg.peer_timeout)
        return now - self.done_since > limit

    def finish(self) -> int:
        self.procs = self.table.refresh(self.hot)
        self.health.write(self, time.time())
        # The outcome as this node heard it (its own final word, else the coordinator's); none: say none.
        status = next((s for s in (self.ledger.status.status, self.coord_view.get("status")) if s in FINAL), None)
        self.events.write("agent_exit", "nothing of job %s is left on this node%s"
                          % (self.job_id, " (job %s)" % status if status else ""))
        self.shutdown()
        return 0

    def stop(self, why: str) -> int:
        live = [ctx.name for ctx in self.contexts if ctx.live]
        if live and self.ledger.status.status == "running" and not os.path.exists(os.path.join(self.jd, "killed")):
            actions, self.ledger = policy.fail(self.ledger, self.cfg, "the agent on %s was stopped (%s) while %s "
                                               "still ran" % (self.node, why, ", ".join(live)))
            self.execute(actions, time.time())
            self.beat(urgent=True)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and self.client and self.client.acked_seq < self.last_seq:
                time.sleep(0.02)
        self.health.write(self, time.time())
        self.events.write("agent_stopped", "stopped by %s" % why)
        self.shutdown()
        return 0

    def shutdown(self, code: int = 0) -> None:
        self.life.stop_keeper()
        if self.client:
            self.client.stop()
        if self.coordinator:
            self.coordinator.stop()
            self.coordinator.join(2)
        self.life.record_exit(code)


# -- observe: what the policy is given -------------------------------------------------------------


def observe(agent: Agent, now: float) -> policy.Observation:
    c, view = agent.client, agent.coord_view
    peers = policy.Peers(
        ever_connected=bool(c and c.ever_connected),
        silent_for=(time.monotonic() - c.last_contact) if c and c.last_contact is not None else None,
        error=c.error if c else None, seen=tuple(sorted(view.get("peers") or {})),
        trainers_running=int(view.get("trainers_running") or 0))
    return policy.Observation(
        now=now, procs=tuple(facts(ctx, agent.procs) for ctx in agent.contexts), strays=tuple(strays(agent, now)),
        orphans_alive=frozenset(o.pid for o in agent.ledger.orphans if procfs.alive(o.pid, o.ctime, agent.procs)),
        killed_by=read_killer(os.path.join(agent.jd, "killed")), peers=peers, must_join=agent.must_join,
        startup_deadline=agent.startup_deadline, disk_full=disk_full(agent.jd, agent.ws))


def facts(ctx: ProcessContext, procs: dict) -> policy.ProcFacts:
    progress = ctx.progress
    return policy.ProcFacts(
        name=ctx.name, role=ctx.role, rank=ctx.rank, state=ctx.state, pid=ctx.pid, launcher=ctx.launcher,
        exit_code=ctx.exit_code, launcher_lost=ctx.launcher_lost,
        last_record=progress.last_record if progress else None,
        last_activity=progress.last_activity if progress else None, stopped_since=ctx.stopped_since,
        term_at=ctx.term_at, kill_signal=ctx.kill_signal, close_reason=ctx.close_reason,
        leftovers=tuple(ctx.leftovers(procs)), zombies=tuple(ctx.zombies))


def strays(agent: Agent, now: float) -> list[policy.Stray]:
    """Processes with this workspace's marker that no live job process here owns."""
    agent.markers.prune(agent.procs)
    mine = {agent.pid, os.getppid(), agent.life.keeper_pid}
    for ctx in agent.contexts:
        mine.add(ctx.launcher)
        if not ctx.ended:
            mine.update(ctx.family)
    running: dict[str, bool] = {}
    out = []
    for pid, p in agent.procs.items():
        if pid in mine or p.dead or pid < 2:
            continue
        marker = agent.markers.of(p)
        if marker is None:
            continue
        job, role, rank = marker
        if job not in running:
            running[job] = job == agent.job_id or job_running(os.path.join(agent.ws, "jobs", job, "run"), agent.procs)
        out.append(policy.Stray(pid, p.create_time, job, role, rank, now - p.create_time, running[job]))
    return out


def disk_full(job_dir: str, workspace: str) -> str | None:
    """The workspace, if its disk has (almost) no space left: a failure's likely cause."""
    try:
        st = os.statvfs(job_dir)
    except OSError:
        return None
    return workspace if st.f_bavail * st.f_frsize < DISK_FULL_BYTES else None
