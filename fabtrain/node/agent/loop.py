"""The agent's run loop: observe, decide (policy.py, pure), execute; nothing else.

Every ``watchdog.interval`` -- or at once when a job process ends (a pidfd becomes readable), the coordinator
pushes a status line, or a deadline falls due -- the loop reads /proc, lets each process context poll, hands the
observation to the policy, and executes the actions it returns: events, SIGTERM/SIGKILL through the supervisor,
signals to orphans. Then health.json and a heartbeat (docs/watchdog.md).
"""
from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from fabtrain.node.structs import replace

from fabtrain.node import procfs
from fabtrain.node.atomic import read_json
from fabtrain.node.coordination.restart import RestartPolicy
from fabtrain.node.kill import send
from fabtrain.contract.events import PROCESS_ENDS, RESTARTS, STACK_DUMPS, EventKind
from fabtrain.contract.states import FINAL, FailureKind, JobState, read_disruption, read_killer, signal_name
from fabtrain.contract.jobfolder import DISRUPTED_BEFORE, JobFolder, job_folder

from . import checkpoints, early, policy, snapshot, stacks
from .events import EventLog
from .jobjudge import JobJudge
from .keeper import AgentLife
from .link import Link
from .relaunch import relaunch, restarted
from .samplers import GpuSampler, HostSampler, TcpQueues
from .supervisor import Markers, ProcessContext, job_running

DISK_FULL_BYTES = 1 << 20  # less than this free in the workspace: a full disk, for the events' reasons
LIST_PERIOD = 5.0  # s between listings of /proc: a stray of an earlier job is seen within two of them
# Seconds Open MPI's daemon (orted) gets to leave by itself once the ranks it started here ended and the
# job's end is known here. It leaves when mpirun ends, unless mpirun dies badly (Open MPI 4.1's mpirun
# can crash in its own abort): then it would stay forever, without the job marker.
STARTER_WAIT = 0.5


def load_job(job_dir: str) -> dict:
    path = JobFolder(job_dir).job_json
    deadline = time.time() + 5
    while True:
        job = read_json(path)
        if isinstance(job, dict) and job.get("job_id"):
            return job
        if time.time() > deadline:
            raise SystemExit("agent: no job.json in %s" % job_dir)
        time.sleep(0.1)


def settings(job: dict, nodes: list[str]) -> tuple[policy.Config, RestartPolicy]:
    """The watchdog's settings from job.json, strictly: the plan writes every one of them from
    cluster.yaml, whose config holds the only defaults; a job.json without them is refused."""
    w = job.get("watchdog")
    if not isinstance(w, dict) or not isinstance(w.get("coordinator"), dict):
        raise SystemExit("agent: job.json of job %s has no watchdog settings" % job.get("job_id"))
    try:
        coord = w["coordinator"]
        cfg = policy.Config(node=job["node"], job_id=job["job_id"], interval=float(w["interval"]),
            hang_timeout=float(w["hang_timeout"]), startup_timeout=float(w["startup_timeout"]),
            grace=float(w["grace"]), on_failure=str(w["on_failure"]),
            coordinator_node=nodes[0], coordinator="%s:%d" % (coord["host"], int(coord["port"])),
            elastic=w.get("min_nodes") is not None and w["on_failure"] == "restart")
        restart = RestartPolicy.from_watchdog(w, job)
        if restart.layout is not None:  # min_nodes: why a lost coordinator's node ends the job (elastic.py)
            cfg = replace(cfg, without_coordinator=restart.layout.fence_why(), spare=job["node"] in restart.layout.spares)
        return cfg, restart
    except KeyError as e:
        raise SystemExit("agent: job.json of job %s has no watchdog setting %s" % (job.get("job_id"), e)) from None
    except (TypeError, ValueError) as e:
        raise SystemExit("agent: job.json of job %s: a watchdog setting is malformed: %s"
                         % (job.get("job_id"), e)) from None


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


