"""The job's state: one verdict from everything the controller observed.

`fab status`, `fab watch`, the dashboard's /api/job and /metrics all show
what `job_verdict` decides, so they cannot disagree. Its input is a list of
`NodeObservation`s, one per node, built from node ops' `status` replies
(`observe_status`) or the collector's view of `collect` replies: what node
ops saw of each process, the node agent's health.json (its own view of each
process and of the job), and the job-level events (job_failed, finished,
kept).

What is believed, in order: `fab kill-all`'s marker; the agents' word on the
job (they saw every exit as it happened, and after a normal end they stop
the pservers themselves, which by exit codes alone would read as a failure);
then the processes' own ends. Per process, node ops' fresh look wins, except
that a process whose launcher is gone (node ops: lost) but whose agent still
sees it running is running: the agent watches the program itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from fabtrain.controller import records
from fabtrain.contract.events import JOB_EVENTS, RESTARTS, EventKind
from fabtrain.contract.identity import Process
from fabtrain.contract.states import (LIVE, TERMINAL, JobState, ProcessState, recorded_state, signal_name,
                                  signal_of, stopped_by)


WATCH_EXIT = {JobState.FINISHED: 0, JobState.FAILED: 1, JobState.KILLED: 3}
RESTARTING_AFTER = "restarting after: "  # a restarting job's reason: its cause follows


FIRST_RECORD = "waiting for the first metrics record of "  # a start whose trainers run, silent so far


def process_role(name: str) -> tuple[str, int | None]:
    """"trainer-3" -> ("trainer", 3); "agent" -> ("agent", None): a process's role and index, as its
    Process (contract/identity.py) says them."""
    process = Process.of(name)
    return process.role, process.index


@dataclass(frozen=True)
class NodeObservation:
    name: str
    reachable: bool | None  # None: not asked yet
    job_id: str | None = None
    processes: tuple[dict, ...] = ()  # node ops' process records (records.process)
    killed: bool = False  # fab kill-all's marker is in the job's directory
    agent: dict | None = None  # the agent's health.json (records.health) when it is this job's
    agent_age: float | None = None  # its age on the node's own clock when observed
    events: tuple[dict, ...] = ()  # this node's job-level events (JOB_EVENTS)
    error: str | None = None
    killed_by: str | None = None  # who wrote that marker (states.KILLERS)
    stop_reason: str | None = None  # the marker's why: stopped because its start failed (not by a user)

    @property
    def agent_fresh(self) -> bool:
        """The agent wrote within three of its intervals (+2 s): its view of the processes holds."""
        if not self.agent or self.agent_age is None:
            return False
        return self.agent_age <= max(10.0, 3 * (self.agent.get("interval") or 1.0) + 2)


@dataclass(frozen=True)
class ProcessView:
    node: str
    name: Process
    state: ProcessState
    exit_code: int | None = None
    signal: str | None = None
    launcher_gone: bool = False  # node ops lost its launcher; the agent still sees the program
    stopped_by_agent: str | None = None  # why the agent stopped it, if it did
    reachable: bool = True

    @property
    def role(self) -> str:
        return Process.of(self.name).role

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def failed(self) -> bool:
        return self.state in (ProcessState.KILLED, ProcessState.LOST) or \
            (self.state == ProcessState.EXITED and self.exit_code != 0)

    @property
    def label(self) -> str:
        """running, exited 0, exited 3, killed (SIGKILL), lost, not started, running (launcher gone)."""
        if self.state == ProcessState.EXITED:
            return f"exited {self.exit_code}"
        if self.state == ProcessState.KILLED and self.signal:
            return f"killed ({self.signal})"
        return self.state.value + (" (launcher gone)" if self.launcher_gone else "")

    def why(self) -> str:
        """How it ended, as one clause: "trainer-1 on node3 killed by SIGKILL"."""
        how = {ProcessState.EXITED: f"exited with code {self.exit_code}",
               ProcessState.KILLED: f"killed by {self.signal}" if self.signal else "was killed",
               ProcessState.LOST: "lost (gone without an exit code)"}.get(self.state, self.state.value)
        return f"{self.name} on {self.node} {how}"


@dataclass(frozen=True)
class Straggler:
    """A rank the coordinator's agent reported behind the others (the `straggler` event) and still is."""
    node: str
    name: str
    rate: float | None = None  # its steps a second now (the step-rate rule)
    median: float | None = None  # the median rank's
    # synchronous training (the timings rule): the rank the others wait for, why, and how far off the median
    rank: int | None = None
    cause: str | None = None  # "data loading", "compute" or "communication"
    ratio: float | None = None  # communication: its share of time with sends backed up over the median rank's

    @property
    def mark(self) -> str:
        """What fab status, fab watch and the dashboard put next to its process."""
        if self.cause:
            who = f"rank {self.rank}: " if self.rank is not None else ""
            if self.cause == "communication":
                return f"STRAGGLER {who}communication, sends backed up {self.ratio:.1f}x the median"
            return f"STRAGGLER {who}{self.cause} {self.ratio:.1f}x the median"
        return f"STRAGGLER {self.rate:.3g} vs median {self.median:.3g} steps/s"


