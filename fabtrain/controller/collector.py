"""The controller's view of a running job, kept up to date incrementally.

Shared by `fab status`, `fab watch` and the dashboard. Each poll of a node is
one remote command (node_ops `collect`) that returns only what was appended
since the last poll (by byte offset), so a long run is never re-read. Each
node is polled on its own thread in the background mode, so an unreachable
node is marked as such without delaying the others. Long metric series are
thinned (see `Series`) so a million-step run stays light in the browser.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fabtrain.remote.session import Session
from fabtrain.remote.transport import NodeError


class Series:
    """One metric series (e.g. trainer-0's loss), thinned to at most ~max_points.

    Stride doubling: keep every point until the buffer holds 2N, then drop
    every other one and keep only every 2nd new point, and so on. The result
    is evenly spaced over the whole run, always includes the latest point,
    and costs O(1) amortised per point — deterministic, unlike a random
    reservoir, so the chart does not jitter between refreshes.
    """

    def __init__(self, max_points: int = 1000):
        self.max_points = max_points
        self.stride = 1
        self.seen = 0
        self.points: list[tuple[float, float]] = []
        self.last: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        self.last = (x, y)
        if self.seen % self.stride == 0:
            self.points.append((x, y))
            if len(self.points) >= 2 * self.max_points:
                self.points = self.points[::2]
                self.stride *= 2
        self.seen += 1

    def export(self) -> list[tuple[float, float]]:
        if self.last is not None and (not self.points or self.points[-1] != self.last):
            return self.points + [self.last]
        return list(self.points)


@dataclass
class NodeView:
    name: str
    up: bool | None = None  # None: not polled yet
    since: float | None = None  # when `up` last changed
    error: str | None = None
    last_seen: float | None = None
    job_id: str | None = None
    health: dict | None = None
    processes: list[dict] = field(default_factory=list)
    killed: bool = False
    offsets: dict[str, int] = field(default_factory=dict)
    partial_logs: dict[str, deque] = field(default_factory=dict)


@dataclass
class TrainerProgress:
    node: str
    name: str
    role: str
    rank: Any
    last: dict = field(default_factory=dict)  # the latest metrics record
    last_ts: float | None = None  # controller time of the latest record
    records: int = 0


class Collector:
    METRIC_KEYS = ("loss", "samples_per_s", "eval_loss")
    TAIL_BYTES = 64 * 1024  # where a newly followed log starts: this far from its end

    def __init__(self, session: Session, job_id: str | None = None, max_points: int = 1000,
                 max_events: int = 1000, log_lines: int = 200):
        self.session = session
        self.job_id = job_id
        self.max_points = max_points
        self.lock = threading.RLock()
        self.nodes = {n.name: NodeView(n.name) for n in session.cluster.nodes}
        self.progress: dict[str, TrainerProgress] = {}  # by process name
        self.series: dict[tuple[str, str], Series] = {}  # (process name, metric) -> series
        self.node_series: dict[tuple[str, str], Series] = {}  # (node, "cpu"|"gpu"|"mem") -> series
        self.events: deque = deque(maxlen=max_events)
        self.log_lines = log_lines
        self.logs: dict[tuple[str, str], deque] = {}  # (node, process) -> recent lines
        self.followed_logs: set[tuple[str, str]] = set()
        self._mid_line: set[tuple[str, str]] = set()  # (node, log) read from mid-line: drop the first line
        self.started = time.time()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- polling -----------------------------------------------------------------------

    def poll(self) -> None:
        """Poll every node once, in parallel (for fab status / fab watch)."""
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
        payload = {"job_id": self.job_id or view.job_id, "offsets": {k: max(v, 0) for k, v in offsets.items()}}
        tail_from = {k for k, v in offsets.items() if v == -1}
        try:
            reply = self._collect(name, transport, payload, timeout)
        except NodeError as e:
            with self.lock:
                if view.up is not False:
                    view.since = time.time()
                view.up, view.error = False, str(e)
            return
        with self.lock:
            if view.up is not True:
                view.since = time.time()
            view.up, view.error, view.last_seen = True, None, time.time()
            if reply.get("job_id") != view.job_id:
                view.offsets.clear()
                self._forget_job(name)
            view.job_id = reply.get("job_id")
            view.health = reply.get("health")
            view.processes = reply.get("processes", [])
            view.killed = reply.get("killed", False)
            for rel, chunk in reply.get("files", {}).items():
                if rel in tail_from and chunk.get("size", 0) - chunk["offset"] > self.TAIL_BYTES:
                    # A long log: skip to its last TAIL_BYTES rather than read it all from the top.
                    view.offsets[rel] = chunk["size"] - self.TAIL_BYTES
                    self._mid_line.add((name, rel))
                    continue
                view.offsets[rel] = chunk["offset"]
                lines = chunk["data"].splitlines()
                if rel in tail_from:
                    lines = lines[-self.log_lines:]
                if (name, rel) in self._mid_line:
                    self._mid_line.discard((name, rel))
                    lines = lines[1:]  # began mid-line
                self._ingest(name, rel, lines)
            self._sample_node(name, view.health)

    def _collect(self, name: str, transport, payload: dict, timeout: float) -> dict:
        """One `collect` on one node (a subclass may keep a channel open instead)."""
        return transport.call("collect", payload, timeout=timeout)

    def _forget_job(self, node: str) -> None:
        """A new job on this node: drop what the old one left in the view (series, logs, events)."""
        for name in [n for n, p in self.progress.items() if p.node == node]:
            del self.progress[name]
            for key in [k for k in self.series if k[0] == name]:
                del self.series[key]
        for key in [k for k in self.logs if k[0] == node]:
            del self.logs[key]
        self._mid_line = {k for k in self._mid_line if k[0] != node}
        kept = [e for e in self.events if e.get("node") != node]
        self.events.clear()
        self.events.extend(kept)

    def _ingest(self, node: str, rel: str, lines: list[str]) -> None:
        if rel.startswith("logs/"):
            buf = self.logs.setdefault((node, rel[5:-4]), deque(maxlen=self.log_lines))
            buf.extend(lines)
            return
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn or foreign line: skip it, never crash the view
            if not isinstance(rec, dict):
                continue
            if rel == "events.jsonl":
                rec.setdefault("node", node)
                self.events.appendleft(rec)
            else:
                self._metric(node, rel[len("metrics/"):-len(".jsonl")], rec)

    def _metric(self, node: str, name: str, rec: dict) -> None:
        p = self.progress.get(name)
        if p is None:
            p = self.progress[name] = TrainerProgress(node, name, rec.get("role", name.rsplit("-", 1)[0]), rec.get("rank"))
        p.last, p.last_ts, p.records = rec, time.time(), p.records + 1
        step = rec.get("step")
        if isinstance(step, (int, float)):
            for key in self.METRIC_KEYS:
                value = rec.get(key)
                if isinstance(value, (int, float)):
                    s = self.series.setdefault((name, key), Series(self.max_points))
                    s.add(step, value)

    def _sample_node(self, node: str, health: dict | None) -> None:
        if not isinstance(health, dict) or not isinstance(health.get("ts"), (int, float)):
            return
        ts = health["ts"]
        host = health.get("host") or {}
        values = {"cpu": host.get("cpu_percent"), "mem": host.get("mem_percent")}
        gpus = health.get("gpus") or []
        if gpus:
            utils = [g.get("util") for g in gpus if isinstance(g.get("util"), (int, float))]
            values["gpu"] = sum(utils) / len(utils) if utils else None
        for key, value in values.items():
            if isinstance(value, (int, float)):
                s = self.node_series.setdefault((node, key), Series(self.max_points))
                if s.last is None or s.last[0] < ts:
                    s.add(ts, value)

    def follow_log(self, node: str, process: str) -> list[str]:
        """Start following a process's log (from its tail); return what is known of it."""
        with self.lock:
            self.followed_logs.add((node, process))
            return list(self.logs.get((node, process), ()))

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

    # -- views --------------------------------------------------------------------------

    def job_state(self) -> str:
        """starting, running, finished, failed or killed.

        The agents' verdicts come first: they saw every exit as it happened,
        and after a normal end they stop the pservers themselves (SIGTERM, so
        exit 143), which by exit codes alone would read as a failure.
        """
        with self.lock:
            procs = [p for v in self.nodes.values() for p in v.processes if p.get("name") != "agent"]
            kinds = {e.get("kind") for e in self.events}
            if any(v.killed for v in self.nodes.values()):
                return "killed"
            if not procs:
                return "starting" if any(v.job_id for v in self.nodes.values()) else "no job"
            if "job_failed" in kinds:
                return "failed"
            if "finished" in kinds:
                return "finished"
            trainers = [p for p in procs if p["name"].startswith("trainer")]
            if trainers and all(p["state"] == "exited" and p.get("exit_code") == 0 for p in trainers):
                return "finished"
            # Killed by a signal (137) or with its launcher: a failure unless kill-all did it (above).
            if any(p["state"] == "exited" and p.get("exit_code") not in (0, None) for p in procs) or \
                    any(p["state"] in ("killed", "lost") for p in procs):
                return "failed"
            if any(p["state"] == "not started" for p in procs):
                return "starting"
            return "running"

    def job_id_seen(self) -> str | None:
        ids = {v.job_id for v in self.nodes.values() if v.job_id}
        return self.job_id or (max(ids) if ids else None)