def proc_table() -> procfs.ProcTable:
    """The agent's view of /proc, listed every LIST_PERIOD s, not every step: the job's processes and
    their new descendants are followed through their children files (ProcTable), and any other process
    is read only once it has lived through a listing (settle: never, if it is that short-lived). Every
    process is re-read every 12th listing (~60 s): that only guards against a pid reused between two
    listings. At 1,250 processes the listing and the re-reads were most of an agent's CPU (200 agents on
    one machine). The first listing waits too: at a start every node's agent starts at once, and what
    it watches first, its job's processes, it finds from their run records."""
    return procfs.ProcTable(full_every=12, list_period=LIST_PERIOD, list_first=False, settle=True)


class Agent:
    def __init__(self, job_dir: str, restarted: bool = False):
        self.jd = os.path.abspath(job_dir)
        self.ws = os.path.dirname(os.path.dirname(self.jd))
        self.job = load_job(self.jd)
        self.job_id, self.node = self.job["job_id"], self.job["node"]
        self.nodes = [n["name"] for n in self.job.get("nodes", [])] or [self.node]
        self.cfg, restart = settings(self.job, self.nodes)
        self.must_join = tuple(n["name"] for n in self.job.get("nodes", []) if n.get("roles", True))
        self.restarted, self.started, self.pid = restarted, time.time(), os.getpid()
        self.startup_deadline = self.started + self.cfg.startup_timeout
        self.events = EventLog(JobFolder(self.jd).events, self.node)
        self.life = AgentLife(self.jd, self.job, self.ws)
        floor = self.started if restarted else None
        self.contexts = [ProcessContext(p, self.jd, self.ws, floor) for p in self.job.get("processes", [])]
        self.by_name = {ctx.name: ctx for ctx in self.contexts}
        self.ledger = policy.Ledger()
        self.obs = policy.Observation(now=self.started)
        self.table = proc_table()
        self.procs, self.kids, self.hot = {}, {}, set()
        self.markers = Markers(self.ws)
        self.watch = PidWatch()
        self.gpus = GpuSampler()
        self.gpu_pids: dict[int, int] = {}
        self.sends = TcpQueues()  # trainers' TCP queues, each rank's (the communication straggler)
        self.health = snapshot.Health(JobFolder(self.jd).health, self.cfg,
                                      HostSampler(self.ws if os.path.isdir(self.ws) else "/"), self.gpus,
                                      self.events, self.life, self.started, restarted)
        self.link = Link(self.job, self.nodes, self.cfg, restart, self.jd, self._peer_event, self.watch.wake,
                         resumed=time.monotonic() if restarted and held_lease(self.jd) else None)
        self.stop_signal: int | None = None
        self.is_done = False
        self.done_since: float | None = None
        self.final_since: float | None = None
        self.final_at: float | None = None  # when this agent first saw the job's end (epoch)
        self.started_generation = 0  # the job's generation this node last started (beats carry it)
        self.launchers: list = []  # launchers this agent started (a restart): reaped here
        self.judge = JobJudge(self.node, self.job.get("watchdog"), self.events)  # blame and stragglers
        self.no_checkpoint = checkpoints.NoCheckpoint(self.job.get("watchdog"), self.events)

    # -- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        took_over = self.life.register()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.stop_signal = early.taken()  # one that came while this agent started: it stops at its first step
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.ledger, self.started_generation, self.startup_deadline = replay(
            self.events.replay(), self.node, self.by_name, self.started_generation, self.startup_deadline,
            self.started, self.cfg.startup_timeout)
        for ctx in self.contexts:
            ctx.generation = self.started_generation
        actions, self.ledger = earlier_loss(self.jd, self.node, self.ledger, self.cfg, self.events)
        self.execute(actions, time.time())
        if took_over:
            self.events.write(EventKind.AGENT_RESTARTED, took_over)
        error = self.life.start_keeper()
        if error:
            self.events.write(EventKind.AGENT_ERROR, error)
        self.events.reserve()
        if not self.link.start():
            # The coordinator wrote why (coordinator_error). Agents refuse whatever holds the
            # port, so this job has no coordinator: fail the start (node ops reports it).
            self.shutdown(1)
            raise SystemExit(1)

    def _peer_event(self, kind: str, reason: str, node: str | None = None, **fields) -> None:
        self.events.write(kind, reason, peer=node, **fields)

    def _on_signal(self, sig, frame) -> None:
        self.stop_signal = sig
        self.watch.wake()

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        if not self.life.lock():
            print("agent: another agent of job %s is running on this node; exiting" % self.job_id, flush=True)
            return 0
        self.setup()
        self.events.write(EventKind.AGENT_STARTED, "watching %d process(es) of job %s; interval %g s, hang_timeout %g s, "
                          "startup_timeout %g s, on_failure %s; coordinator %s%s" % (
                              len(self.contexts), self.job_id, self.cfg.interval, self.cfg.hang_timeout,
                              self.cfg.startup_timeout, self.cfg.on_failure, self.cfg.coordinator,
                              " (hosted here)" if self.link.coordinator else ""))
        next_tick, needed = 0.0, True
        while True:
            now = time.monotonic()
            tick = now >= next_tick
            if tick:
                next_tick = now + self.cfg.interval
            if tick or needed:
                self.step(tick)
            if self.stop_signal is not None:
                return self.stop(signal_name(self.stop_signal))
            if self.should_exit():
                if not self._take_messages():  # the ack that let it go brought no last word (the job's outcome)
                    return self.finish()
                self.step(False)  # it did (the coordinator decided as this node's last beat came in): acted on first
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
        waits = [at for at in (starter_wait(ctx, self.procs, self.final_at) for ctx in self.contexts) if at and at > now]
        due = min([due] + waits if due is not None else waits, default=None)
        soon = mono + self.cfg.interval
        return soon if due is None else min(soon, mono + max(0.02, due - now))

    def step(self, tick: bool) -> None:
        self._take_messages()
        self.procs = self.table.refresh(self.hot)
        self.kids = self.table.kids
        if tick and self.gpus.nvml is not None:
            self.gpu_pids = self.gpus.pids()
        now = time.time()
        for ctx in self.contexts:
            ctx.poll(self.procs, self.kids, now, tick, self.cfg.interval)
            said = checkpoints.resumed(ctx)  # a restarted process's first step: what it resumed from
            if said:
                self.events.write(EventKind.RESUMED, said[0], ctx.name, **said[1])
        self.obs = self.observe(now)
        actions, self.ledger = policy.decide(self.obs, self.ledger, self.cfg)
        self.execute(actions, now)
        final = self.ledger.status.status in FINAL
        self.final_at = (self.final_at or now) if final else None
        watched = [p for ctx in self.contexts for p in ctx.watched_pids()]
        self.watch.follow(watched + [o.pid for o in self.ledger.orphans])
        if tick:
            for ctx in self.contexts:
                ctx.sample_sends(self.sends, now)
            gone = self.life.launcher_gone()
            if gone:
                self.events.write(EventKind.AGENT_LAUNCHER_LOST, "the agent's launcher (pid %d) is gone; run/agent.json now "
                                  "names the agent itself (pid %d)" % (gone, self.pid))
            error = self.life.check_keeper()
            if error:
                self.events.write(EventKind.AGENT_ERROR, error)
            self.judge.check_stragglers(self.link.coordinator, self.ledger.status.status, now)
            self.no_checkpoint.check(self.link.coordinator, self.ledger, now)
            self.write_health(now)
        self.judge.check_blame(self.link.coordinator, self.ledger, now)
        self.beat(urgent=not tick)
        self.hot = hot_pids(self.pid, self.contexts, self.ledger.orphans, self.markers.marked(), self.kids)
        self.launchers = [p for p in self.launchers if p.poll() is None]  # reap the ones that ended

    def observe(self, now: float) -> policy.Observation:
        """What the policy is given: every process's facts, strays, the coordinator, the markers."""
        self.markers.refresh(self.procs, self.table.read)
        mine = {self.pid, os.getppid(), self.life.keeper_pid}
        for ctx in self.contexts:
            mine.add(ctx.launcher)
            if not ctx.ended:
                mine.update(ctx.family)
        return policy.Observation(
            now=now, procs=tuple(facts(ctx, self.procs, starter_due(ctx, self.procs, self.final_at, now))
                       for ctx in self.contexts),
            strays=tuple(strays(self.procs, self.markers, mine, self.job_id, self.ws, now)),
            orphans_alive=frozenset(o.pid for o in self.ledger.orphans if procfs.alive(o.pid, o.ctime, self.procs)),
            killed_by=read_killer(JobFolder(self.jd).killed), peers=self.link.peers(),
            disrupted=platform_stop(self.jd, self.job, self.stop_signal is not None and self.ledger.status.status not in FINAL),
            must_join=self.must_join, startup_deadline=self.startup_deadline, disk_full=disk_full(self.jd, self.ws))

    # -- execute -------------------------------------------------------------------------------

    def execute(self, actions: list, now: float) -> None:
        protected = {self.pid, os.getppid(), self.life.keeper_pid}
        frames = None  # the stacks just dumped: the hang or teardown event that follows carries them
        for a in actions:
            if isinstance(a, policy.DumpStacks):
                frames = stacks.dump(stacks.targets_of(self.contexts, a.names, self.kids), self.jd)
                self.judge.dumped(frames, self.contexts)
                self.beat(urgent=True)  # the coordinator's agent names the rank to blame from every node's
            elif isinstance(a, policy.Note):
                fields = a.fields
                if frames is not None and a.kind in STACK_DUMPS:
                    fields = dict(fields, stacks=frames)
                    if a.name in frames:
                        fields["frame"] = frames[a.name].get("frame") or frames[a.name].get("why")
                    if a.kind == EventKind.HANG and self.judge.rank_views:
                        fields["blame"] = self.judge.blame_here()  # this node's ranks; the job's: check_blame
                self.events.write(a.kind, a.reason, a.name, **fields)
            elif isinstance(a, policy.Stop):
                self.by_name[a.name].close(a.reason, now, self.procs)
            elif isinstance(a, policy.Escalate):
                self.by_name[a.name].escalate(self.procs)
            elif isinstance(a, policy.KillLauncher):
                self.by_name[a.name].kill_launcher()
            elif isinstance(a, policy.Relaunch):
                self.start_generation(a.generation)
            elif isinstance(a, policy.Signal):
                if a.pid not in protected and (a.ctime is None or procfs.alive(a.pid, a.ctime, self.procs)):
                    send(a.pid, a.signal)

    def start_generation(self, generation: int) -> None:
        """This node's part of a restart: its processes start again as `generation`; the job runs here again."""
        new = relaunch(self.contexts, self.job, self.jd, self.ws, generation, self.ledger.status.reason,
                       self.link.view, self.ledger.resume)
        said, fields = restarted(generation, new.names, self.ledger.resume)
        self.contexts, self.by_name = new.contexts, {ctx.name: ctx for ctx in new.contexts}
        self.launchers += new.launchers
        self.started_generation = generation
        self.ledger = policy.relaunched(self.ledger, generation)
        self.judge.new_generation()
        self.obs = policy.Observation(now=time.time())
        self.events.write(EventKind.RESTARTED, said, **fields)
        if new.errors:
            actions, self.ledger = policy.fail(self.ledger, self.cfg, "restart %d on %s: %s" % (
                generation, self.node, "; ".join(new.errors)), FailureKind.START)
            self.execute(actions, time.time())
        self.beat(urgent=True)

    def _take_messages(self) -> bool:
        """Take in the coordinator's lines; True if the job's status changed."""
        before = self.ledger.status
        for msg in self.link.take():
            actions, self.ledger = policy.on_status(msg, self.job_id, self.ledger, self.cfg, time.time())
            self.execute(actions, time.time())
        return self.ledger.status != before

    def beat(self, urgent: bool = False) -> None:
        self.link.send(snapshot.beat(self.job, self.ledger, self.contexts, self.is_done, self.started_generation,
                                     self.judge.rank_views), urgent)

    def write_health(self, now: float) -> None:
        running = self.ledger.status.status == JobState.RUNNING  # a job that ends has no straggler left
        self.health.write(now, self.ledger, self.contexts, self.procs, self.gpu_pids, self.link, self.startup_deadline,
                          self.judge.straggling if running else [], self.judge.local_blame)

    # -- the end ------------------------------------------------------------------------------

    def should_exit(self) -> bool:
        if not local_done(self.contexts, self.ledger, self.procs) or self.ledger.status.status == JobState.RESTARTING:
            self.done_since, self.is_done = None, False
            return False
        if self.final_at is not None and any(ctx.starter_alive(self.procs) for ctx in self.contexts):
            return False  # Open MPI's daemon is about to leave, or to be ended (starter_due)
        now = time.monotonic()
        if self.done_since is None:
            self.done_since, self.is_done = now, True
            self.beat()
        if self.cfg.on_failure == "restart" and self.ledger.failure and self.link.view.get("status") not in FINAL \
                and now - self.done_since < policy.word_wait(self.ledger, self.cfg):
            return False  # our failure may be restarted: wait for the coordinator's word on it
        acked, co = self.link.acked, self.link.coordinator
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
        limit = self.cfg.peer_timeout if self.link.ever_connected else max(60.0, 10 * self.cfg.peer_timeout)
        return now - self.done_since > limit

    def finish(self) -> int:
        self.procs = self.table.refresh(self.hot)
        self.judge.check_blame(self.link.coordinator, self.ledger, time.time(), waiting=False)
        self.write_health(time.time())
        # The outcome as this node heard it (its own final word, else the coordinator's); none: say none.
        status = next((s for s in (self.ledger.status.status, self.link.view.get("status")) if s in FINAL), None)
        self.events.write(EventKind.AGENT_EXIT, "nothing of job %s is left on this node%s"
                          % (self.job_id, " (job %s)" % status if status else ""))
        self.shutdown()
        return 0

    def stop(self, why: str) -> int:
        live = [ctx.name for ctx in self.contexts if ctx.live]
        if live and self.ledger.status.status == JobState.RUNNING and not os.path.exists(JobFolder(self.jd).killed):
            actions, self.ledger = policy.fail(self.ledger, self.cfg, *stopped_failure(self.jd, self.node, why, live))
            self.execute(actions, time.time())
            self.beat(urgent=True)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and self.link.client and not self.link.acked:
                time.sleep(0.02)
        self.write_health(time.time())
        self.events.write(EventKind.AGENT_STOPPED, "stopped by %s" % why)
        self.shutdown()
        return 0

    def shutdown(self, code: int = 0) -> None:
        self.life.stop_keeper()
        self.link.stop()
        self.life.record_exit(code)