@dataclass(frozen=True)
class Verdict:
    state: JobState
    reason: str = ""
    ended: bool = False  # nothing of the job runs any more (or it failed and on_failure keep left the rest)
    kept: bool = False  # failed, and on_failure keep left the survivors running
    on_failure: str | None = None
    job_id: str | None = None
    said_by: tuple[str, ...] = ()  # the nodes whose agents gave the job's state
    processes: tuple[ProcessView, ...] = ()
    unreachable: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    generation: int = 0  # on_failure restart: how many times the job was restarted
    restarts_left: int | None = None  # None: the job does not restart
    cause: tuple[str, str | None] | None = None  # (node, process or None): where a failure or restart began
    startup_deadline: float | None = None  # starting: when the agents' startup_timeout runs out (node clock)
    restart_at: float | None = None  # restarting: when the backoff ends and the next generation starts
    stragglers: tuple[Straggler, ...] = ()  # running: the ranks that fell behind and have not caught up
    left: tuple[str, ...] = ()  # min_nodes: the nodes that left the job (node_left events)
    world_size: int | None = None  # min_nodes: the trainers of the smaller world, once a node left
    back: str | None = None  # min_nodes: `node3 back in generation 2 (WORLD_SIZE 3)`, in the generation that took it
    blame: str | None = None  # failed or restarting after a hang: the rank(s) the others waited for
    spares: tuple = ()  # (spare, the node whose slot it holds, or None while idle), as the spares' agents say

    def straggler(self, node: str, name: str) -> Straggler | None:
        return next((s for s in self.stragglers if s.node == node and s.name == name), None)

    @property
    def restarts(self) -> str:
        """"generation 1, 2 restarts left", or "" for a job that does not restart."""
        if self.restarts_left is None and not self.generation:
            return ""
        left = self.restarts_left
        return f"generation {self.generation}" + (f", {left} restart{'s' if left != 1 else ''} left"
                                                  if left is not None else "")

    @property
    def exit_code(self) -> int | None:
        """fab watch's exit code: 0 finished, 1 failed, 3 killed; None while not ended."""
        return WATCH_EXIT.get(self.state)

    def summary(self) -> str:
        """The reason, with what became of the survivors of a failure."""
        reason = f"{self.reason}; {self.blame}" if self.blame else self.reason
        if self.state != JobState.FAILED or not self.on_failure:
            return reason
        what = "on_failure keep: survivors left running for debugging (fab status, fab kill-all)" if self.kept \
            else f"torn down on every node (on_failure {self.on_failure})"
        return f"{reason}; {what}"

    def process(self, node: str, name: str) -> ProcessView | None:
        return next((p for p in self.processes if p.node == node and p.name == name), None)


def observe_status(reply) -> NodeObservation:
    """A NodeObservation from one node ops `status` reply (a transport Reply whose value is a
    contract.opreplies.Status, asked with health=True); its records are cleaned by records.py."""
    if not reply.ok:
        return NodeObservation(reply.node, False, error=reply.error)
    v = reply.value
    try:
        health = records.health(v.health) if v.health is not None else None
    except records.Malformed:
        health = None
    agent = health if health and health.get("job_id") == v.job_id else None
    events = list((agent or {}).get("events") or [])
    try:
        events.append(records.event_record(v.last_event))
    except records.Malformed:
        pass
    age = v.time - agent["ts"] if agent and v.time is not None else None
    return NodeObservation(name=reply.node, reachable=True, job_id=v.job_id,
                           processes=tuple(records.kept_processes(v.processes)),
                           killed=v.killed is True, agent=agent, agent_age=age,
                           events=tuple(e for e in events if e.get("kind") in JOB_EVENTS),
                           killed_by=v.killed_by, stop_reason=records.stop_reason(v.stop_reason))


