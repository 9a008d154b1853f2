"""What the JSON API returns (no Flask here), built from what the collector offers.

The collector's interface is three calls: `snapshot()` (a consistent copy of
nodes, processes, the job's verdict, events, progress and dropped-record
counts), `series_since(cursor)` (the charts' points) and `follow_log()`.
Every record in a snapshot was checked on ingest (controller/records.py),
so these views only shape it.
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

from fabtrain.controller import checkpoints
from fabtrain.controller.jobstate import process_role  # noqa: F401 (the dashboard's /metrics reads it here)
from fabtrain.controller.state import recorded_ports
from fabtrain.controller.series import NODES, TRAINERS
from fabtrain.controller.verdict_text import sentence
from fabtrain.contract.events import CAUSES, NODE_CAUSES, EventKind
from fabtrain.contract.states import TERMINAL, JobState, ProcessState, signal_name, signal_of
from fabtrain.contract.identity import Process, Trainer
from fabtrain.remote.transport import down_label

__all__ = ["number", "short", "process_role", "process_label", "cluster_view", "job_view",
           "cause_view", "kill_control", "MetricsCursor", "events_view"]


# -- small helpers ------------------------------------------------------------------------


def number(value: Any) -> float | int | None:
    """A finite number or None (NaN and inf are not JSON)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def short(value: Any, digits: int = 6) -> float | int | None:
    """A number with `digits` significant digits: 5.210000000000001 -> 5.21 (smaller JSON)."""
    value = number(value)
    if value is None or isinstance(value, int):
        return value
    return float(f"{value:.{digits}g}")


def _process_json(node: str, p: dict, hp: dict, verdict) -> dict:
    """One process as the page shows it: the verdict's state (node ops' and the agent's views merged)."""
    name = Process.of(p["name"])  # one already (controller/records.py), unless a test made the record
    seen = verdict.process(node, name)
    return {
        "name": name, "role": name.role, "rank": name.index,
        "state": seen.state.value if seen else p["state"],
        "exit_code": seen.exit_code if seen else p.get("exit_code"),
        "signal": seen.signal if seen else signal_name(signal_of(p.get("exit_code"))),
        "label": process_label(p, seen), "launcher_gone": bool(seen and seen.launcher_gone),
        "pid": p.get("pid"), "launcher_pid": p.get("launcher_pid") or hp.get("launcher_pid"),
        "uptime": short(p.get("uptime"), 5),
        "started_at": number(p.get("started_at")), "zombies": p.get("zombies") or 0,
        "cpu_percent": short(hp.get("cpu_percent"), 3), "rss": number(hp.get("rss")),
        "children": number(hp.get("children")), "last_progress": number(hp.get("last_progress")),
        "step_rate": short(hp.get("step_rate"), 4),
        "last_line": (p.get("last_line") or "")[-200:],
    }


def process_label(p: dict, seen=None) -> str:
    """running, stopped, exited 0, exited 3, killed (SIGKILL), lost, not started; +N zombie."""
    label = seen.label if seen is not None else (p.get("state") or "?")
    return f"{label} +{p['zombies']} zombie" if p.get("zombies") and p.get("state") != "exited" else label


# -- /api/cluster ---------------------------------------------------------------------------


