"""What the JSON API returns, built from a Collector's state (no Flask here).

Every function takes the collector and reads it under its lock, so a poll
thread never changes a view half-way through a response.
"""
from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections import OrderedDict
from typing import Any

TERMINAL_STATES = ("finished", "failed", "killed")


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


def signal_name(code: int | None) -> str | None:
    """Exit code 128+N of a shell wrapper means the program died of signal N."""
    if isinstance(code, int) and 128 < code < 128 + 65:
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            return f"signal {code - 128}"
    if isinstance(code, int) and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return None


def process_label(p: dict) -> str:
    """running, stopped, zombie, exited 0, killed 137 (SIGKILL), killed, lost, not started."""
    state = p.get("state") or "?"
    if state == "exited" or (state == "killed" and p.get("exit_code") is not None):
        code = p.get("exit_code")
        sig = signal_name(code)
        return f"{state} {code}" + (f" ({sig})" if sig else "")
    if p.get("zombies"):
        return f"{state} +{p['zombies']} zombie"
    return state


def process_role(name: str) -> tuple[str, int | None]:
    role, _, rank = name.rpartition("-")
    if not role:
        return name, None
    return role, int(rank) if rank.isdigit() else None


# -- /api/cluster ---------------------------------------------------------------------------


def cluster_view(collector, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    cluster = collector.session.cluster
    nodes = []
    with collector.lock:
        for node in cluster.nodes:
            view = collector.nodes.get(node.name)
            if view is None:
                continue
            nodes.append(_node_view(node, view, now))
    return {"cluster": cluster.name, "now": now, "nodes": nodes}


def _node_view(node, view, now: float) -> dict:
    health = view.health if isinstance(view.health, dict) else None
    by_name = {}
    if health:
        for hp in health.get("processes") or []:
            if isinstance(hp, dict) and isinstance(hp.get("name"), str):
                by_name[hp["name"]] = hp
    processes = []
    for p in view.processes:
        name = p.get("name", "?")
        role, rank = process_role(name)
        hp = by_name.get(name, {})
        processes.append({
            "name": name, "role": role, "rank": rank,
            "state": p.get("state"), "exit_code": p.get("exit_code"), "signal": signal_name(p.get("exit_code")),
            "label": process_label(p), "pid": p.get("pid"), "uptime": short(p.get("uptime"), 5),
            "started_at": number(p.get("started_at")), "zombies": p.get("zombies", 0),
            "cpu_percent": short(hp.get("cpu_percent"), 3), "rss": number(hp.get("rss")),
            "children": number(hp.get("children")), "last_progress": number(hp.get("last_progress")),
            "last_line": (p.get("last_line") or "")[-200:],
        })
    out = {
        "name": node.name, "host": node.host, "roles": list(node.roles),
        "up": view.up, "since": view.since, "error": view.error, "last_seen": view.last_seen,
        "job_id": view.job_id, "killed": bool(view.killed), "processes": processes, "health": None,
    }
    if health:
        ts = number(health.get("ts"))
        interval = number(health.get("interval")) or 1.0
        host = health.get("host") if isinstance(health.get("host"), dict) else {}
        gpus = [g for g in health.get("gpus") or [] if isinstance(g, dict)]
        agent = health.get("agent") if isinstance(health.get("agent"), dict) else None
        age = now - ts if ts is not None else None
        out["health"] = {
            "ts": ts, "age": short(age, 4),
            # The agent writes every `interval`: three missed snapshots and it is stale.
            "stale": age is not None and age > max(3 * interval, 5.0),
            "host": {k: short(v, 6) if isinstance(v, float) else v for k, v in host.items()
                     if number(v) is not None or (k == "load" and isinstance(v, list))},
            "gpus": [{k: short(g.get(k), 6) for k in ("index", "util", "mem_used", "mem_total", "temp", "power_w")}
                     | {"name": str(g.get("name", ""))[:80]} for g in gpus],
            "agent": {k: short(agent.get(k), 4) for k in ("pid", "rss", "cpu_percent")} if agent else None,
        }
    return out


# -- /api/job -------------------------------------------------------------------------------


def job_view(collector, stale_after: float, ended: dict, now: float | None = None) -> dict:
    """The job's state, elapsed time and each trainer's progress.

    `ended` (job id -> time) remembers when this dashboard first saw the job
    in a terminal state, so the elapsed time stops there.
    """
    now = time.time() if now is None else now
    state = collector.job_state()
    job_id = collector.job_id_seen()
    cluster = collector.session.cluster
    with collector.lock:
        procs = []  # (node, process dict)
        for name, view in collector.nodes.items():
            if job_id is None or view.job_id == job_id:
                procs.extend((name, p) for p in view.processes)
        health_progress = {}
        for view in collector.nodes.values():
            h = view.health if isinstance(view.health, dict) else {}
            for hp in h.get("processes") or []:
                if isinstance(hp, dict) and number(hp.get("last_progress")) is not None:
                    health_progress[hp.get("name")] = hp["last_progress"]
        progress = {name: (p.node, dict(p.last), p.last_ts, p.records) for name, p in collector.progress.items()}
        unreachable = [n for n, v in collector.nodes.items() if v.up is False]

    started = [number(p.get("started_at")) for _, p in procs if number(p.get("started_at")) is not None]
    started_at = min(started) if started else None
    if state in TERMINAL_STATES and job_id is not None:
        ended.setdefault(job_id, now)
    ended_at = ended.get(job_id) if state in TERMINAL_STATES else None
    elapsed = ((ended_at or now) - started_at) if started_at is not None else None

    states = {}
    trainer_names = []
    for node, p in procs:
        name = p.get("name", "?")
        if name == "agent":
            continue
        states[name] = (node, p)
        if process_role(name)[0] == "trainer":
            trainer_names.append(name)
    for name, (node, *_rest) in progress.items():
        if process_role(name)[0] == "trainer" and name not in states:
            trainer_names.append(name)

    trainers = []
    for name in sorted(set(trainer_names), key=lambda n: (process_role(n)[1] is None, process_role(n)[1] or 0, n)):
        node, p = states.get(name, (progress.get(name, (None,))[0], {}))
        rec_node, rec, seen_at, records = progress.get(name, (node, {}, None, 0))
        ts = number(rec.get("ts"))
        # Age of the latest record by its own ts (the node's clock: fab check
        # shows the clock offsets); when seen if the record has no ts.
        base = ts if ts is not None else seen_at
        age = max(0.0, now - base) if base is not None else None
        if age is None and p.get("state") == "running" and number(p.get("started_at")) is not None:
            age = max(0.0, now - p["started_at"])  # running but no record yet
        running = p.get("state") in ("running", "stopped") or (not p and state == "running")
        trainers.append({
            "name": name, "node": node or rec_node, "rank": process_role(name)[1],
            "state": p.get("state"), "label": process_label(p) if p else "?",
            "step": number(rec.get("step")), "epoch": number(rec.get("epoch")),
            "loss": short(rec.get("loss")), "samples_per_s": short(rec.get("samples_per_s"), 5),
            "lr": short(rec.get("lr"), 4), "ts": ts, "age": short(age, 4),
            "last_progress": number(health_progress.get(name)) or ts,
            "stale": bool(running and age is not None and age > stale_after),
            "records": records,
        })

    counts = {"total": 0, "running": 0, "exited_ok": 0, "failed": 0, "killed": 0}
    for _, (_, p) in states.items():
        counts["total"] += 1
        s = p.get("state")
        if s in ("running", "stopped", "zombie"):
            counts["running"] += 1
        elif s == "exited" and p.get("exit_code") == 0:
            counts["exited_ok"] += 1
        elif s == "killed":
            counts["killed"] += 1
        elif s in ("exited", "lost"):
            counts["failed"] += 1
    return {
        "job_id": job_id, "cluster": cluster.name, "state": state, "now": now,
        "started_at": started_at, "ended_at": ended_at, "elapsed": short(elapsed, 7),
        "processes": counts, "trainers": trainers, "stale_after": stale_after,
        "stale": [t["name"] for t in trainers if t["stale"]], "unreachable": unreachable,
    }


# -- /api/metrics ---------------------------------------------------------------------------


class MetricsCursor:
    """Incremental /api/metrics: each reply carries a cursor; pass it back as ?since=.

    The collector's Series only ever append while their stride stays the same;
    when the stride doubles the kept points are thinned (a reset). A cursor
    names a snapshot of every series' (identity, stride, length): with it the
    next reply holds only the points appended since, or the whole series
    where it was reset. The last `keep` snapshots are remembered (shared by
    all browser tabs); an unknown or expired cursor gets a full reply.

    The reply is built as JSON text. Each series' points are formatted once
    and kept (`cache`), so a full reply (a page load) costs a join, not the
    formatting of every point of every series again.
    """

    def __init__(self, nonce: str, keep: int = 256):
        self.nonce = nonce
        self.keep = keep
        self.lock = threading.Lock()
        self.snapshots: OrderedDict[str, dict] = OrderedDict()
        self.cache: dict[tuple, list] = {}  # key -> [series, stride, n, x text, y text]
        self.counter = 0

    def export(self, collector, since: str | None = None) -> dict:
        return json.loads(self.export_json(collector, since))

    def export_json(self, collector, since: str | None = None) -> str:
        with self.lock:  # one export at a time: the cache is shared
            base = self.snapshots.get(since) if since else None
            snap: dict[tuple, tuple] = {}
            out: dict[str, dict[str, list[str]]] = {"t": {}, "n": {}}
            with collector.lock:
                if base is not None:
                    now_keys = {("t", *k) for k in collector.series} | {("n", *k) for k in collector.node_series}
                    if any(k not in now_keys for k in base):
                        base = None  # a series went away (a new job): a full reply, the page starts over
                for kind, table, is_time in (("t", collector.series, False), ("n", collector.node_series, True)):
                    for (owner, metric), s in list(table.items()):
                        key = (kind, owner, metric)
                        n = len(s.points)
                        snap[key] = (s, s.stride, n, s.last)
                        old = base.get(key) if base is not None else None
                        reset = not (old and old[0] is s and old[1] == s.stride and old[2] <= n)
                        if not reset and old[2] == n and old[3] == s.last:
                            continue  # nothing new in this series
                        if reset:
                            xt, yt = self._full_text(key, s, n, is_time)
                        else:
                            xt, yt = _points_text(s.points[old[2]:n], is_time)
                        last = s.last if s.last is not None and (not s.points or s.points[-1] != s.last) else None
                        lt = "null" if last is None else "[%s]" % ",".join(_points_text([last], is_time))
                        out[kind].setdefault(owner, []).append(
                            '%s:{"reset":%s,"stride":%d,"x":[%s],"y":[%s],"last":%s}'
                            % (json.dumps(metric), "true" if reset else "false", s.stride, xt, yt, lt))
            for key in [k for k in self.cache if k not in snap]:
                del self.cache[key]  # a series that went away (a new job)
            self.counter += 1
            cursor = f"{self.nonce}-{self.counter}"
            self.snapshots[cursor] = snap
            while len(self.snapshots) > self.keep:
                self.snapshots.popitem(last=False)

        def group(owners: dict[str, list[str]]) -> str:
            return ",".join("%s:{%s}" % (json.dumps(owner), ",".join(series)) for owner, series in owners.items())
        return '{"cursor":%s,"full":%s,"trainers":{%s},"nodes":{%s}}' % (
            json.dumps(cursor), "true" if base is None else "false", group(out["t"]), group(out["n"]))

    def _full_text(self, key: tuple, s, n: int, is_time: bool) -> tuple[str, str]:
        c = self.cache.get(key)
        if c is None or c[0] is not s or c[1] != s.stride or c[2] > n:
            c = self.cache[key] = [s, s.stride, n, *_points_text(s.points[:n], is_time)]
        elif c[2] < n:
            xt, yt = _points_text(s.points[c[2]:n], is_time)
            c[3] = f"{c[3]},{xt}" if c[3] else xt
            c[4] = f"{c[4]},{yt}" if c[4] else yt
            c[2] = n
        return c[3], c[4]


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


def events_view(collector, limit: int, since: float | None = None) -> dict:
    with collector.lock:
        events = [dict(e) for e in collector.events]
    if since is not None:
        events = [e for e in events if (number(e.get("ts")) or 0) > since]
    events.sort(key=lambda e: number(e.get("ts")) or 0, reverse=True)
    return {"events": events[:limit], "total": len(events)}
