"""What the agent decides, as data: an observation and a ledger in, actions and a new ledger out.

Pure: no /proc, no clock, no signals, no files. The loop (loop.py) observes,
calls `decide`, and executes the actions it returns; tests/test_policy.py
checks the rules with made-up observations and no process at all. The rules
are the table in docs/watchdog.md.
"""
from __future__ import annotations

import signal
from fabtrain.node.structs import record, replace

from fabtrain.node.agent.actions import DumpStacks, Escalate, KillLauncher, Note, Relaunch, Signal, Stop
from fabtrain.node.agent.observation import Observation, Peers, ProcFacts, Stray  # noqa: F401 (the policy's inputs)
from fabtrain.node.agent.hangrule import first_to_stall, hang_reason, progress_at
from fabtrain.node.coordination import fence
from fabtrain.node.coordination.connections import hung_timeout
from fabtrain.node.coordination.elastic import sits_out, taking
from fabtrain.contract.events import EventKind
from fabtrain.contract.launcher import DEADMAN, FENCES_ITSELF
from fabtrain.contract.states import FINAL, RESTARTABLE, FailureKind, JobState, describe_end, signal_name, signal_of, stopped_by

EXIT_ONLY_ROLES = ("mpirun",)  # watched for its exit only: it is silent by design; its ranks are watched for hangs
HUNG = " hung: "  # in a hang's failure reason, which the coordinator passes on to every node
ORPHAN_MIN_AGE = 5.0  # a process younger than this may be one node ops is starting right now
# A child is defunct from its exit until its parent reaps it: a moment, but seconds for a parent
# that waits for a time slice on a starved machine. Only one still defunct this long after the agent
# first saw it is reported.
ZOMBIE_MIN_AGE = 5.0


# -- what the agent sees ---------------------------------------------------------------------


@record
class Config:
    """job.json's watchdog settings (no defaults here: cluster.yaml's config holds the only copy)."""
    node: str
    job_id: str
    interval: float
    hang_timeout: float
    startup_timeout: float
    grace: float
    on_failure: str
    coordinator_node: str = ""
    coordinator: str = ""  # host:port, for messages
    elastic: bool = False  # job.watchdog.min_nodes: a node that fences itself leaves the job, and may come back
    without_coordinator: str = ""  # min_nodes: why the job cannot go on without the coordinator's node (elastic.py)
    spare: bool = False  # `spare: true`: this node starts its processes only in a lost node's slot (stand_in)

    @property
    def peer_timeout(self) -> float:
        """Silence after which a coordinator (or peer) whose connection is gone is lost."""
        return fence.peer_timeout(self.interval)

    @property
    def fence_after(self) -> float:
        """Age of the lease, with the connection gone, at which this node stops the job (fence.py)."""
        return fence.fence_after(self.interval)

    @property
    def hung_timeout(self) -> float:
        """Silence after which one whose connection stays open (slow, starved, stopped) is lost."""
        return hung_timeout(self.peer_timeout)


def coordinator_lost(peers: Peers, cfg: Config) -> bool:
    """This node is fenced off (fence.py): the lease is fence_after old with the connection gone, or
    hung_timeout old on an open connection (a coordinator that is slow is not gone)."""
    age = peers.lease_age if peers.lease_age is not None else peers.silent_for
    if not peers.ever_connected or age is None:
        return False
    return age >= (cfg.hung_timeout if peers.connected else cfg.fence_after)


# -- what it remembers ---------------------------------------------------------------------


@record
class Status:
    status: str = JobState.RUNNING
    reason: str | None = None
    origin: str | None = None


@record
class Orphan:
    pid: int
    ctime: float
    reason: str
    name: str
    job: str
    term_at: float
    signal: str = "SIGTERM"


