"""The run history: every job the nodes remember, how each went, and one old job in full.

Each node keeps its jobs' directories (jobs/<id>/); the node ops `jobs` and
`job` (fabtrain.node.history) read them back. Here the replies of every node
are merged per job id, and the job's outcome comes from the same verdict as
`fab status` (jobstate.job_verdict), so the two never disagree. What the
nodes said is kept in the controller's state dir (`<cluster>.jobs.json`, and
`<cluster>.job-<id>.json` for an ended job's detail): a node that cannot be
reached now is answered from it, and said to be unreachable.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from fabtrain.controller import records, state
from fabtrain.contract.opreplies import MalformedReply, Status
from fabtrain.contract.checkpoints import last_checkpoint
from fabtrain.contract.events import JOB_EVENTS, EventKind
from fabtrain.controller.jobstate import NodeObservation, job_verdict, observe_status
from fabtrain.remote import rpc
from fabtrain.errors import UserError
from fabtrain.contract import jobid
from fabtrain.remote.session import Session
from fabtrain.remote.transport import Reply

TIMEOUT = 30.0  # seconds a node has to read its job directories
SERIES_KEYS = ("ts", "step", "loss", "samples_per_s", "eval_loss", "lr", "step_time", "data_time", "compute_time",
               "comm_time")


def _ask(session: Session, op: str, payload: dict) -> list[Reply]:
    return session.map(lambda t: rpc.call(t, op, payload, timeout=TIMEOUT))


def _observation(node: str, entry: dict) -> NodeObservation:
    """What jobstate needs of one node's entry: its status (node ops' `status` reply, read through its
    type: one it cannot read is that node's error), and its job-level events from events.jsonl."""
    try:
        obs = observe_status(Reply(node, True, Status.from_wire(node, entry.get("status"))))
    except MalformedReply as e:
        obs = NodeObservation(node, False, error=str(e))
    events = []
    for e in entry.get("events") or []:
        try:
            ev = records.event_record(e)
        except records.Malformed:
            continue
        if ev.get("kind") in JOB_EVENTS:
            events.append(ev)
    return dataclasses.replace(obs, events=tuple(events) + obs.events)


