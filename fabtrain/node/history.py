"""What a node keeps of its past jobs: the `jobs` and `job` ops (standard library only).

Every job a node ran has its directory, jobs/<id>/, kept after it ends:
job.json (what was run), run/ (when each process started), events.jsonl
(how it went and ended), metrics/<name>.jsonl and logs/. These ops read
them back for the controller's run history (fabtrain.controller.history):
`jobs` a summary a job, `job` one job's series, events and last log lines.
Neither writes anything, and neither ever returns the job's secret.
"""
import json
import os

from fabtrain.contract import jobid
from fabtrain.contract.records import SERIES
from fabtrain.contract.events import JOB_EVENTS, EventKind
from fabtrain.contract.jobfolder import EVENTS, JOBS, LOGS, METRICS, JobFolder, job_folder
from fabtrain.contract import progress
from fabtrain.contract.checkpoints import SAVED, last_checkpoint
from fabtrain.node import atomic, ops

# The events that tell how a job went, as opposed to the watchdog's running commentary.
OUTCOME_KINDS = JOB_EVENTS + (EventKind.KILLED,)
MAX_POINTS = 2000  # per trainer in a `job` reply: a long run is thinned evenly, its last point kept
MAX_EVENTS = 500
MAX_JOBS = 500


def summary(job):
    """job.json without its secret, and without what only the agent needs (launch argv, run paths)."""
    watchdog = dict(job.get("watchdog") or {})
    watchdog.pop("coordinator", None)  # holds the secret
    procs = []
    for p in job.get("processes") or []:
        if isinstance(p, dict):
            env = {k: v for k, v in (p.get("env") or {}).items() if not k.startswith("FABTRAIN_")}
            procs.append({"name": p.get("name"), "role": p.get("role"), "rank": p.get("rank"),
                          "argv": p.get("argv"), "env": env})
    keep = ("job_id", "cluster", "node", "mode", "sgd", "trainers", "code")
    out = {k: job.get(k) for k in keep if k in job}
    out["nodes"] = [n.get("name") for n in job.get("nodes") or [] if isinstance(n, dict)]
    out["watchdog"] = watchdog
    out["processes"] = procs
    return out


def job_events(jd, kinds=None, limit=None):
    """events.jsonl's records (only `kinds` if given; the last `limit`)."""
    out = [ev for ev in JobFolder(jd).read_events() if kinds is None or ev.get("kind") in kinds]
    return out[-limit:] if limit else out


def metric_files(jd):
    mdir = JobFolder(jd).metrics
    try:
        return sorted(f[:-6] for f in os.listdir(mdir) if f.endswith(".jsonl"))
    except OSError:
        return []


def by_row(process, lines):
    """A metrics file's records by trainer (progress.row: under torchrun one file holds every local
    rank's), the hook's records left out of a trainer that has records of the program's own."""
    rows, own = {}, set()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and not rec.get("between_steps"):  # the hook's sign of a rank busy between steps
            name = progress.row(process, rec)
            if rec.get("source") != progress.AUTO:
                own.add(name)
            rows.setdefault(name, []).append(rec)
    return {name: [r for r in recs if name not in own or r.get("source") != progress.AUTO]
            for name, recs in rows.items()}


def last_records(path, process, lines=64):
    """Each trainer's last record among the file's last lines (latest_rate's)."""
    return {name: latest_rate(recs) for name, recs in by_row(process, ops.tail_lines(path, lines)).items() if recs}


def latest_rate(recs):
    """The last of `recs`; its samples_per_s is the latest of them that has one (an evaluation's or a
    heartbeat's record measures no training rate)."""
    found = recs[-1]
    rate = next((r["samples_per_s"] for r in reversed(recs) if isinstance(r.get("samples_per_s"), (int, float))), None)
    return found if rate is None or "samples_per_s" in found else dict(found, samples_per_s=rate)