@record
class Ledger:
    status: Status = Status()
    failure: str | None = None  # this node's own failure (its beats carry it)
    acted: bool = False  # teardown, keep or finish done
    reported: frozenset = frozenset()  # processes whose end is in events.jsonl
    hung: frozenset = frozenset()
    zombies_seen: frozenset = frozenset()  # (pid, create time) of the zombies reported
    zombies_since: tuple = ()  # ((pid, create time), first seen defunct): the ones not reported yet
    zombie_parents: frozenset = frozenset()
    orphans: tuple = ()
    quiet: tuple = ()  # (name, since): pservers waiting in silence for trainers
    coordinator_lost: bool = False
    startup_failed: bool = False
    # The startup check is done: startup_deadline passed, and the job had come together or failed. A
    # deadline in the past must not stay the agent's next deadline: every agent would step at once,
    # again and again, for the rest of the job.
    startup_checked: bool = False
    failure_kind: FailureKind | None = None  # whether the coordinator may restart the job
    failure_code: int | None = None
    failure_loaded: tuple | None = None  # the checkpoint the failed process loaded just before (ProcFacts.loaded)
    failure_before: bool = False  # the failure is this node's earlier part's, which its platform took (hosted.py)
    generation: int = 0  # the job's generation this agent works on (the one it runs, or is about to start)
    restart_at: float | None = None  # restarting: when the backoff ends (epoch)
    restart_ts: float | None = None  # the `ts` of the coordinator's restarting status that set restart_at
    resume: dict | None = None  # restarting: the coordinator's `resume_from` (on_bad_checkpoint previous), else None
    pending: bool = False  # our failure may be restarted: the coordinator's word on it is still to come
    held: bool = False  # restarting: the coordinator holds the generation until a majority knows it (quorum.py)
    replayed: bool = False  # held: read back by an agent started again (replay_restart), which starts on the release
    stacks_taken: bool = False  # this generation's stacks were dumped (once: before a hang's teardown)


# -- what it does: actions.py (Note, DumpStacks, Stop, Escalate, KillLauncher, Relaunch, Signal) --


# -- the rules -------------------------------------------------------------------------------


def decide(obs: Observation, ledger: Ledger, cfg: Config) -> tuple[list, Ledger]:
    d = _Decision(obs, ledger, cfg)
    d.exits()
    if d.ledger.status.status == JobState.RUNNING or cfg.on_failure == "keep":
        d.hangs()
    d.startup()
    d.coordinator()
    d.orphans()
    d.act()
    d.relaunch()
    d.zombies()
    d.escalations()
    return d.actions, d.ledger


def fail(ledger: Ledger, cfg: Config, reason: str, kind: FailureKind = FailureKind.OTHER, exit_code: int | None = None,
         loaded: tuple | None = None, before: bool = False) -> tuple[list, Ledger]:
    """Something on this node failed the job (first failure wins).

    While the job restarts, the old generation's processes ending are the
    teardown's doing: only `fab kill-all` (kind kill-all) or a relaunch that
    cannot start (kind start) fails it then.
    """
    status = ledger.status.status
    if status in FINAL or (status == JobState.RESTARTING and kind not in (FailureKind.KILL_ALL, FailureKind.START)
                           and not (cfg.elastic and kind == FailureKind.LOST)):  # min_nodes: this node leaves
        return [], ledger
    # Under on_failure restart an exit or a hang is a `failure` until the coordinator says what
    # follows (`restarting`, or `job_failed` from on_status): `fab status` must not call it the end.
    pending = cfg.on_failure == "restart" and kind in RESTARTABLE
    note = Note(EventKind.FAILURE if pending else EventKind.JOB_FAILED, reason,
                fields={"origin": cfg.node, "on_failure": cfg.on_failure, "generation": ledger.generation})
    return [note], replace(ledger, failure=reason, failure_kind=kind, failure_code=exit_code, pending=pending,
                           status=Status(JobState.FAILED, reason, cfg.node), restart_at=None, failure_loaded=loaded,
                           failure_before=before)