PLATFORM_SAYS_WHY = 5.0  # seconds a Slurm step task may take to say why Slurm stopped the job (scontrol)


def platform_stop(jd, job, signalled):
    """(kind, cause) of the job folder's `disrupted` marker (states.read_disruption). Every process of a Slurm
    step gets Slurm's SIGTERM at once, this agent and its programs too, while the step task (node/hosted.py)
    asks slurmctld why: a signalled agent whose job nobody marked gives it a moment to say, so that neither
    its stop nor its programs' ends read as the job's failure."""
    killed = JobFolder(jd).killed
    if signalled and job.get("slurm") and not os.path.exists(killed):
        deadline = time.monotonic() + PLATFORM_SAYS_WHY
        while read_disruption(jd)[1] is None and not os.path.exists(killed) and time.monotonic() < deadline:
            time.sleep(0.05)
    return read_disruption(jd)


def stopped_failure(jd, node, why, live):
    """(reason, kind) of the failure an agent stopped while its processes ran reports: the platform that took
    its node (the `disrupted` marker: a lost node, or the job's end), else the agent's own stop."""
    kind, cause = read_disruption(jd)
    if cause:
        return "node %s %s" % (node, cause), kind
    return "the agent on %s was stopped (%s) while %s still ran" % (node, why, ", ".join(live)), FailureKind.OTHER