def last_record(path, lines=5):
    """The file's last record, by latest_rate."""
    recs = []
    for line in ops.tail_lines(path, lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            recs.append(rec)
    return latest_rate(recs) if recs else None


def started_at(jd):
    """When the job started here: its earliest run record, else when job.json was written."""
    times = [r.get("started_at") for _, r in ops.run_records(jd)]
    times = [t for t in times if isinstance(t, (int, float))]
    if times:
        return min(times)
    try:
        return os.path.getmtime(JobFolder(jd).job_json)
    except OSError:
        return None


def ended_at(jd):
    """The last time anything of the job was written here (events, metrics, logs)."""
    latest = None
    for sub in (EVENTS, METRICS, LOGS):
        path = os.path.join(jd, sub)
        paths = [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
        for p in paths:
            try:
                t = os.path.getmtime(p)
            except OSError:
                continue
            latest = t if latest is None else max(latest, t)
    return latest


def job_entry(ws, job_id):
    jd = job_folder(ws, job_id).path
    job = atomic.read_json(JobFolder(jd).job_json, {})
    status = ops.op_status({"workspace": ws, "job_id": job_id, "health": True})
    return {
        "job_id": job_id,
        "job": summary(job if isinstance(job, dict) else {}),
        "started": started_at(jd),
        "last_write": ended_at(jd),
        "status": status,
        "events": job_events(jd, OUTCOME_KINDS, 200),
        "last_metrics": {row: rec for name in metric_files(jd)
                         for row, rec in last_records(JobFolder(jd).metrics_file(name), name).items()},
    }


def op_jobs(payload):
    """Every job this node has a directory for, newest first: summary, status, outcome events, last metrics."""
    ws = ops.workspace(payload)
    root = os.path.join(ws, JOBS)
    try:
        ids = sorted((d for d in os.listdir(root) if jobid.is_job_id(d) and os.path.isdir(os.path.join(root, d))),
                     reverse=True)
    except OSError:
        ids = []
    limit = int(payload.get("limit", MAX_JOBS))
    return {"jobs": [job_entry(ws, i) for i in ids[:limit]], "current": os.path.basename(ops.job_dir(ws) or "")}


def thin(records, max_points):
    """At most max_points of records, evenly spaced, the last one always kept."""
    if len(records) <= max_points:
        return records
    stride = -(-len(records) // max_points)
    picked = records[::stride]
    if picked[-1] is not records[-1]:
        picked.append(records[-1])
    return picked


def series(path, process, max_points):
    """Each trainer's series in one metrics file (by_row), thinned."""
    try:
        f = open(path, "rb")
    except OSError:
        return {}
    with f:
        rows = by_row(process, f)
    # A record whose loss is an earlier step's (`loss_step`: the hook's record of steps it did not sample)
    # gives the series no loss at its step.
    return {name: thin([{k: rec[k] for k in SERIES if k in rec and not (k == "loss" and "loss_step" in rec)}
                        for rec in recs], max_points) for name, recs in rows.items()}


MAX_SAVES = 500  # per trainer and generation in a `job` reply: the last ones


def _restarts(jd):
    """(ts, generation) of this node's `restarted` events: which generation a record of a given time is of."""
    return sorted((ev["ts"], ev["generation"]) for ev in job_events(jd, (EventKind.RESTARTED,))
                  if isinstance(ev.get("ts"), (int, float)) and isinstance(ev.get("generation"), int))


def checkpoints(path, process, restarts):
    """Each trainer's checkpoint saves and loads in one metrics file, by generation (the launcher's hook's
    records, docs/progress.md): {trainer: [{generation, loaded, saves: [{step, at, path, bytes, seconds,
    async, landed_at}]}]}; `restarts` as _restarts says them."""
    try:
        f = open(path, "rb")
    except OSError:
        return {}
    out = {}
    with f:
        for line in f:
            if b'"ckpt_step"' not in line and b'"resumed_from"' not in line:
                continue  # most records: not parsed
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            ts = rec.get("ts") if isinstance(rec.get("ts"), (int, float)) else 0
            g = max([gen for at, gen in restarts if at <= ts], default=0)
            gens = out.setdefault(progress.row(process, rec), {})
            entry = gens.setdefault(g, {"generation": g, "loaded": None, "saves": []})
            loaded = rec.get("resumed_from")
            if entry["loaded"] is None and isinstance(loaded, str):
                entry["loaded"] = loaded[:1024]
            ck = last_checkpoint(rec)
            if ck is None:
                continue
            if rec.get("checkpoint") == SAVED:
                entry["saves"] = (entry["saves"] + [ck])[-MAX_SAVES:]
            elif ck["landed_at"] is not None:  # an async save landed: a later record says when
                for save in entry["saves"][-3:]:
                    if save["at"] == ck["at"]:
                        save["landed_at"] = ck["landed_at"]
    return {name: [gens[g] for g in sorted(gens)] for name, gens in out.items()}


def op_job(payload):
    """One job's story on this node: summary, status, metrics series, events and each log's last lines."""
    job_id = jobid.checked(payload.get("job_id"), ops.UserFacing)
    ws = ops.workspace(payload)
    jd = job_folder(ws, job_id).path
    if not os.path.isdir(jd):
        return {"job_id": job_id, "found": False}
    entry = job_entry(ws, job_id)
    max_points = int(payload.get("max_points", MAX_POINTS))
    entry["found"] = True
    entry["series"] = {row: points for name in metric_files(jd)
                       for row, points in series(JobFolder(jd).metrics_file(name), name, max_points).items()}
    entry["events"] = job_events(jd, None, int(payload.get("max_events", MAX_EVENTS)))
    restarts = _restarts(jd)
    entry["checkpoints"] = {row: gens for name in metric_files(jd)
                            for row, gens in checkpoints(JobFolder(jd).metrics_file(name), name, restarts).items()}
    lines = int(payload.get("lines", 50))
    logs = {}
    ldir = JobFolder(jd).logs
    for f in sorted(os.listdir(ldir)) if os.path.isdir(ldir) else []:
        if f.endswith(".log"):
            logs[f[:-4]] = ops.tail_lines(os.path.join(ldir, f), lines)
    entry["logs"] = logs
    return entry