def _process_view(obs: NodeObservation, p: dict, seen: dict | None) -> ProcessView:
    """One process: node ops' look, and the agent's where node ops lost the launcher."""
    alive = p["state"] in LIVE
    state = recorded_state(alive, p["state"], p.get("exit_code"), None)
    code, sig = p.get("exit_code"), p.get("signal") or signal_name(signal_of(p.get("exit_code")))
    gone = False
    if state == ProcessState.LOST and seen and seen.get("state") and obs.agent_fresh:
        agent_state = recorded_state(seen["state"] in LIVE, seen["state"],
                                    seen.get("exit_code"), None)
        if agent_state != ProcessState.LOST:
            gone = agent_state in LIVE
            state, code = agent_state, seen.get("exit_code")
            sig = seen.get("signal") or signal_name(signal_of(code))
    return ProcessView(node=obs.name, name=Process.of(p["name"]), state=state,
                       exit_code=code if state != ProcessState.LOST else None,
                       signal=sig if state == ProcessState.KILLED else None, launcher_gone=gone,
                       stopped_by_agent=(seen or {}).get("killed_by_agent"), reachable=obs.reachable is True)


def _processes(obs: NodeObservation) -> list[ProcessView]:
    seen = {hp["name"]: hp for hp in (obs.agent or {}).get("processes") or []}
    return [_process_view(obs, p, seen.get(p["name"])) for p in obs.processes if p["name"] != "agent"]


@dataclass
class _Facts:
    """What the agents said of the job: its end, and who said it."""
    failed: str | None = None
    failed_by: list = field(default_factory=list)
    finished: str | None = None
    finished_by: list = field(default_factory=list)
    kept: bool = False
    on_failure: str | None = None
    restarting: str | None = None  # why, while an agent says the job is restarting
    generation: int = 0
    restarts_left: int | None = None
    origin: str | None = None  # the node where the failure (or the restart's cause) began
    restart_at: float | None = None  # the restarting event's time + its backoff
    left: set = field(default_factory=set)  # nodes that left the job (min_nodes), as the agents say
    world_size: int | None = None  # the trainers of the smaller world (the smallest an agent says)
    back: tuple | None = None  # (generation, an agent's word that it took a node back) (min_nodes)
    spares: dict = field(default_factory=dict)  # spare node -> the slot it holds (None: idle), as its agent says
    blame: tuple | None = None  # (every node's ranks?, ts, sentence): the rank(s) the others waited for at a hang


def _since_restart(events) -> list[dict]:
    """A node's job-level events after its last restart: a failure before it was restarted, not final."""
    events = sorted(events, key=lambda e: e.get("ts") or 0)
    last = max((i for i, e in enumerate(events) if e["kind"] in RESTARTS), default=-1)
    return events[last + 1:]


def _restart_facts(f: _Facts, n: NodeObservation) -> None:
    job = (n.agent or {}).get("job") or {}
    if job.get("on_failure") == "restart":
        g = job.get("generation")
        f.generation = max(f.generation, g if isinstance(g, int) else 0)
        if isinstance(job.get("restarts_left"), int):
            f.restarts_left = job["restarts_left"] if f.restarts_left is None else min(f.restarts_left,
                                                                                         job["restarts_left"])
    for e in n.events:
        if e["kind"] in RESTARTS and isinstance(e.get("generation"), int):
            f.generation = max(f.generation, e["generation"])
    if isinstance(job.get("back"), str):  # (its generation, the words): the current generation's is said
        f.back = max(f.back or (-1, ""), (job.get("generation") or 0, job["back"]))
    if job.get("spare") is True:
        f.spares[n.name] = job.get("slot") if isinstance(job.get("slot"), str) else None
    if job.get("out") and isinstance(job.get("world_size"), int):
        f.left.update(job["out"])
        f.world_size = job["world_size"] if f.world_size is None else min(f.world_size, job["world_size"])
    # An idle spare's agent waits out, as restarting, every generation that does not take it: not the job's word.
    if job.get("status") == JobState.RESTARTING and not (job.get("spare") is True and job.get("slot") is None):
        f.restarting = f.restarting or f"{RESTARTING_AFTER}{job.get('reason') or 'a failure'}"
        f.origin = f.origin or job.get("origin")
        for e in n.events:
            if e["kind"] == EventKind.RESTARTING and e.get("generation") == f.generation and records.finite(e.get("ts")):
                at = e["ts"] + (e.get("backoff") or 0.0)
                f.restart_at = at if f.restart_at is None else max(f.restart_at, at)