def restarting(msg: dict, ledger: Ledger, cfg: Config, now: float) -> tuple[list, Ledger]:
    """The coordinator's `restarting` line: tear down, then start generation g after the backoff.

    Taken once per generation, and only while the job runs here or failed by
    this node's own word (its failure is what the coordinator restarts for):
    a failure the coordinator itself declared is final.
    """
    g = msg.get("generation")
    if cfg.on_failure != "restart" or not isinstance(g, int) or g < ledger.generation:
        return [], ledger
    out = sits_out(cfg.node, cfg.spare, msg)  # min_nodes: this node left (or is an idle spare); it starts nothing
    held = msg.get("held") is True  # a job that elects: not before a majority knows g (coordination/quorum.py)
    if g == ledger.generation and ledger.status.status == JobState.RESTARTING and ledger.restart_at is None \
            and not out and not held and msg.get("ts") != ledger.restart_ts:
        if ledger.held:  # the majority knows it now: the rest of the backoff (not known to a replayed ledger: none)
            return [], replace(ledger, held=False, replayed=False, restart_ts=msg.get("ts"),
                               restart_at=now + (0.0 if ledger.replayed else float(msg.get("backoff") or 0.0)))
        # back in the generation it waits out (board.py)
        return [Note(EventKind.RESTARTING, "%s %s generation %d; it starts in %g s" % (
            cfg.node, taking(cfg.node, msg), g, float(msg.get("backoff") or 0.0)), fields={"generation": g})], replace(
            ledger, restart_at=now + float(msg.get("backoff") or 0.0), restart_ts=msg.get("ts"))
    if g == ledger.generation:
        # The coordinator moved the start of the generation this node waits for (a lost node's fence,
        # fence.py): a status with a new `ts` says so, once (the same status comes with every reply);
        # later only, never earlier, and only before it started here.
        if ledger.status.status == JobState.RESTARTING and ledger.restart_at is not None and \
                msg.get("ts") != ledger.restart_ts:
            later = now + float(msg.get("backoff") or 0.0)
            return [], replace(ledger, restart_at=max(ledger.restart_at, later), restart_ts=msg.get("ts"))
        return [], ledger
    if ledger.status.status == JobState.FINISHED or (ledger.status.status == JobState.FAILED and ledger.failure is None):
        return [], ledger
    backoff = float(msg.get("backoff") or 0.0)
    cause = msg.get("reason") or "failed"
    left = msg.get("restarts_left")
    resume = _resume(msg.get("resume_from"), g)
    fields = {"origin": msg.get("node"), "generation": g, "backoff": backoff, "restarts_left": left}
    if resume:  # the cause says it: `...; generation 3 resumes from X, the checkpoint before Y, ...`
        fields["resume_from"] = resume
    said = msg["back"] if isinstance(msg.get("back"), str) else "job failed (%s)" % cause
    note = Note(EventKind.RESTARTING, "%s; restart %d%s in %g s%s" % (
        said, g, " (%s left after it)" % left if isinstance(left, int) else "", backoff,
        "; %s is out of it: it %s" % (cfg.node, "is a spare and starts nothing" if cfg.spare and cfg.node not in
                                      (msg.get("out") or ()) else "stops its part and starts nothing") if out else ""),
                fields=fields)
    return [note], replace(ledger, status=Status(JobState.RESTARTING, cause, msg.get("node")), generation=g, failure=None,
                           failure_kind=None, failure_code=None, failure_loaded=None, replayed=False,
                           restart_at=None if out or held else now + backoff, restart_ts=msg.get("ts"), held=held and not out,
                           acted=False, pending=False, resume=resume)


def _resume(value, generation: int) -> dict | None:
    """The coordinator's `resume_from` for generation g (restart.py's Decision.resume), else None."""
    if isinstance(value, dict) and value.get("generation") == generation and isinstance(value.get("path"), str) \
            and value["path"]:
        return value
    return None


def replay_restart(ev: dict) -> Ledger:
    """The ledger after a `restarting` or `restarted` event of this node (a restarted agent reads its story).
    Restarting, it starts nothing before the coordinator's status says the generation is not held (may_start,
    quorum.py): the event cannot say whether it still is. Once it is not, at once (restarting)."""
    g = ev.get("generation") if isinstance(ev.get("generation"), int) else 0
    if ev.get("kind") == EventKind.RESTARTED:
        return Ledger(generation=g)
    return Ledger(generation=g, status=Status(JobState.RESTARTING, ev.get("reason"), ev.get("origin")), held=True,
                  replayed=True, resume=_resume(ev.get("resume_from"), g))


def relaunched(ledger: Ledger, generation: int) -> Ledger:
    """The ledger once this node started its part of `generation`: a fresh one, the orphans still followed."""
    return Ledger(generation=generation, orphans=ledger.orphans)