# -- observe: what the policy is given -------------------------------------------------------------


def local_done(contexts, ledger, procs) -> bool:
    """Nothing of the job is left on this node (or nothing was started, once the job ended)."""
    if any(ctx.live for ctx in contexts) or ledger.orphans:
        return False
    if any(ctx.launcher_alive(procs) or ctx.family for ctx in contexts):
        return False
    return all(ctx.started for ctx in contexts) or ledger.status.status in FINAL


def earlier_loss(jd, node, ledger, cfg, events) -> tuple[list, policy.Ledger]:
    """(actions, ledger): this node's earlier part taken by its platform, as kept by the supervisor that started
    it again (node/hosted.py), is this node's failure of that part's generation (the coordinator takes it once)."""
    cause = read_disruption(jd, DISRUPTED_BEFORE)[1]
    if cause is None:
        return [], ledger
    with contextlib.suppress(OSError):
        os.unlink(JobFolder(jd).disrupted_before)
    if ledger.status.status != JobState.RUNNING:
        return [], ledger
    reason, g = "node %s %s" % (node, cause), ledger.generation
    actions, ledger = policy.fail(ledger, cfg, reason, FailureKind.LOST, before=True)
    said = any(ev.get("node") == node and ev.get("kind") in (EventKind.FAILURE, EventKind.JOB_FAILED)
               and ev.get("reason") == reason and ev.get("generation") == g for ev in events.replay())
    return ([] if said else actions), ledger  # the earlier agent wrote it: the beat says it again, not the log