def _by_node(replies: list[Reply], cached: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """node -> what it said now, or what it said last time (cached); and node -> why it was not asked now."""
    said, unreachable = {}, {}
    for r in replies:
        if r.ok and isinstance(r.value, dict):
            said[r.node] = r.value
        else:
            unreachable[r.node] = r.error or "no reply"
            if isinstance(cached.get(r.node), dict):
                said[r.node] = cached[r.node]
    return said, unreachable


def _trainer_last(entries: dict[str, dict]) -> dict[str, dict]:
    """trainer name -> its last metrics record (step, loss, samples/s, ts), finite numbers only."""
    out = {}
    for entry in entries.values():
        for name, rec in (entry.get("last_metrics") or {}).items():
            if isinstance(rec, dict) and isinstance(name, str) and name.startswith("trainer"):
                out[name] = {k: rec[k] for k in SERIES_KEYS if records.finite(rec.get(k))}
                ck = _checkpoint(last_checkpoint(rec))
                if ck:  # its last checkpoint (the launcher's hook saw the save)
                    out[name]["checkpoint"] = ck
    return out


def _checkpoint(ck: Any) -> dict | None:
    """A checkpoint save or a last checkpoint from a node (untrusted): finite numbers, a bounded path."""
    if not isinstance(ck, dict) or not records.finite(ck.get("step")):
        return None
    out = {k: ck[k] for k in ("step", "at", "bytes", "seconds", "landed_at") if records.finite(ck.get(k))}
    if isinstance(ck.get("path"), str):
        out["path"] = ck["path"][:1024]
    if ck.get("async") is True:
        out["async"] = True
    return out


def _checkpoints(entries: dict[str, dict]) -> dict[str, list[dict]]:
    """trainer -> each generation's checkpoint loads and saves ({generation, loaded, saves}), every node's."""
    out: dict[str, list[dict]] = {}
    for entry in entries.values():
        said = entry.get("checkpoints")
        for name, gens in (said.items() if isinstance(said, dict) else ()):
            if not isinstance(name, str) or not isinstance(gens, list):
                continue
            out[name] = [{"generation": g["generation"],
                          "loaded": g["loaded"][:1024] if isinstance(g.get("loaded"), str) else None,
                          "saves": [c for c in (_checkpoint(x) for x in g.get("saves") or []) if c]}
                         for g in gens if isinstance(g, dict) and isinstance(g.get("generation"), int)
                         and isinstance(g.get("saves") or [], list)]
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _restarts(entries: dict[str, dict]) -> int:
    """How many times the job restarted: its generations (every node writes `restarted` for each)."""
    return len({e.get("generation") for entry in entries.values() for e in entry.get("events") or []
                if isinstance(e, dict) and e.get("kind") == EventKind.RESTARTED and isinstance(e.get("generation"), int)})


def _job_summary(job_id: str, entries: dict[str, dict], unreachable: dict[str, str], now: float) -> dict:
    """One row of the jobs list from every node's entry for the job."""
    verdict = job_verdict([_observation(n, e) for n, e in entries.items()]
                          + [NodeObservation(n, False, error=why) for n, why in unreachable.items()
                             if n not in entries], job_id)
    starts = [e["started"] for e in entries.values() if records.finite(e.get("started"))]
    writes = [e["last_write"] for e in entries.values() if records.finite(e.get("last_write"))]
    started = min(starts) if starts else None
    end = max(writes) if writes and verdict.ended else now
    trainers = _trainer_last(entries)
    losses = [t["loss"] for t in trainers.values() if "loss" in t]
    rates = [t["samples_per_s"] for t in trainers.values() if "samples_per_s" in t]
    # What was run, as the first node that has the job says (nodes[0] hosts the coordinator).
    job = next(iter(entries.values())).get("job") or {}
    order = job.get("nodes") or []
    job = next((entries[n].get("job") or job for n in order if n in entries), job)
    trainer0 = next((p for e in entries.values() for p in (e.get("job") or {}).get("processes") or []
                     if isinstance(p, dict) and p.get("role") == "trainer"), {})
    return {
        "job_id": job_id, "started": started, "duration": (end - started) if started else None,
        "outcome": verdict.state.value, "reason": verdict.summary(), "ended": verdict.ended,
        "restarts": _restarts(entries),
        "loss": _mean(losses), "samples_per_s": sum(rates) if rates else None,
        "step": max((t["step"] for t in trainers.values() if "step" in t), default=None),
        "trainers": trainers,
        "mode": job.get("mode"), "nodes": sorted(entries),
        "command": trainer0.get("argv") or [], "env": trainer0.get("env") or {},
        "unreachable": sorted(n for n in unreachable if n in order or not order),
    }


def list_jobs(session: Session, now: float | None = None) -> dict:
    """Every job any node remembers, newest first, merged across nodes; unreachable nodes from the cache."""
    now = time.time() if now is None else now
    name = session.cluster.name
    cache = state.load_file(name, ".jobs")
    said, unreachable = _by_node(_ask(session, "jobs", {}), cache.get("nodes") or {})
    state.save_file(name, ".jobs", {"nodes": said, "updated": now})
    per_job: dict[str, dict[str, dict]] = {}
    for node, reply in said.items():
        for entry in reply.get("jobs") or []:
            if isinstance(entry, dict) and jobid.is_job_id(entry.get("job_id")):
                per_job.setdefault(entry["job_id"], {})[node] = entry
    jobs = [_job_summary(jid, entries, unreachable, now) for jid, entries in per_job.items()]
    jobs.sort(key=lambda j: (j["started"] or 0, j["job_id"]), reverse=True)
    return {"cluster": name, "now": now, "jobs": jobs,
            "unreachable": [{"node": n, "error": why, "cached": n in said} for n, why in sorted(unreachable.items())]}


def _series(entries: dict[str, dict]) -> dict[str, dict[str, list]]:
    """trainer -> columns (ts, step, loss, samples_per_s, ...): null where a record lacks a value."""
    out = {}
    for entry in entries.values():
        for name, points in (entry.get("series") or {}).items():
            if not isinstance(points, list):
                continue
            points = [p for p in points if isinstance(p, dict)]
            out[name] = {k: [p[k] if records.finite(p.get(k)) else None for p in points] for k in SERIES_KEYS}
    return out


def job_detail(session: Session, job_id: str, now: float | None = None, max_points: int | None = None) -> dict | None:
    """One job in full (series, events, last log lines, outcome); None if no node knows it.

    max_points: per trainer (the node thins a longer series evenly); default the node's 2000."""
    jobid.checked(job_id, UserError)  # it names a file of the controller's state, and a folder on each node
    now = time.time() if now is None else now
    name = session.cluster.name
    suffix = f".job-{job_id}"
    payload = {"job_id": job_id} | ({"max_points": max_points} if max_points else {})
    cached = state.load_file(name, suffix) if not max_points else {}
    said, unreachable = _by_node(_ask(session, "job", payload), cached)
    entries = {n: e for n, e in said.items() if e.get("found")}
    if not entries:
        if unreachable and len(unreachable) == len(session.cluster.nodes):
            return {"job_id": job_id, "found": None,
                    "unreachable": [{"node": n, "error": why, "cached": False} for n, why in sorted(unreachable.items())]}
        return None
    summary = _job_summary(job_id, entries, unreachable, now)
    if summary["ended"] and not max_points:
        state.save_file(name, suffix, entries)
    events = [e for entry in entries.values() for e in entry.get("events") or [] if isinstance(e, dict)]
    events.sort(key=lambda e: e.get("ts") if records.finite(e.get("ts")) else 0)
    return {
        **summary, "found": True, "series": _series(entries), "events": events,
        "checkpoints": _checkpoints(entries),  # each trainer's saves and loads, generation by generation
        "logs": {n: e.get("logs") or {} for n, e in entries.items()},
        "unreachable": [{"node": n, "error": why, "cached": n in entries} for n, why in sorted(unreachable.items())],
    }


class History:
    """list_jobs/job_detail for the dashboard: one fan-out at a time, its answer reused for `ttl` seconds."""

    def __init__(self, session: Session, ttl: float = 5.0):
        self.session, self.ttl = session, ttl
        self._lock = threading.Lock()
        self._memo: dict[Any, tuple[float, Any]] = {}

    def _memoized(self, key, fn):
        with self._lock:
            hit = self._memo.get(key)
            if hit and time.monotonic() - hit[0] < self.ttl:
                return hit[1]
            value = fn()
            self._memo = {k: v for k, v in self._memo.items() if time.monotonic() - v[0] < self.ttl}
            self._memo[key] = (time.monotonic(), value)
            return value

    def jobs(self) -> dict:
        return self._memoized("jobs", lambda: list_jobs(self.session))

    def job(self, job_id: str) -> dict | None:
        return self._memoized(("job", job_id), lambda: job_detail(self.session, job_id))