def _facts(nodes: list[NodeObservation]) -> _Facts:
    f = _Facts()
    failures = []
    for n in nodes:
        _restart_facts(f, n)
    for n in nodes:
        if n.name in f.left:  # left the job (min_nodes), fenced out: its own end is not the job's
            continue
        for e in _since_restart(n.events):
            if e["kind"] == EventKind.JOB_FAILED:
                failures.append((e.get("ts") or 0, e.get("reason") or "failed", e.get("origin") or n.name))
                f.on_failure = f.on_failure or e.get("on_failure")
                f.failed_by.append(n.name)
            elif e["kind"] == EventKind.FINISHED:
                f.finished = f.finished or "every trainer exited with code 0"
                f.finished_by.append(n.name)
            elif e["kind"] == EventKind.KEPT:
                f.kept = True
        b = (n.agent or {}).get("blame")
        if b:  # the coordinator's node's (every node's ranks) over a hung node's own
            said = (b.get("job") is True, n.agent.get("ts") or 0, b["text"])
            f.blame = max(f.blame or said, said)
        job = (n.agent or {}).get("job") or {}
        if job.get("status") == JobState.FAILED and job.get("pending") is not True:  # pending: may be restarted
            failures.append((float("inf"), job.get("reason") or "failed", job.get("origin") or n.name))
            f.on_failure = f.on_failure or job.get("on_failure")
            f.kept |= job.get("kept") is True
            f.failed_by.append(n.name)
        elif job.get("status") == JobState.FINISHED:
            f.finished = f.finished or "every trainer exited with code 0"
            f.finished_by.append(n.name)
    if failures:
        _, f.failed, f.origin = min(failures, key=lambda t: t[0])  # the first to fail says why
    f.failed_by = sorted(set(f.failed_by))
    f.finished_by = sorted(set(f.finished_by))
    return f


def _decide(nodes: list[NodeObservation], ours: list[NodeObservation], procs: list[ProcessView],
            facts: _Facts, job_id: str | None) -> tuple[JobState, str, list[str]]:
    if any(n.killed for n in ours):
        # A start that failed on one node stopped the rest (all or nothing): a failure, not the user's kill.
        why = next((n.stop_reason for n in ours if n.killed and n.stop_reason), None)
        if why:
            return JobState.FAILED, why, []
        return JobState.KILLED, stopped_by(next((n.killed_by for n in ours if n.killed_by), None)), []
    if facts.failed is not None:
        return JobState.FAILED, facts.failed, facts.failed_by
    if facts.restarting is not None:
        return JobState.RESTARTING, facts.restarting, []
    if facts.finished is not None:
        # Finished is the whole job's state: name every node of it that answered, not only the agents that said so first.
        return JobState.FINISHED, facts.finished, sorted(set(facts.finished_by) | {n.name for n in ours if n.reachable})
    if not any(n.reachable for n in nodes):
        asked = any(n.reachable is False for n in nodes)
        return JobState.UNKNOWN, "no node reachable" if asked else "no node asked yet", []
    if not procs:
        if job_id:
            return JobState.STARTING, "no process of the job started yet", []
        return JobState.NO_JOB, "no job on any node", []
    trainers = [p for p in procs if p.role == "trainer"]
    if trainers and all(p.state == ProcessState.EXITED and p.exit_code == 0 for p in trainers):
        return JobState.FINISHED, "every trainer exited with code 0", []
    bad = [p for p in procs if p.failed]
    if bad:
        return JobState.FAILED, ", ".join(p.why() for p in bad), []
    pending = [p.name for p in procs if p.state == ProcessState.NOT_STARTED]
    if pending:
        return JobState.STARTING, f"waiting for {', '.join(pending)}", []
    silent = _before_first_record(ours)
    if silent:
        return JobState.STARTING, f"{FIRST_RECORD}{', '.join(silent)}", []
    return JobState.RUNNING, "", []


def _startup_deadline(n: NodeObservation) -> float | None:
    """When this node's agent fails the job's startup (startup_timeout), while that is still ahead."""
    job = (n.agent or {}).get("job") or {}
    at = job.get("startup_deadline")
    if not n.agent_fresh or job.get("status") != "running" or not records.finite(at) or at <= n.agent["ts"]:
        return None
    return at


def _before_first_record(nodes: list[NodeObservation]) -> list[str]:
    """Live trainers with no metrics record yet and nothing in their log, while their agent's startup
    allowance runs: a line the program printed is a sign of life (it runs), as a record is."""
    out = []
    for n in nodes:
        if _startup_deadline(n) is None:
            continue
        printed = {p["name"] for p in n.processes if p.get("last_line")}
        out += [p["name"] for p in (n.agent or {}).get("processes") or []
                if Process.of(p["name"]).role == "trainer" and p.get("state") in {s.value for s in LIVE}
                and p.get("last_record") is None and p["name"] not in printed]
    return out