def fenced(msg: dict, ledger: Ledger, cfg: Config) -> tuple[list, Ledger]:
    """The coordinator's `fenced` answer: this node left the job (min_nodes) and never comes back into it.
    Its part is over for good: failed here, never restarted, everything of it stopped (act)."""
    reason = "fenced out of the job: %s" % (msg.get("reason") or "this node left it")
    if ledger.status.status == JobState.FAILED and ledger.status.reason == reason:
        return [], ledger
    fields = {"origin": msg.get("node"), "generation": msg.get("generation")}
    acted = ledger.acted and ledger.status.status in FINAL + (JobState.RESTARTING,)
    return [Note(EventKind.FENCED, reason, fields={k: v for k, v in fields.items() if v is not None})], replace(
        ledger, status=Status(JobState.FAILED, reason, msg.get("node")), failure=None, failure_kind=None, pending=False,
        restart_at=None, acted=acted)


def on_status(msg: dict, job_id: str, ledger: Ledger, cfg: Config, now: float = 0.0) -> tuple[list, Ledger]:
    """A status line from the coordinator (or its `fenced` answer)."""
    if msg.get("op") == "fenced" and msg.get("job_id") == job_id:
        return fenced(msg, ledger, cfg)
    if msg.get("op") != "status" or msg.get("job_id") != job_id:
        return [], ledger
    st = msg.get("status")
    if st == JobState.RESTARTING:
        return restarting(msg, ledger, cfg, now)
    if st == JobState.FAILED and ledger.pending:  # not restarted: now our failure is the job's end
        reason = msg.get("reason") or ledger.failure or "failed"
        ledger = replace(ledger, pending=False, status=Status(JobState.FAILED, reason, msg.get("node")))
        return [Note(EventKind.JOB_FAILED, reason, fields={"origin": msg.get("node"), "on_failure": cfg.on_failure,
                                                   "generation": ledger.generation})], ledger
    if st not in FINAL or ledger.status.status not in (JobState.RUNNING, JobState.RESTARTING):
        return [], ledger
    ledger = replace(ledger, status=Status(st, msg.get("reason"), msg.get("node")))
    if st != JobState.FAILED:
        return [], ledger
    note = Note(EventKind.JOB_FAILED, msg.get("reason") or "failed",
                fields={"origin": msg.get("node"), "on_failure": cfg.on_failure})
    return [note], ledger


REJOIN_WAIT = 600.0  # min_nodes: how long an agent that fenced itself waits to hear it is back in the job


def word_wait(ledger: Ledger, cfg: Config) -> float:
    """How long an agent whose part failed waits for the coordinator's word on it before it ends: under
    min_nodes, one that fenced itself waits to be taken back into a later generation (board.py)."""
    return REJOIN_WAIT if cfg.elastic and ledger.failure_kind == FailureKind.LOST else 2 * cfg.peer_timeout + cfg.grace


def next_deadline(obs: Observation, ledger: Ledger, cfg: Config) -> float | None:
    """The soonest moment a rule may fire without anything else happening."""
    times = []
    watching = ledger.status.status == JobState.RUNNING or cfg.on_failure == "keep"
    for p in obs.procs:
        if not p.live:
            continue
        if p.term_at is not None:
            times.append(p.term_at + cfg.grace + (1 if p.kill_signal == "SIGKILL" else 0))
        elif watching and p.name not in ledger.hung:
            since = progress_at(p, ledger)
            if since is not None:
                times.append(since + cfg.hang_timeout)
            if p.stopped_since is not None:
                times.append(p.stopped_since + cfg.hang_timeout)
    times += [o.term_at + cfg.grace for o in ledger.orphans if o.signal == "SIGTERM"]
    if ledger.status.status == JobState.RUNNING and not ledger.startup_checked and obs.startup_deadline:
        times.append(obs.startup_deadline)
    if ledger.status.status == JobState.RESTARTING and ledger.restart_at is not None:
        times.append(ledger.restart_at)
    return min(times) if times else None