def replay(events, node: str, by_name: dict, generation: int, startup_deadline: float, started: float,
           startup_timeout: float) -> tuple[policy.Ledger, int, float]:
    """What a restarted agent (or one started into an ended job) learns from events.jsonl: its ledger,
    the generation this node last started, and its startup deadline."""
    ledger = policy.Ledger()
    for ev in events:
        kind = ev.get("kind")
        if kind in RESTARTS and ev.get("node") == node:
            ledger = policy.replay_restart(ev)
            generation = ledger.generation if kind == EventKind.RESTARTED else generation
            continue
        if kind == EventKind.AGENT_STARTED and ev.get("node") == node:
            startup_deadline = min(startup_deadline, ev.get("ts", started) + startup_timeout)
        if kind in (EventKind.JOB_FAILED, EventKind.FINISHED) and ledger.status.status == JobState.RUNNING:
            status = JobState.FAILED if kind == EventKind.JOB_FAILED else JobState.FINISHED
            ledger = replace(ledger, status=policy.Status(status, ev.get("reason"), ev.get("origin")))
        if kind in (EventKind.TEARDOWN, EventKind.KEPT, EventKind.FINISHED):
            ledger = replace(ledger, acted=True)
        if kind in PROCESS_ENDS and ev.get("name") in by_name and ev.get("node") == node:
            ledger = replace(ledger, reported=ledger.reported | {ev["name"]})
    return ledger, generation, startup_deadline