def _cause(state: JobState, reason: str, procs: list[ProcessView], facts: _Facts) -> tuple | None:
    """Where a failure began: the process its reason names ("<process> on <node> ...", the words of
    the agents and of ProcessView.why), else the node it was noted on."""
    if state not in (JobState.FAILED, JobState.RESTARTING):
        return None
    said = reason.removeprefix(RESTARTING_AFTER)
    named = next((p for p in procs if said.startswith(f"{p.name} on {p.node} ")), None)
    if named is not None:
        return named.node, named.name
    return (facts.origin, None) if facts.origin else None


def _stragglers(state: JobState, ours: list[NodeObservation], procs: list[ProcessView]) -> tuple[Straggler, ...]:
    """The coordinator's agent's word (its health.json `stragglers`: reported, and below the share of
    the median now), while that agent is fresh, the job runs and the rank is live: a rank that
    caught up leaves the list there, and a job that ended marks none."""
    if state != JobState.RUNNING:
        return ()
    live = {(p.node, p.name) for p in procs if p.live}
    found = {}
    for n in (n for n in ours if n.agent_fresh):
        for s in n.agent.get("stragglers") or []:
            if (s["node"], s["name"]) in live and s.get("cause") and s.get("ratio") is not None:
                found[(s["node"], s["name"])] = Straggler(s["node"], s["name"], rank=s.get("rank"), cause=s["cause"],
                                                          ratio=s["ratio"])
            elif (s["node"], s["name"]) in live and s.get("rate") is not None and s.get("median") is not None:
                found.setdefault((s["node"], s["name"]), Straggler(s["node"], s["name"], s["rate"], s["median"]))
    return tuple(found[k] for k in sorted(found))


def job_verdict(nodes: Iterable[NodeObservation], job_id: str | None = None) -> Verdict:
    """The job's state from one observation per node (of job `job_id`, else the newest job seen)."""
    nodes = list(nodes)
    job_id = job_id or max((n.job_id for n in nodes if n.job_id), default=None)
    ours = [n for n in nodes if job_id is not None and n.job_id == job_id]
    procs = [p for n in ours for p in _processes(n)]
    facts = _facts(ours)
    idle = {spare for spare, slot in facts.spares.items() if slot is None}  # its processes start when it stands in
    procs = [p for p in procs if p.node not in idle]
    state, reason, said_by = _decide(nodes, ours, [p for p in procs if p.node not in facts.left], facts, job_id)
    live = any(p.live for p in procs if p.reachable)
    pending = any(p.state == ProcessState.NOT_STARTED for p in procs)
    ended = any(n.reachable for n in ours) and not live and state in TERMINAL and \
        (state != JobState.FINISHED or not pending)
    kept = state == JobState.FAILED and facts.kept
    notes = tuple(f"{p.name} on {p.node}: its launcher is gone; its agent still sees it {p.state.value}"
                  for p in procs if p.launcher_gone)
    # The allowance fails a start whose nodes did not join or whose processes did not start, never one
    # whose processes run without a record yet: no time left is shown for that.
    deadlines = [d for d in map(_startup_deadline, ours) if d is not None] \
        if state == JobState.STARTING and not reason.startswith(FIRST_RECORD) else []
    return Verdict(state=state, reason=reason, ended=ended or kept, kept=kept,
                   on_failure=facts.on_failure if state == JobState.FAILED else None, job_id=job_id,
                   said_by=tuple(said_by), processes=tuple(procs),
                   unreachable=tuple(n.name for n in nodes if n.reachable is False), notes=notes,
                   generation=facts.generation, restarts_left=facts.restarts_left,
                   cause=_cause(state, reason, procs, facts), startup_deadline=min(deadlines, default=None),
                   restart_at=facts.restart_at if state == JobState.RESTARTING else None,
                   stragglers=_stragglers(state, ours, procs),
                   left=tuple(sorted(facts.left)), world_size=facts.world_size,
                   back=facts.back[1] if facts.back and facts.back[0] == facts.generation
                   and state in (JobState.RUNNING, JobState.RESTARTING) else None,
                   blame=facts.blame[2] if facts.blame and state in (JobState.FAILED, JobState.RESTARTING) else None,
                   spares=tuple(sorted(facts.spares.items())))