class _Decision:
    """One call of `decide`: accumulates actions and the new ledger (nothing outside it changes)."""

    def __init__(self, obs: Observation, ledger: Ledger, cfg: Config):
        self.obs, self.ledger, self.cfg = obs, ledger, cfg
        self.actions: list = []
        self.by_name = {p.name: p for p in obs.procs}

    def note(self, kind: str, reason: str, p: ProcFacts | None = None, **fields) -> None:
        if p is not None:
            fields = dict(role=p.role, rank=p.rank, **fields)
        self.actions.append(Note(kind, reason, p.name if p else None,
                                 {k: v for k, v in fields.items() if v is not None}))

    def fail(self, reason: str, kind: FailureKind = FailureKind.OTHER, exit_code: int | None = None,
             loaded: tuple | None = None) -> None:
        actions, self.ledger = fail(self.ledger, self.cfg, reason, kind, exit_code, loaded)
        self.actions += actions

    def update(self, **changes) -> None:
        self.ledger = replace(self.ledger, **changes)

    # -- exits -------------------------------------------------------------------------------

    def exits(self) -> None:
        for p in self.obs.procs:
            if not p.ended or p.name in self.ledger.reported:
                continue
            self.update(reported=self.ledger.reported | {p.name})
            how = describe_end(p.exit_code, launcher=p.launcher if p.launcher_lost else None)
            if p.exit_code not in (0, None) and signal_of(p.exit_code) is None and self.obs.disk_full:
                how += " (No space left on device: %s on %s is full)" % (self.obs.disk_full, self.cfg.node)
            sig = signal_name(signal_of(p.exit_code))
            if p.close_reason:
                self.note(EventKind.KILLED, "%s: %s" % (how, p.close_reason), p, signal=p.kill_signal,
                          exit_code=p.exit_code, pid=p.pid)
            elif p.fenced:  # its launcher's dead-man: the fence itself is coordinator()'s
                self.note(EventKind.KILLED, "%s: %s" % (how, DEADMAN), p, signal=sig, exit_code=p.exit_code, pid=p.pid)
            elif self.obs.killed_by:
                why = stopped_by(self.obs.killed_by)
                self.note(EventKind.EXITED, "%s: %s" % (how, why), p, exit_code=p.exit_code, signal=sig, pid=p.pid)
                self.fail("%s on %s: %s" % (p.name, self.cfg.node, why), FailureKind.KILL_ALL)
            elif self.obs.disrupted[1]:  # not the program's failure: the node's (a lost node, or the job's end)
                self.note(EventKind.EXITED, "%s: %s" % (how, self.obs.disrupted[1]), p, exit_code=p.exit_code, signal=sig, pid=p.pid)
                self.fail("node %s %s" % (self.cfg.node, self.obs.disrupted[1]), self.obs.disrupted[0])
            else:
                self.note(EventKind.EXITED, how, p, exit_code=p.exit_code, signal=sig, pid=p.pid)
                if p.exit_code != 0:
                    self.fail("%s on %s %s" % (p.name, self.cfg.node, how), FailureKind.EXIT, p.exit_code, p.loaded)

    # -- hangs -------------------------------------------------------------------------------

    def hangs(self) -> None:
        now, cfg = self.obs.now, self.cfg
        trainers = any(p.role == "trainer" and p.live for p in self.obs.procs) or self.obs.peers.trainers_running > 0
        for p in self.obs.procs:
            if not p.live or p.name in self.ledger.hung or p.term_at is not None or p.role in EXIT_ONLY_ROLES:
                continue
            if p.role != "trainer" and not trainers and p.stopped_since is None:
                # A pserver waits for trainers in silence: only a hang while trainers run counts.
                quiet = dict(self.ledger.quiet)
                quiet[p.name] = now
                self.update(quiet=tuple(sorted(quiet.items())))
                continue
            reason = hang_reason(p, self.ledger, self.cfg.hang_timeout, now)
            if reason is None:
                continue
            self.update(hung=self.ledger.hung | {p.name})
            self.dump_stacks()
            first = first_to_stall(self.obs.procs, self.ledger, EXIT_ONLY_ROLES, default=p)
            if cfg.on_failure == "keep":
                self.note(EventKind.HANG, reason + "; not killed: on_failure is keep", p, pid=p.pid, first=first.name)
            else:
                self.note(EventKind.HANG, reason, p, signal="SIGTERM", pid=p.pid, first=first.name)
                self.actions.append(Stop(p.name, "hang: " + reason))
            self.fail("%s on %s%s%s" % (p.name, cfg.node, HUNG, reason), FailureKind.HANG)

    def dump_stacks(self) -> None:
        """Once a generation, before anything of it is stopped for a hang: every live process's stacks."""
        if self.ledger.stacks_taken:
            return
        self.update(stacks_taken=True)
        self.actions.append(DumpStacks(tuple(p.name for p in self.obs.procs if p.live and p.term_at is None)))

    # -- startup -----------------------------------------------------------------------------

    def startup(self) -> None:
        obs, cfg = self.obs, self.cfg
        if self.ledger.status.status != JobState.RUNNING or self.ledger.startup_checked or obs.startup_deadline is None \
                or obs.now < obs.startup_deadline:
            return
        self.update(startup_checked=True)  # whatever follows: the deadline never fires again
        missing = [n for n in obs.must_join if n not in obs.peers.seen]
        never = [] if cfg.spare else [p.name for p in obs.procs if not p.started]  # a spare's start when it stands in
        if not obs.peers.ever_connected and obs.must_join:
            reason = ("node %s never joined: no coordinator answered at %s within startup_timeout (%g s)%s"
                      % (cfg.coordinator_node, cfg.coordinator, cfg.startup_timeout,
                         ": %s" % obs.peers.error if obs.peers.error else ""))
        elif missing:
            reason = "node%s %s never joined: no agent of %s reached the coordinator within startup_timeout (%g s)" % (
                "s" if len(missing) > 1 else "", ", ".join(missing), "theirs" if len(missing) > 1 else "its",
                cfg.startup_timeout)
        elif never:
            reason = "%s on %s never started within startup_timeout (%g s)" % (", ".join(never), cfg.node,
                                                                             cfg.startup_timeout)
        else:
            return
        self.update(startup_failed=True)
        self.note(EventKind.NOT_JOINED, reason)
        self.fail(reason)

    # -- the coordinator -----------------------------------------------------------------------

    def coordinator(self) -> None:
        peers, cfg = self.obs.peers, self.cfg
        if self.ledger.coordinator_lost or self.ledger.status.status in FINAL:
            return
        # Ended by their launchers' dead-man while this agent was stopped: the fence it would have begun itself
        fenced = [p.name for p in self.obs.procs if p.fenced]
        lost = peers.ever_connected and (coordinator_lost(peers, cfg) or bool(peers.deposed))
        # (deposed: also with nothing running, so a restart it waits for never starts: tenure.py)
        if not (lost or fenced) or not (peers.deposed or fenced or any(p.live for p in self.obs.procs)):
            return
        self.update(coordinator_lost=True)
        age = peers.lease_age if peers.lease_age is not None else peers.silent_for
        reason = ("%s; %s" % (peers.deposed, FENCES_ITSELF) if peers.deposed else
                  "%s on %s: %s; %s" % (", ".join(fenced), cfg.node, DEADMAN, FENCES_ITSELF) if not lost else
                  "coordinator %s (agent of %s) unreachable: no answer to a beat for %.1f s (%s); %s "
                  "(fence_after %g s)" % (
                      cfg.coordinator, cfg.coordinator_node, age, peers.error or "no answer", FENCES_ITSELF,
                      cfg.fence_after)
                  + ("; %s" % cfg.without_coordinator if cfg.without_coordinator else "")
                  if not peers.connected else
                  "coordinator %s (agent of %s) answered nothing for %.0f s on an open connection (hung_timeout %.0f s)"
                  % (cfg.coordinator, cfg.coordinator_node, age, cfg.hung_timeout))
        self.note(EventKind.PEER_LOST, reason, peer=cfg.coordinator_node)
        # min_nodes: this node is as good as lost, which the coordinator takes as its leaving (should this
        # beat reach it before it lost the node), not as the job's failure; healed, it may come back
        self.fail(reason, FailureKind.LOST if cfg.elastic else FailureKind.OTHER)

    # -- orphans -------------------------------------------------------------------------------

    def orphans(self) -> None:
        now, grace = self.obs.now, self.cfg.grace
        orphans = {o.pid: o for o in self.ledger.orphans if o.pid in self.obs.orphans_alive}

        def adopt(pid: int, ctime: float, reason: str, name: str, of_job: str, p: ProcFacts | None = None, **fields):
            """A new orphan: SIGTERM now (SIGCONT, should it be stopped), SIGKILL once the grace is up."""
            orphans[pid] = Orphan(pid, ctime, reason, name, of_job, now)
            self.actions += [Signal(pid, ctime, signal.SIGTERM), Signal(pid, ctime, signal.SIGCONT)]
            self.note(EventKind.ORPHAN, reason + "; killing it", p, pid=pid, signal="SIGTERM", **fields)

        for s in self.obs.strays:
            reason = self._stray_reason(s)
            if reason is not None and s.pid not in orphans:
                adopt(s.pid, s.ctime, reason, "%s-%s" % (s.role, s.rank), s.job, role=s.role,
                      rank=int(s.rank) if s.rank.isdigit() else s.rank, job=s.job)
        for p in self.obs.procs:
            for pid, ctime in p.leftovers:
                if pid not in orphans:
                    adopt(pid, ctime, "outlived its main process %s (pid %s, which %s)" % (
                        p.name, p.pid, describe_end(p.exit_code, launcher=p.launcher if p.launcher_lost else None)),
                        p.name, "", p)
        if self.ledger.status.status in FINAL and not any(p.live for p in self.obs.procs):
            for p in self.obs.procs:
                if p.starter is not None and p.starter[0] not in orphans:
                    pid, ctime = p.starter
                    adopt(pid, ctime, "Open MPI's daemon (pid %d), which started %s here, outlived the job"
                          % (pid, p.name), p.name, "", p)
        for pid, o in list(orphans.items()):
            if o.signal == "SIGTERM" and now - o.term_at >= grace:
                orphans[pid] = replace(o, signal="SIGKILL")
                self.actions += [Signal(pid, o.ctime, signal.SIGKILL), Signal(pid, o.ctime, signal.SIGCONT)]
                self.note(EventKind.ORPHAN, "pid %d still alive %g s after SIGTERM (grace)" % (pid, grace), pid=pid,
                          signal="SIGKILL")
        self.update(orphans=tuple(orphans[k] for k in sorted(orphans)))

    def _stray_reason(self, s: Stray) -> str | None:
        if s.role == "agent":
            return None
        if s.job == self.cfg.job_id:
            p = self.by_name.get("%s-%s" % (s.role, s.rank))
            if p is None:
                if s.age > ORPHAN_MIN_AGE:
                    return "carries job %s's marker but %s-%s is not a process of this job here" % (s.job, s.role, s.rank)
                return None
            if p.ended:
                return "outlived its main process %s (pid %s, which %s)" % (
                    p.name, p.pid, describe_end(p.exit_code, launcher=p.launcher if p.launcher_lost else None))
            return None
        if s.age > ORPHAN_MIN_AGE and not s.job_running:
            return "belongs to job %s, which is not running" % s.job
        return None

    # -- acting on the job's status -----------------------------------------------------------

    def act(self) -> None:
        st = self.ledger.status
        if st.status not in FINAL + (JobState.RESTARTING,) or self.ledger.acted:
            return
        self.update(acted=True)
        live = [p for p in self.obs.procs if p.live]
        if st.status == JobState.FINISHED:
            names = ", ".join(p.name for p in live)
            self.note(EventKind.FINISHED, "every trainer exited with code 0" + ("; stopping %s" % names if names else ""))
            self.actions += [Stop(p.name, "the job finished") for p in live]
            return
        if self.cfg.on_failure == "keep":
            names = ", ".join("%s (pid %s)" % (p.name, p.pid) for p in live)
            self.note(EventKind.KEPT, "on_failure is keep: leaving %s running for debugging; stop them with `fab kill-all`"
                      % (names or "nothing (no process left here)"))
            return
        names = ", ".join(p.name for p in live)
        if HUNG in (st.reason or "") and live:  # another node's hang: its stacks here too, before the stop
            self.dump_stacks()
        what = "restarting the job" if st.status == JobState.RESTARTING else "job failed"
        self.note(EventKind.TEARDOWN, "%s (%s); %s" % (what, st.reason, ("stopping " + names) if names else
                                                "nothing else of it runs here"), origin=st.origin)
        self.actions += [Stop(p.name, "teardown: %s (%s)" % (what, st.reason)) for p in live if p.term_at is None]

    # -- restart: once the teardown is done and the backoff over, start the next generation --------

    def relaunch(self) -> None:
        ledger, obs, cfg = self.ledger, self.obs, self.cfg
        if ledger.status.status != JobState.RESTARTING:
            return  # (restart_at None: not yet, or this node is out of the generation and waits to be back)
        if obs.killed_by:
            self.fail("%s during the restart to generation %d: the job is not restarted"
                      % (stopped_by(obs.killed_by), ledger.generation), FailureKind.KILL_ALL)
            return
        if coordinator_lost(obs.peers, cfg):
            age = obs.peers.lease_age if obs.peers.lease_age is not None else obs.peers.silent_for
            self.fail("cannot restart: coordinator %s (agent of %s) unreachable for %.0f s"
                      % (cfg.coordinator, cfg.coordinator_node, age), FailureKind.LOST if cfg.elastic else FailureKind.START)
            return
        left = any(p.live or p.leftovers for p in obs.procs) or ledger.orphans
        if left or ledger.restart_at is None or obs.now < ledger.restart_at:
            return
        self.update(restart_at=None)
        self.actions.append(Relaunch(ledger.generation))

    # -- zombies -----------------------------------------------------------------------------

    def zombies(self) -> None:
        st = self.ledger.status.status
        ending = (st in FINAL and self.cfg.on_failure != "keep") or st in (JobState.FINISHED, JobState.RESTARTING)
        now = self.obs.now
        since, pending = dict(self.ledger.zombies_since), {}
        for p in self.obs.procs:
            for pid, ppid, ctime in p.zombies:
                key = (pid, ctime)
                if key not in self.ledger.zombies_seen:
                    first = pending[key] = since.get(key, now)
                    if now - first >= ZOMBIE_MIN_AGE:
                        del pending[key]
                        self.update(zombies_seen=self.ledger.zombies_seen | {key})
                        self.note(EventKind.ZOMBIE, "pid %d is defunct: its parent pid %d has not reaped it for %.0f s"
                                  % (pid, ppid, now - first), p, pid=pid, parent=ppid)
                if ppid == p.pid:
                    # The program itself gets its SIGTERM first, and an interval to act on it.
                    ending_here = p.term_at is not None and now - p.term_at >= min(self.cfg.grace, self.cfg.interval)
                else:
                    ending_here = ending or p.term_at is not None
                if ending_here and ppid not in self.ledger.zombie_parents:
                    self.update(zombie_parents=self.ledger.zombie_parents | {ppid})
                    self.actions += [Signal(ppid, None, signal.SIGKILL), Signal(ppid, None, signal.SIGCONT)]
                    self.note(EventKind.KILLED, "pid %d left defunct children unreaped while the job is ending; killed so "
                              "they are reaped" % ppid, p, pid=ppid, signal="SIGKILL")
        if tuple(pending.items()) != self.ledger.zombies_since:
            self.update(zombies_since=tuple(pending.items()))  # a zombie reaped meanwhile is forgotten

    # -- escalation ----------------------------------------------------------------------------

    def escalations(self) -> None:
        now, grace = self.obs.now, self.cfg.grace
        for p in self.obs.procs:
            if not p.live or p.term_at is None:
                continue
            if p.kill_signal == "SIGTERM" and now - p.term_at >= grace:
                self.actions.append(Escalate(p.name))
                self.note(EventKind.KILLED, "still alive %g s after SIGTERM (grace); SIGKILL" % grace, p, signal="SIGKILL",
                          pid=p.pid)
            elif p.kill_signal == "SIGKILL" and now - p.term_at >= grace + 1:
                self.actions.append(KillLauncher(p.name))