def held_lease(job_dir: str) -> bool:
    """Whether this node's previous agent had a lease from the coordinator (its last health.json)."""
    health = read_json(JobFolder(job_dir).health)
    coordinator = health.get("coordinator") if isinstance(health, dict) else None
    return bool(isinstance(coordinator, dict) and coordinator.get("lease"))


def hot_pids(own: int, contexts, orphans, marked, kids: dict) -> set[int]:
    """The pids /proc is read in full for on the next step: the job's processes, orphans, marked ones."""
    hot = {own}
    for ctx in contexts:
        if ctx.launcher:
            hot.add(ctx.launcher)
            hot.update(procfs.descendants(ctx.launcher, kids))
        if ctx.starter:
            hot.add(ctx.starter[0])
        hot.update(ctx.members)
        hot.update(ctx.family)
    hot.update(o.pid for o in orphans)
    for pid in marked:
        hot.add(pid)
        hot.update(procfs.descendants(pid, kids))
    return hot


def starter_wait(ctx: ProcessContext, procs: dict, final_at: float | None) -> float | None:
    """When the daemon that started `ctx` (Open MPI's orted) has had STARTER_WAIT to leave by itself: after
    both ctx's end and the job's end as this node knows it (None: not ended, or no daemon alive)."""
    if final_at is None or not ctx.ended or ctx.starter_alive(procs) is None:
        return None
    return max(ctx.ended_at, final_at) + STARTER_WAIT


