"""The controller's view of a running job, kept up to date incrementally.

Used by `fab watch` (every node polled once per --interval) and the dashboard
(`streaming.StreamingCollector`, each node polled on its own thread, so an
unreachable node is marked as such without delaying the others). `fab
status` asks node ops `status` directly; all three show the job's state as
`jobstate.job_verdict` decides it, so they agree.

Each poll of a node is one remote command (node ops `collect`) that returns
only what was appended since the last poll (by byte offset), so a long run
is never re-read. Every record read from a node is untrusted input: it is
checked (`records`) before it is kept, and a malformed one is dropped and
counted per node. Long metric series are thinned (`series.Series`) so a
million-step run stays light in the browser.

Readers go through three calls: `snapshot()` (nodes, processes, the
verdict, events, trainers' progress, dropped-record counts: a consistent
copy), `series_since(cursor)` (the charts' points since a cursor) and
`follow_log(node, process)`.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fabtrain.controller import records
from fabtrain.contract.events import JOB_EVENTS, EventKind
from fabtrain.contract.jobfolder import EVENTS, HEALTH, LOGS, METRICS
from fabtrain.contract.identity import Trainer
from fabtrain.contract.opreplies import Chunk, Collect
from fabtrain.controller.jobstate import NodeObservation, Verdict, job_verdict
from fabtrain.controller.series import NODES, TRAINERS, Series, SeriesBook, SeriesDelta
from fabtrain.remote import rpc
from fabtrain.errors import UserError
from fabtrain.contract import jobid
from fabtrain.contract import progress as hook
from fabtrain.contract.checkpoints import CKPT_FIELDS
from fabtrain.remote.session import Session
from fabtrain.remote.transport import NodeError

__all__ = ["Collector", "NodeView", "Series", "Snapshot", "NodeSnapshot", "TrainerSnapshot", "LogTail", "Dropped"]


@dataclass
class NodeView:
    name: str
    up: bool | None = None  # None: not polled yet
    since: float | None = None  # when `up` last changed
    error: str | None = None
    down: str | None = None  # NodeError.kind of the last failed poll (transport.down_label says it)
    last_seen: float | None = None
    job_id: str | None = None
    health: dict | None = None  # health.json, checked (records.health)
    agent_age: float | None = None  # health.json's age on the node's clock at the last poll
    processes: list[dict] = field(default_factory=list)  # node ops' process records, checked
    killed: bool = False
    killed_by: str | None = None  # who wrote the job's `killed` marker (states.KILLERS)
    stop_reason: str | None = None  # why it was stopped, when a start that failed elsewhere stopped it
    slurm_job: str | None = None  # the Slurm job the node's job runs in (a job on Slurm)
    milestones: list[dict] = field(default_factory=list)  # the job-level events (job_failed, finished, kept)
    offsets: dict[str, int] = field(default_factory=dict)
    bad: set = field(default_factory=set)  # what was wrong in the last reply's snapshots (counted once)
    gpus: dict | None = None  # who holds the node's GPUs (records.gpu_holders), asked every GPU_EVERY s
    gpus_asked: float = 0.0

    def observation(self) -> NodeObservation:
        agent = self.health if self.health and self.health.get("job_id") == self.job_id else None
        return NodeObservation(self.name, self.up, self.job_id, tuple(self.processes), self.killed, agent,
                               self.agent_age if agent else None, tuple(self.milestones), self.error,
                               killed_by=self.killed_by, stop_reason=self.stop_reason)


@dataclass
class TrainerProgress:
    node: str
    name: Trainer  # a process, or a rank of it (contract/progress.py row)
    role: str
    rank: Any
    last: dict = field(default_factory=dict)  # the latest metrics record
    last_ts: float | None = None  # controller time of the latest record
    records: int = 0
    rate: float | None = None  # samples/s of the latest record that has one (an evaluation's has none)


@dataclass
class Dropped:
    """Records from one node that were not kept: how many, from which file, and the latest reason."""
    count: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    last: str | None = None

    def as_dict(self) -> dict:
        return {"count": self.count, "sources": dict(self.sources), "last": self.last}


@dataclass(frozen=True)
class NodeSnapshot:
    name: str
    host: str
    roles: tuple[str, ...]
    up: bool | None
    since: float | None
    error: str | None
    down: str | None  # NodeError.kind while up is False
    last_seen: float | None
    job_id: str | None
    killed: bool
    health: dict | None
    processes: tuple[dict, ...]
    slurm_job: str | None = None  # the Slurm job the node's job runs in (a job on Slurm)
    gpus: dict | None = None  # who holds the node's GPUs (records.gpu_holders)

    def agent_state(self) -> str | None:
        return next((p["state"] for p in self.processes if p["name"] == "agent"), None)


@dataclass(frozen=True)
class TrainerSnapshot:
    node: str
    name: Trainer
    role: str
    rank: Any
    last: dict
    last_ts: float | None
    records: int
    rate: float | None = None  # samples/s of its latest record that has one


@dataclass(frozen=True)
class Snapshot:
    cluster: str
    taken: float
    verdict: Verdict
    nodes: tuple[NodeSnapshot, ...]
    progress: dict[str, TrainerSnapshot]  # by process name
    events: tuple[dict, ...]  # newest first
    dropped: dict[str, dict]  # node -> Dropped.as_dict()
    restarts: tuple[dict, ...] = ()  # on_failure restart: {generation, ts, reason, step} for the charts' marks

    @property
    def job_id(self) -> str | None:
        return self.verdict.job_id

    def node(self, name: str) -> NodeSnapshot | None:
        return next((n for n in self.nodes if n.name == name), None)


@dataclass(frozen=True)
class LogTail:
    lines: list[str]
    offset: int | None  # how far into the log the collector has read


def _file_kind(rel: Any) -> tuple[str, str | None] | None:
    """("events", None), ("metrics", process) or ("logs", process) for a file node ops sent; else None."""
    if not isinstance(rel, str):
        return None
    if rel == EVENTS:
        return "events", None
    for kind, suffix in ((METRICS, ".jsonl"), (LOGS, ".log")):
        name = rel[len(kind) + 1:-len(suffix)] if rel.startswith(kind + "/") and rel.endswith(suffix) else ""
        if records.NAME_RE.match(name):
            return kind, name
    return None


# The parts of a `collect` reply that come again every poll, by the source their drops are counted under.
SNAPSHOTS = {"processes": "processes", "health": HEALTH, "gpus": "gpus"}


class Collector:
    METRIC_KEYS = ("loss", "samples_per_s", "eval_loss")
    TAIL_BYTES = 64 * 1024  # where a newly followed log starts: this far from its end
    MAX_BYTES = 1 << 20  # what node ops sends of one file per poll
    GPU_EVERY = 10.0  # seconds between asking a node who holds its GPUs (an nvidia-smi run there)
    MAX_MILESTONES = 100

    def __init__(self, session: Session, job_id: str | None = None, max_points: int = 1000,
                 max_events: int = 1000, log_lines: int = 200):
        self.session = session
        self.job_id = jobid.checked(job_id, UserError, optional=True)  # before any node is asked
        self.max_points = max_points
        self.lock = threading.RLock()
        self.nodes = {n.name: NodeView(n.name) for n in session.cluster.nodes}
        self.progress: dict[str, TrainerProgress] = {}  # by trainer: a process, or a rank of one (hook.row)
        self.own: set[str] = set()  # trainers with records of the program's own: the hook's are dropped
        self.restarts: dict[int, dict] = {}  # generation -> its mark (on_failure restart)
        self.series = SeriesBook(max_points)
        self.events: deque = deque(maxlen=max_events)  # newest first
        self.dropped: dict[str, Dropped] = {}  # by node
        self.log_lines = log_lines
        self.logs: dict[tuple[str, str], deque] = {}  # (node, process) -> recent lines
        self.followed_logs: set[tuple[str, str]] = set()
        self._mid_line: set[tuple[str, str]] = set()  # (node, file) read from mid-line: drop the first line
        self.started = time.time()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- polling -----------------------------------------------------------------------

    def poll(self) -> None:
        """Poll every node once, in parallel (fab watch)."""
        self.session.map(lambda t: self.poll_node(t.node.name))

    def poll_node(self, name: str, timeout: float = 30) -> None:
        view = self.nodes[name]
        transport = self.session.transport(self.session.cluster.node(name))
        with self.lock:
            offsets = dict(view.offsets)
            for node, proc in self.followed_logs:
                if node == name:
                    offsets.setdefault(f"logs/{proc}.log", -1)
        # -1: start near the end of a log we begin to follow (its tail, not its whole history)
        # The node's `current` job unless one was named (--job): a new job there replaces the old in the view.
        payload = {"job_id": self.job_id, "max_bytes": self.MAX_BYTES,
                   "offsets": {k: max(v, 0) for k, v in offsets.items()}}
        if time.time() - view.gpus_asked >= self.GPU_EVERY:
            payload["gpus"], view.gpus_asked = True, time.time()
        try:
            reply = self._collect(name, transport, payload, timeout)
        except NodeError as e:
            with self.lock:
                if view.up is not False:
                    view.since = time.time()
                view.up, view.error, view.down = False, str(e), e.kind
            return
        with self.lock:
            if view.up is not True:
                view.since = time.time()
            view.up, view.error, view.down, view.last_seen = True, None, None, time.time()
            if not isinstance(reply, dict):
                self._drop(name, "collect", "the reply is not an object")
                return
            self._apply(view, reply, offsets)

    def _collect(self, name: str, transport, payload: dict, timeout: float) -> dict:
        """One `collect` on one node (a subclass may keep a channel open instead)."""
        return rpc.call(transport, "collect", payload, timeout=timeout)

    def _apply(self, view: NodeView, wire: dict, asked: dict[str, int]) -> None:
        """Take in one `collect` reply (under the lock), read through its type (contract/opreplies.py Collect)
        part by part: every part checked before it is kept, a malformed one dropped and said."""
        name = view.name
        reply, wrong = Collect.parts(wire)
        # The snapshots (processes, health.json, GPUs) come again every poll: what is wrong in them is counted
        # once, when it first goes wrong (view.bad); anything else is said each time.
        bad = {(SNAPSHOTS[f], why) for f, why in wrong if f in SNAPSHOTS}
        for f, why in wrong:
            if f not in SNAPSHOTS:
                self._drop(name, "collect", why)
        # Another job than the offsets were for: what was read at them is not the new job's start.
        misread = reply.job_id != view.job_id and any(v > 0 for v in asked.values())
        if reply.job_id != view.job_id:
            view.offsets.clear()
            self._forget_job(name)
        view.job_id = reply.job_id
        view.killed = reply.killed is True
        view.killed_by = reply.killed_by
        view.stop_reason = records.stop_reason(reply.stop_reason)
        view.slurm_job = records.slurm_job(reply.slurm)
        view.processes = []
        for p in reply.processes or []:
            try:
                view.processes.append(records.process(p))
            except records.Malformed as e:
                bad.add(("processes", str(e)))
        view.health, view.agent_age = None, None
        if reply.health is not None:
            try:
                view.health = records.health(reply.health)
            except records.Malformed as e:
                bad.add((HEALTH, str(e)))
        if any(f == "gpus" for f, _ in wrong):
            view.gpus = None
        elif reply.gpus is not None:  # None: not asked this poll (GPU_EVERY)
            try:
                view.gpus = records.gpu_holders(reply.gpus)
            except records.Malformed as e:
                view.gpus = None
                bad.add(("gpus", str(e)))
        for source, why in sorted(bad - view.bad):  # sent again every poll: counted when it first goes wrong
            self._drop(name, source, why)
        view.bad = bad
        if view.health is not None and reply.time is not None:
            view.agent_age = reply.time - view.health["ts"]  # both on the node's clock
        for rel, chunk in (reply.files or {}).items() if not misread else ():
            self._read_chunk(view, rel, chunk, asked)
        self._sample_node(name, view.health)

    def _read_chunk(self, view: NodeView, rel: str, chunk: Chunk, asked: dict[str, int]) -> None:
        node = view.name
        kind = _file_kind(rel)
        if kind is None:
            self._drop(node, "collect", f"a malformed file chunk ({str(rel)[:80]})")
            return
        start = max(asked.get(rel, 0), 0)
        if asked.get(rel) == -1 and chunk.size - chunk.offset > self.TAIL_BYTES:
            # A long log we begin to follow: skip to its last TAIL_BYTES rather than read it all.
            view.offsets[rel] = chunk.size - self.TAIL_BYTES
            self._mid_line.add((node, rel))
            return
        if chunk.offset == start and not chunk.data and chunk.size - start >= self.MAX_BYTES:
            # One line longer than a poll's read: skip past it rather than ask for it forever.
            if (node, rel) not in self._mid_line and kind[0] != "logs":
                self._drop(node, rel, f"a line over {self.MAX_BYTES} bytes")
            view.offsets[rel] = start + self.MAX_BYTES
            self._mid_line.add((node, rel))
            return
        view.offsets[rel] = chunk.offset
        lines = chunk.data.split("\n")[:-1]  # whole lines only (node ops sends no partial line)
        if asked.get(rel) == -1:
            lines = lines[-self.log_lines:]
        if (node, rel) in self._mid_line:
            self._mid_line.discard((node, rel))
            lines = lines[1:]  # began mid-line
        if kind[0] == "logs":
            self.logs.setdefault((node, kind[1]), deque(maxlen=self.log_lines)).extend(lines)
        else:
            self._ingest(view, rel, kind[1], lines)

    def _ingest(self, view: NodeView, rel: str, process: str | None, lines: list[str]) -> None:
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = records.event(line) if process is None else records.metric(line)
            except records.Malformed as e:
                self._drop(view.name, rel, str(e))
                continue
            if process is not None:
                self._metric(view.name, process, rec)
                continue
            rec["node"] = view.name  # where it was read, whatever the line says
            self.events.appendleft(rec)
            g = rec.get("generation")
            if rec["kind"] == EventKind.RESTARTING and isinstance(g, int) and g not in self.restarts:
                # Marked on the step charts at the first step recorded after it (see _metric).
                self.restarts[g] = {"generation": g, "ts": rec.get("ts") or 0, "reason": rec.get("reason"), "step": None}
            if rec["kind"] in JOB_EVENTS and len(view.milestones) < self.MAX_MILESTONES:
                view.milestones.append(rec)

    def _drop(self, node: str, source: str, why: str) -> None:
        d = self.dropped.setdefault(node, Dropped())
        d.count += 1
        if source in d.sources or len(d.sources) < 64:
            d.sources[source] = d.sources.get(source, 0) + 1
        d.last = f"{source}: {why}"

    def _forget_job(self, node: str) -> None:
        """A new job on this node: drop what the old one left in the view (series, logs, events)."""
        for name in [n for n, p in self.progress.items() if p.node == node]:
            del self.progress[name]
            self.series.forget(TRAINERS, name)
            self.own.discard(name)
        for key in [k for k in self.logs if k[0] == node]:
            del self.logs[key]
        self._mid_line = {k for k in self._mid_line if k[0] != node}
        self.nodes[node].milestones.clear()
        self.restarts.clear()
        kept = [e for e in self.events if e.get("node") != node]
        self.events.clear()
        self.events.extend(kept)

    def _metric(self, node: str, process: str, rec: dict) -> None:
        name = hook.row(process, rec)  # a Trainer (contract/identity.py)
        p = self.progress.get(name)
        if rec.get("source") == hook.AUTO:
            if name in self.own:
                return  # the program writes its own records: they win
        elif name not in self.own:
            self.own.add(name)
            if p is not None:  # the hook's records came first: the row starts again with the program's
                del self.progress[name]
                self.series.forget(TRAINERS, name)
                p = None
        if rec.get("between_steps") and p is not None:  # busy without a step (evaluating): alive, nothing new
            p.last, p.last_ts = {**p.last, "ts": rec.get("ts", p.last.get("ts")), "busy": rec.get("busy")}, time.time()
            if rec.get("checkpoint"):  # a save that just returned: the trainer's last checkpoint from now on
                p.last = {**{k: v for k, v in p.last.items() if k not in CKPT_FIELDS},
                          **{k: v for k, v in rec.items() if k in CKPT_FIELDS}}
            return
        if p is None:
            role = rec.get("role") or name.role
            p = self.progress[name] = TrainerProgress(node, name, role, rec.get("rank"))
        p.last, p.last_ts, p.records = rec, time.time(), p.records + 1
        if rec.get("samples_per_s") is not None:
            p.rate = rec["samples_per_s"]
        step = rec.get("step")
        for mark in self.restarts.values():
            if mark["step"] is None and step is not None and (rec.get("ts") or 0) >= mark["ts"]:
                mark["step"] = step
        if step is not None:
            for key in self.METRIC_KEYS:
                if rec.get(key) is not None and not (key == "loss" and "loss_step" in rec):  # (an earlier step's)
                    self.series.add(TRAINERS, name, key, step, rec[key])

    def _sample_node(self, node: str, health: dict | None) -> None:
        if not health:
            return
        ts = health["ts"]
        host = health.get("host") or {}
        values = {"cpu": host.get("cpu_percent"), "mem": host.get("mem_percent")}
        utils = [g["util"] for g in health.get("gpus") or [] if g.get("util") is not None]
        if health.get("gpus"):
            values["gpu"] = sum(utils) / len(utils) if utils else None
        for key, value in values.items():
            s = self.series.get(NODES, node, key)
            if value is not None and (s is None or s.last is None or s.last[0] < ts):
                self.series.add(NODES, node, key, ts, value)

    # -- what readers use -----------------------------------------------------------------

    def follow_log(self, node: str, process: str) -> LogTail:
        """Start following a process's log (from its tail); return what is known of it."""
        with self.lock:
            self.followed_logs.add((node, process))
            return LogTail(list(self.logs.get((node, process), ())),
                           self.nodes[node].offsets.get(f"logs/{process}.log"))

    def series_since(self, cursor: str | None = None) -> SeriesDelta:
        """The charts' points added since `cursor` (None: all of them), and the next cursor."""
        with self.lock:
            return self.series.since(cursor)

    def verdict(self) -> Verdict:
        with self.lock:
            observations = [v.observation() for v in self.nodes.values()]
        return job_verdict(observations, self.job_id)

    def snapshot(self) -> Snapshot:
        """Everything a view shows, copied under the lock: a poll never changes it half-way."""
        cluster = self.session.cluster
        with self.lock:
            nodes = []
            for n in cluster.nodes:
                v = self.nodes[n.name]
                nodes.append(NodeSnapshot(n.name, n.host, tuple(n.roles), v.up, v.since, v.error, v.down, v.last_seen,
                                          v.job_id, v.killed, v.health, tuple(v.processes), v.slurm_job, v.gpus))
            observations = [v.observation() for v in self.nodes.values()]
            progress = {name: TrainerSnapshot(p.node, p.name, p.role, p.rank, dict(p.last), p.last_ts, p.records, p.rate)
                        for name, p in self.progress.items()}
            events = tuple(self.events)
            dropped = {node: d.as_dict() for node, d in self.dropped.items()}
            restarts = tuple(dict(self.restarts[g]) for g in sorted(self.restarts))
        return Snapshot(cluster.name, time.time(), job_verdict(observations, self.job_id), tuple(nodes), progress,
                        events, dropped, restarts)

    # -- background mode (dashboard) ------------------------------------------------------

    def start(self, interval: float = 1.0) -> None:
        for name in self.nodes:
            t = threading.Thread(target=self._loop, args=(name, interval), name=f"collect-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, name: str, interval: float) -> None:
        while not self._stop.is_set():
            began = time.time()
            self.poll_node(name)
            self._stop.wait(max(0.0, interval - (time.time() - began)))

    def stop(self) -> None:
        self._stop.set()