def cluster_view(snap, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    return {"cluster": snap.cluster, "now": now, "nodes": [_node_view(n, snap.verdict, now) for n in snap.nodes]}


def _node_view(n, verdict, now: float) -> dict:
    health = n.health
    by_name = {hp["name"]: hp for hp in (health or {}).get("processes") or []}
    out = {
        "name": n.name, "host": n.host, "roles": list(n.roles),
        "up": n.up, "since": n.since, "error": n.error, "last_seen": n.last_seen,
        "down": down_label(n.down).lower() if n.up is False else None,  # "unreachable", "no reply", "error"
        "job_id": n.job_id, "killed": n.killed, "health": None,
        "processes": [_process_json(n.name, p, by_name.get(p["name"], {}), verdict) for p in n.processes],
        "gpu_holders": n.gpus,  # {"total", "free", "busy": [{"index", "by"}]}: which job, or user and pid
    }
    if health:
        ts = health["ts"]
        interval = health.get("interval") or 1.0
        age = now - ts
        agent = health.get("agent")
        out["health"] = {
            "ts": ts, "age": short(age, 4),
            # The agent writes every `interval`: three missed snapshots and it is stale.
            "stale": age > max(3 * interval, 5.0),
            "host": {k: short(v, 6) if isinstance(v, float) else v for k, v in (health.get("host") or {}).items()},
            "gpus": [{k: short(g.get(k), 6) for k in ("index", "util", "mem_used", "mem_total", "temp", "power_w")}
                     | {"name": str(g.get("name") or "")[:80]} for g in health.get("gpus") or []],
            "agent": {k: short(agent.get(k), 4) for k in ("pid", "rss", "cpu_percent")} if agent else None,
        }
    return out


# -- /api/job -------------------------------------------------------------------------------


def job_view(snap, stale_after: float, ended: dict, now: float | None = None) -> dict:
    """The job's state (the verdict `fab status` and `fab watch` show), elapsed time, each
    trainer's progress, and the records dropped as malformed, per node.

    `ended` (job id -> time) remembers when this dashboard first saw the job
    in a terminal state, so the elapsed time stops there.
    """
    now = time.time() if now is None else now
    verdict = snap.verdict
    job_id = verdict.job_id
    procs = [(n.name, p) for n in snap.nodes if job_id is None or n.job_id == job_id for p in n.processes]
    health_progress = {hp["name"]: hp["last_progress"] for n in snap.nodes
                       for hp in (n.health or {}).get("processes") or [] if hp.get("last_progress") is not None}
    started = [p["started_at"] for _, p in procs if p.get("started_at") is not None]
    started_at = min(started) if started else None
    terminal = verdict.state in TERMINAL
    if terminal and job_id is not None:
        # The job's own end (its last event, as the jobs table's duration ends at its last write), not when
        # this dashboard first saw it ended: a page opened later would count the time between.
        last_event = max((e["ts"] for e in getattr(snap, "events", ()) if isinstance(e.get("ts"), (int, float))),
                         default=None)
        ended.setdefault(job_id, last_event if last_event is not None and started_at is not None
                         and last_event >= started_at else now)
    ended_at = ended.get(job_id) if terminal else None
    elapsed = ((ended_at or now) - started_at) if started_at is not None else None
    states = {p["name"]: (node, p) for node, p in procs if p["name"] != "agent"}
    counts = {"total": len(verdict.processes), "running": 0, "exited_ok": 0, "failed": 0, "killed": 0}
    for v in verdict.processes:
        key = {ProcessState.KILLED: "killed", ProcessState.LOST: "failed"}.get(v.state)
        if v.live:
            key = "running"
        elif v.state == ProcessState.EXITED:
            key = "exited_ok" if v.exit_code == 0 else "failed"
        if key:
            counts[key] += 1
    trainers = _trainers(snap, states, health_progress, stale_after, now)
    dropped = {node: d for node, d in sorted(snap.dropped.items())}
    return {
        "job_id": job_id, "cluster": snap.cluster, "state": verdict.state.value, "reason": verdict.summary(),
        "sentence": sentence(verdict, now), "cause": cause_view(snap), "kill": kill_control(verdict),
        "startup_deadline": verdict.startup_deadline, "restart_at": verdict.restart_at,
        "ended": verdict.ended, "notes": list(verdict.notes), "now": now,
        "started_at": started_at, "ended_at": ended_at, "elapsed": short(elapsed, 7),
        "processes": counts, "trainers": trainers, "stale_after": stale_after,
        "stale": [t["name"] for t in trainers if t["stale"]], "unreachable": list(verdict.unreachable),
        "dropped": dropped, "dropped_total": sum(d["count"] for d in dropped.values()),
        "ports": recorded_ports(snap.cluster, job_id),  # the ports it started with (`auto` ones: chosen; on Slurm None)
        # on_failure restart: the generation, restarts left, and each restart (marked on the step charts)
        "generation": verdict.generation, "restarts_left": verdict.restarts_left,
        "restarts": [dict(r) for r in getattr(snap, "restarts", ())],
        # what the running generation resumed from (the agents' words, as fab status says them)
        "resumed": checkpoints.resumed_lines([(n.name, n.health) for n in snap.nodes
                                              if job_id is None or n.job_id == job_id]),
    }


def _event_process(e: dict) -> str | None:
    if e.get("name"):
        return e["name"]
    return f"{e['role']}-{e['rank']}" if e.get("role") is not None and e.get("rank") is not None else None


def cause_view(snap) -> dict | None:
    """Where the verdict's failure (or restart) began: its node and process, the event that says so
    (the first of that process since the node's last restart) and the process's last log line."""
    if not snap.verdict.cause:
        return None
    node, process = snap.verdict.cause
    events = sorted((e for e in snap.events if e.get("node") == node), key=lambda e: e.get("ts") or 0)
    since = max((e.get("ts") or 0 for e in events if e.get("kind") == EventKind.RESTARTED), default=float("-inf"))
    if process is not None:
        found = [e for e in events if _event_process(e) == process and e.get("kind") in CAUSES
                 and not (e.get("kind") == EventKind.EXITED and e.get("exit_code") == 0)]  # an exit 0 is no cause
    else:
        found = [e for e in events if e.get("kind") in NODE_CAUSES]
    found = [e for e in found if (e.get("ts") or 0) > since] or found[-1:]
    seen = snap.node(node)
    proc = next((p for p in (seen.processes if seen else ()) if p["name"] == process), None)
    return {"node": node, "process": process, "event": dict(found[0]) if found else None,
            "log_line": (proc or {}).get("last_line") or None}


def kill_control(verdict) -> dict:
    """Whether the Kill button can do anything, and its tooltip: why (not)."""
    job = verdict.job_id
    if job is None:
        return {"enabled": False, "why": "no job on any node: nothing to kill"}
    if verdict.state == JobState.UNKNOWN:
        return {"enabled": False, "why": f"no node reachable: a kill of job {job} could not reach them"}
    if verdict.state in TERMINAL and not verdict.unreachable and not any(p.live for p in verdict.processes):
        return {"enabled": False, "why": f"nothing of job {job} runs any more ({verdict.state.value}): nothing to kill"}
    return {"enabled": True, "why": f"stop job {job}: SIGTERM every process of it on every node, then SIGKILL "
                                    "after the grace period (fab kill-all)"}


TIMINGS = ("step_time", "data_time", "compute_time", "comm_time")  # the hook's per-step split (docs/progress.md)


def _trainer_order(name: Trainer, rank) -> tuple:
    """A process's row, then its ranks' (torchrun's workers: progress.row), by rank."""
    r = name.process.index
    return (r is None, r or 0, name.process, name.rank is not None, rank if isinstance(rank, int) else 0, name)


def _trainers(snap, states: dict, health_progress: dict, stale_after: float, now: float) -> list[dict]:
    # Each a Trainer (contract/identity.py): a process of node ops' records, or a row of the progress records.
    names = {Trainer(n) for n in states} | {Trainer.of(n) for n in snap.progress}
    names = {n for n in names if n.role == "trainer"}
    out = []
    for name in sorted(names, key=lambda n: _trainer_order(n, snap.progress[n].rank if n in snap.progress else None)):
        prog = snap.progress.get(name)
        process = name.process  # a rank of a process (torchrun's workers) shows its process's state
        node, p = states.get(process, (prog.node if prog else None, {}))
        rec = prog.last if prog else {}
        seen = snap.verdict.process(node, process) if p else None
        ts = rec.get("ts")
        # Age of the latest record by its own ts (the node's clock: fab check
        # shows the clock offsets); when seen if the record has no ts.
        base = ts if ts is not None else (prog.last_ts if prog else None)
        age = max(0.0, now - base) if base is not None else None
        # Before its first record, what the program prints (or its CPU time) is its sign of life: the
        # agent's last_progress.
        lively = number(health_progress.get(process))
        if age is None and seen and seen.live:
            since = lively if lively is not None else p.get("started_at")
            age = max(0.0, now - since) if since is not None else None
        running = (seen.live if seen else snap.verdict.state == JobState.RUNNING)
        behind = snap.verdict.straggler(node, process) if node else None
        out.append({
            "name": name, "node": node or (prog.node if prog else None),
            "rank": rec.get("rank") if name.rank is not None else process.index,
            "process": process,
            "state": seen.state.value if seen else p.get("state"), "label": process_label(p, seen) if p else "?",
            "step": number(rec.get("step")), "epoch": number(rec.get("epoch")),
            "loss": short(rec.get("loss")),
            # its latest record that has a rate (the chart's last point): an evaluation's record has none
            "samples_per_s": short(getattr(prog, "rate", None) if prog else rec.get("samples_per_s"), 5),
            "lr": short(rec.get("lr"), 4), "ts": ts, "age": short(age, 4),
            "total_steps": number(rec.get("total_steps")), "framework": rec.get("framework"),
            "source": rec.get("source"),
            **{k: short(rec.get(k), 4) for k in TIMINGS},
            "last_progress": (number(health_progress.get(name)) if name.rank is None else None) or ts,
            "last_line": (p.get("last_line") or "")[-200:],
            "stale": bool(running and age is not None and age > stale_after),
            "records": prog.records if prog else 0,
            # its last checkpoint and the work a failure now would lose (controller/checkpoints.py)
            "checkpoint": checkpoints.view(rec, now), "resumed_from": rec.get("resumed_from"),
            # fell behind the median rank and has not caught up (the verdict's, as fab status marks it)
            "straggler": {"rate": short(behind.rate, 4), "median": short(behind.median, 4), "rank": behind.rank,
                          "cause": behind.cause, "ratio": short(behind.ratio, 3), "mark": behind.mark}
            if behind else None,
        })
    return out


# -- /api/metrics ---------------------------------------------------------------------------


class MetricsCursor:
    """Incremental /api/metrics: each reply carries a cursor; pass it back as ?since=.

    The collector says what changed since a cursor (`series_since`): only
    the points appended to a series, or the whole series where its kept
    points were thinned (a reset); an unknown or expired cursor gets a full
    reply. This class turns that into JSON text. Each series' points are
    formatted once and kept (`cache`, by the series' epoch), so a full reply
    (a page load) costs a join, not the formatting of every point again.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.cache: dict[tuple, list] = {}  # (group, owner, metric) -> [epoch, n, x text, y text]

    def export(self, collector, since: str | None = None) -> dict:
        return json.loads(self.export_json(collector, since))

    def export_json(self, collector, since: str | None = None) -> str:
        delta = collector.series_since(since)
        out: dict[str, dict[str, list[str]]] = {TRAINERS: {}, NODES: {}}
        with self.lock:  # the cache is shared by every request
            if delta.full:
                wanted = {(c.group, c.owner, c.metric) for c in delta.chunks}
                for key in [k for k in self.cache if k not in wanted]:
                    del self.cache[key]  # a series that went away (a new job)
            for c in delta.chunks:
                is_time = c.group == NODES
                xt, yt = self._full_text(c, is_time) if c.reset else _points_text(c.points, is_time)
                lt = "null" if c.last is None else "[%s]" % ",".join(_points_text([c.last], is_time))
                out[c.group].setdefault(c.owner, []).append(
                    '%s:{"reset":%s,"stride":%d,"x":[%s],"y":[%s],"last":%s}'
                    % (json.dumps(c.metric), "true" if c.reset else "false", c.stride, xt, yt, lt))

        def group(owners: dict[str, list[str]]) -> str:
            return ",".join("%s:{%s}" % (json.dumps(owner), ",".join(series)) for owner, series in owners.items())
        return '{"cursor":%s,"full":%s,"trainers":{%s},"nodes":{%s}}' % (
            json.dumps(delta.cursor), "true" if delta.full else "false", group(out[TRAINERS]), group(out[NODES]))

    def _full_text(self, c, is_time: bool) -> tuple[str, str]:
        """A whole series' text: what is cached for its epoch, and the points appended since."""
        key, n = (c.group, c.owner, c.metric), len(c.points)
        cached = self.cache.get(key)
        if cached is None or cached[0] != c.epoch or cached[1] > n:
            cached = self.cache[key] = [c.epoch, n, *_points_text(c.points, is_time)]
        elif cached[1] < n:
            xt, yt = _points_text(c.points[cached[1]:], is_time)
            cached[2] = f"{cached[2]},{xt}" if cached[2] else xt
            cached[3] = f"{cached[3]},{yt}" if cached[3] else yt
            cached[1] = n
        return cached[2], cached[3]


def _num(value) -> str:
    """A number as JSON text (short() gives a finite float, an int or None)."""
    if value is None:
        return "null"
    return repr(value) if isinstance(value, float) else str(int(value))


def _points_text(points, is_time: bool) -> tuple[str, str]:
    """The x and y arrays' JSON text (without brackets): steps exact, times to 0.1 s, values to 6 digits."""
    if is_time:
        xs = ",".join(_num(round(x, 1)) for x, _ in points)
    else:
        xs = ",".join(str(x) if isinstance(x, int) and not isinstance(x, bool) else _num(short(x)) for x, _ in points)
    ys = ",".join(_num(short(y)) for _, y in points)
    return xs, ys


# -- /api/events ------------------------------------------------------------------------------


def events_view(snap, limit: int, since: float | None = None) -> dict:
    events = [dict(e) for e in snap.events]
    if since is not None:
        events = [e for e in events if (e.get("ts") or 0) > since]
    events.sort(key=lambda e: e.get("ts") or 0, reverse=True)
    return {"events": events[:limit], "total": len(events)}