def starter_due(ctx: ProcessContext, procs: dict, final_at: float | None, now: float) -> tuple[int, float] | None:
    """That daemon, once its wait is over: the policy ends it as an orphan."""
    at = starter_wait(ctx, procs, final_at)
    return ctx.starter_alive(procs) if at is not None and now >= at else None


def facts(ctx: ProcessContext, procs: dict, starter=None) -> policy.ProcFacts:
    progress = ctx.progress
    return policy.ProcFacts(
        name=ctx.name, role=ctx.role, rank=ctx.rank, state=ctx.state, pid=ctx.pid, launcher=ctx.launcher,
        exit_code=ctx.exit_code, launcher_lost=ctx.launcher_lost,
        last_record=progress.last_record if progress else None,
        last_activity=progress.last_activity if progress else None, stalled=stalled(progress),
        stopped_since=ctx.stopped_since, fenced=ctx.fenced,
        term_at=ctx.term_at, kill_signal=ctx.kill_signal, close_reason=ctx.close_reason,
        leftovers=tuple(ctx.leftovers(procs)), zombies=tuple(ctx.zombies), starter=starter,
        loaded=checkpoints.load_failure(ctx) if ctx.ended else None)


def stalled(progress) -> tuple | None:
    """(rank, last step, hook's records, what it was last seen doing between steps) of the watched rank that
    progressed least recently, if any."""
    ranks = [(k, r) for k, r in progress.ranks.items() if r in progress.watched() and r.changed is not None] \
        if progress else []
    if not ranks:
        return None
    k, r = min(ranks, key=lambda kr: kr[1].changed)
    return (k, r.step, r.auto, r.busy)


def strays(procs: dict, markers: Markers, mine: set, job_id: str, workspace: str, now: float) -> list[policy.Stray]:
    """Processes with this workspace's marker that no live job process here (`mine`) owns."""
    running: dict[str, bool] = {}
    out = []
    for pid, (job, role, rank) in markers.carrying.items():
        p = procs.get(pid)
        if pid in mine or p is None or p.dead or pid < 2:
            continue
        if job not in running:
            running[job] = job == job_id or job_running(job_folder(workspace, job).run, procs)
        out.append(policy.Stray(pid, p.create_time, job, role, rank, now - p.create_time, running[job]))
    return out


def disk_full(job_dir: str, workspace: str) -> str | None:
    """The workspace, if its disk has (almost) no space left: a failure's likely cause."""
    try:
        st = os.statvfs(job_dir)
    except OSError:
        return None
    return workspace if st.f_bavail * st.f_frsize < DISK_FULL_BYTES else None
