"""What the agent makes of its processes' checkpoints (docs/watchdog.md, "Checkpoints").

The launcher's progress hook writes each checkpoint save of an unchanged program into the rank's metrics
records (`ckpt_*`, and `resumed_from` for what it loaded before its first step: docs/progress.md). The
supervisor hands every such record to `take` (its ranks keep the last checkpoint, each path's last save and
what they resumed from); from them the agent

- puts each process's last checkpoint and what it resumed from into health.json (`health_fields`), which
  `fab status` reads;
- keeps, across a restart, what the generation before left (`summary`, given to the next generation's
  process context by relaunch.py), and says once the new generation's first step is in what it resumed
  from and how many steps were lost (`resumed`: the `resumed` event);
- says, for a process that failed, whether it failed soon after loading a checkpoint (`load_failure`: the
  hook's own line for a load before the first step, `<metrics>.load`, else its records and log): its beats
  carry it with the checkpoint saved before that file, and the restart policy stops a restart loop when two
  generations in a row fail so after loading the same file, or with on_bad_checkpoint previous points the
  next generation at the one before (coordination/restart.py);
- names, for each process of a restarted generation, the checkpoint it should resume from (`resume_path`:
  FABTRAIN_RESUME_FROM, relaunch.py): the newest its family saved, never one found damaged;
- on the coordinator's node, alerts when no trainer of the job has written a checkpoint for
  job.watchdog.no_checkpoint seconds (`NoCheckpoint`: the `no_checkpoint` event, an alert kind).

Standard library only.
"""
from __future__ import annotations

import json
import re

from fabtrain.contract import checkpoints as words
from fabtrain.contract.jobfolder import LOAD
from fabtrain.contract.events import EventKind
from fabtrain.contract.states import LIVE, JobState

MAX_SAVES = 64  # paths a rank's saves are kept for (a program that saves ckpt-<step>.pt each time)
# A failure this soon after the generation's first step (or before it) counts as one of its load: a damaged
# checkpoint fails a program as it loads it, or in its first steps.
LOAD_WINDOW = 60.0
LOG_TAIL = 64 * 1024  # bytes of a failed process's log read for its traceback
MARKER = "==== fabtrain: restart "  # relaunch.marker: where a generation's output begins in the log
FRAME = re.compile(r'File "([^"]*)", line \d+, in (\S+)')
STEPS_FROM_ZERO = ("lightning", "transformers")  # frameworks whose step is their own global step, not the process's
LIVE_STATES = tuple(str(s) for s in LIVE)


def take(rank, rec: dict) -> None:
    """A record's checkpoint fields into its rank (supervisor.RankSteps)."""
    ck = words.last_checkpoint(rec)
    if ck is not None:
        rank.ckpt = ck
        if ck["path"]:
            rank.saves.pop(ck["path"], None)
            rank.saves[ck["path"]] = (ck["step"], ck["at"])
            if len(rank.saves) > MAX_SAVES:
                del rank.saves[next(iter(rank.saves))]
    loaded = rec.get("resumed_from")
    if rank.resumed_from is None and isinstance(loaded, str) and loaded:
        rank.resumed_from = loaded[:1024]
    if isinstance(rec.get("framework"), str):
        rank.framework = rec["framework"]


def _ranks(progress) -> list:
    """The process's ranks that reported a step, lowest RANK first (a record without one last)."""
    ranks = [(k, r) for k, r in (getattr(progress, "ranks", None) or {}).items() if r.step is not None]
    ranks.sort(key=lambda kr: (not isinstance(kr[0], int), kr[0] if isinstance(kr[0], int) else 0))
    return [r for _, r in ranks]


def _saver(progress):
    """The rank whose checkpoint is the newest (its own step goes with it), else None."""
    best = None
    for r in _ranks(progress):
        if r.ckpt and (best is None or (r.ckpt["at"] or 0) > (best.ckpt["at"] or 0)):
            best = r
    return best


def _resumed_from(progress) -> str | None:
    return next((r.resumed_from for r in _ranks(progress) if r.resumed_from), None)


def health_fields(ctx) -> dict:
    """health.json's checkpoint fields of a process: its step, its last checkpoint, what it resumed from."""
    ranks = _ranks(ctx.progress)
    saver = _saver(ctx.progress)
    lead = saver or (ranks[0] if ranks else None)
    # step: the hook's only (a program that writes its own records turns the hook off: no save is seen then)
    out = {"step": lead.step if lead and lead.auto else None, "resumed_from": _resumed_from(ctx.progress),
           "resumed": getattr(ctx, "resumed", None)}
    if saver is not None:
        ck = saver.ckpt
        out.update(ckpt_step=ck["step"], ckpt_at=ck["at"], ckpt_path=ck["path"], ckpt_bytes=ck["bytes"],
                   ckpt_seconds=ck["seconds"])
    return out


def beat_fields(ctx) -> dict:
    """What a beat carries of a trainer for the coordinator's node (NoCheckpoint): its newest checkpoint
    ({at, step, path}) and when this generation's first record came."""
    p = ctx.progress
    if p is None or p.first_record is None:
        return {}
    saver = _saver(p)
    ck = {"at": saver.ckpt["at"], "step": saver.ckpt["step"], "path": saver.ckpt["path"]} if saver else None
    return {"ckpt": ck, "since": round(p.first_record, 3)}


def summary(ctx) -> dict:
    """What the next generation's context keeps of this process (relaunch.py): its generation, when it ended,
    its last step, what it loaded, every path saved so far (path -> (step, at, generation)), the files found
    damaged (on_bad_checkpoint previous: not resumed from again until saved anew) and the async saves that had
    not landed when it ended (never resumed from)."""
    before = ctx.before or {}
    saves = dict(before.get("saves") or {})
    fresh, unlanded = set(), set(before.get("unlanded") or ())
    for r in _ranks(ctx.progress):
        for path, (step, at) in r.saves.items():
            fresh.add(path)
            unlanded.discard(path)
            old = saves.get(path)
            if old is None or (at or 0) >= (old[1] or 0):
                saves[path] = (step, at, ctx.generation)
        if r.ckpt and r.ckpt["async"] and r.ckpt["landed_at"] is None and r.ckpt["path"]:
            unlanded.add(r.ckpt["path"])
    if len(saves) > MAX_SAVES:
        saves = dict(sorted(saves.items(), key=lambda kv: kv[1][1] or 0)[-MAX_SAVES:])
    ranks = _ranks(ctx.progress)
    failed = ctx.load_failure if isinstance(ctx.load_failure, tuple) else None
    loaded = _resumed_from(ctx.progress) or (failed[0] if failed else None)
    if loaded is None:
        fact = last_load(ctx.metrics_path) if getattr(ctx, "metrics_path", None) else None
        loaded = fact["path"] if fact and fact["load"] == words.LOADED else None
    return {"generation": ctx.generation, "ended_at": ctx.ended_at,
            "last_step": ranks[0].step if ranks else None, "framework": ranks[0].framework if ranks else None,
            "loaded": loaded, "saves": saves,
            "damaged": [p for p in before.get("damaged") or () if p not in fresh],  # a new save of it is whole
            "unlanded": sorted(p for p in unlanded if p in saves)}


def _usable(before: dict) -> list:
    """The saves a generation may resume from, oldest first: (path, (step, at, generation)), none damaged or
    an async save that had not landed."""
    skip = set(before.get("damaged") or ()) | set(before.get("unlanded") or ())
    return sorted(((p, v) for p, v in (before.get("saves") or {}).items() if p not in skip),
                  key=lambda kv: kv[1][1] or 0)


def resume_path(before: dict | None) -> str | None:
    """FABTRAIN_RESUME_FROM of a restarted process: the newest checkpoint its family saved in the generations
    before (none found damaged, no async save still being written when it ended), else what the one before
    loaded (a generation that failed before its first save); None: none known (the variable is not set)."""
    if not before:
        return None
    usable = _usable(before)
    if usable:
        return usable[-1][0]
    loaded = before.get("loaded")
    return loaded if loaded and loaded not in (before.get("damaged") or ()) else None


def previous(before: dict | None, path: str) -> tuple | None:
    """(path, step) of the checkpoint saved before `path` (on_bad_checkpoint previous): the newest other file
    saved before it, none found damaged; None where `path` was never seen saved, or nothing was saved before
    it (a program that always overwrites one file)."""
    saves = (before or {}).get("saves") or {}
    if path not in saves:
        return None
    at = saves[path][1] or 0
    older = [(p, v) for p, v in _usable(before) if p != path and (v[1] or 0) < at]
    return (older[-1][0], older[-1][1][0]) if older else None


def resumed(ctx):
    """(reason, fields) of the `resumed` event of a restarted process, once its generation's first step is in
    (then never again); None before, and for a process of the first generation."""
    b = ctx.before
    if b is None or ctx.resumed is not None:
        return None
    ranks = _ranks(ctx.progress)
    if not ranks:
        return None
    path = _resumed_from(ctx.progress)
    if path is None:  # a load the hook saw with no record of it yet (records off: a program's own win)
        fact = last_load(getattr(ctx, "metrics_path", None))
        path = fact["path"] if fact and fact["load"] == words.LOADED else None
    last = b.get("last_step")
    saved = (b.get("saves") or {}).get(path) if path else None
    step = at = lost = None
    if saved is not None:
        step, at, generation = saved
        if last is not None and words.number(step) is not None:
            if generation == b.get("generation"):  # saved by the generation that failed: its steps since are lost
                lost = last - step
            elif b.get("loaded") == path:  # the one that failed loaded it too and saved no newer: all its work
                lost = last - step if b.get("framework") in STEPS_FROM_ZERO else last
    elif path is None:
        lost = last
    before_failure = b["ended_at"] - at if at is not None and words.number(b.get("ended_at")) is not None else None
    lost = max(0, lost) if words.number(lost) is not None else None
    fallback = b.get("fallback")
    ctx.resumed = words.resumed_text(ctx.generation, path, step, before_failure, lost if path else None, last,
                                     fallback)
    rank = ranks[0]
    fields = {"role": ctx.role, "rank": ctx.rank, "generation": ctx.generation, "path": path, "ckpt_step": step,
              "ckpt_at": at, "steps_lost": lost, "last_step": last, "first_step": rank.step}
    if b.get("pointed"):
        fields["resume_env"] = b["pointed"]  # what FABTRAIN_RESUME_FROM named
    if fallback:
        fields["fallback"] = fallback
    return ctx.resumed, fields


def newest_known(before: dict | None) -> str | None:
    """The checkpoint a restarted program most likely loads: what FABTRAIN_RESUME_FROM named, else the newest
    saved so far, else what the generation before loaded."""
    if not before:
        return None
    if before.get("pointed"):
        return before["pointed"]
    saves = before.get("saves") or {}
    if saves:
        return max(saves.items(), key=lambda kv: kv[1][1] or 0)[0]
    return before.get("loaded")


def last_load(metrics_path: str | None) -> dict | None:
    """The hook's word on this generation's loads before the first step (`<metrics>.load`, relaunch.py clears
    it): the last line of a rank whose last load failed, else the last line; None where it wrote none. Each
    line: {"ts", "pid", "rank", "path", "load": loaded or failed, "seconds", "error"}."""
    if not metrics_path:
        return None
    try:
        with open(metrics_path + LOAD, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL))
            data = f.read()
    except OSError:
        return None
    last: dict = {}  # pid -> its last line
    for line in data.split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("path"), str) and rec["path"] and \
                rec.get("load") in (words.LOADED, words.LOAD_FAILED) and words.number(rec.get("ts")) is not None:
            rec["path"] = rec["path"][:1024]
            last.pop(rec.get("pid"), None)
            last[rec.get("pid")] = rec
    if not last:
        return None
    failed = [r for r in last.values() if r["load"] == words.LOAD_FAILED]
    return (failed or list(last.values()))[-1]


def failed_in_load(log_path: str | None) -> bool:
    """Whether this generation's output in the log (after the last restart marker) holds a traceback that
    runs through a checkpoint load: torch.load, DCP's load, a module's load_state_dict, safetensors, Lightning's
    or Hugging Face's resume."""
    if not log_path:
        return False
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    text = text[text.rfind(MARKER) + 1:] if MARKER in text else text
    if "Traceback (most recent call last):" not in text:
        return False
    return any(_is_load(path.replace("\\", "/"), func) for path, func in FRAME.findall(text))


def _is_load(path: str, func: str) -> bool:
    if path.endswith("torch/serialization.py"):
        return "save" not in func and "writer" not in func.lower()
    if "torch/distributed/checkpoint/" in path or "/safetensors/" in path:
        return "load" in func
    if path.endswith("_fabtrain_progress_frameworks.py"):
        return func == "load"  # the hook's wrapper of a checkpoint load
    return func in ("load_state_dict", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state",
                    "restore_training_state", "_restore_modules_and_callbacks", "resume_start", "load_checkpoint")


def load_failure(ctx):
    """(path, step, after, previous) when this process failed soon after loading a checkpoint, else None.

    Before its first record, the hook's own line says it (`last_load`): its last load before the first
    step raised (`after` None: it failed in the load), or returned and the process failed within LOAD_WINDOW
    of it (`after`: the seconds since). With its first record in, its records say what it resumed from and it
    failed within LOAD_WINDOW of its first step (`after`: seconds from its first step to its end). With
    neither (a hook that wrote no line), its log's traceback runs through a checkpoint load: the file is then
    what FABTRAIN_RESUME_FROM named, else the newest checkpoint the generations before saved or loaded.
    `previous`: (path, step) of the checkpoint saved before that file, or None (on_bad_checkpoint previous).
    Computed once, at its end."""
    if ctx.load_failure is not None:
        return ctx.load_failure or None
    if not ctx.ended:
        return None
    ctx.load_failure = False
    if ctx.exit_code in (0, None) or ctx.close_reason:
        return None
    p = ctx.progress
    first = p.first_record if p is not None else None
    fact = last_load(getattr(ctx, "metrics_path", None)) if first is None else None
    path = _resumed_from(p)
    if fact is not None:
        path = fact["path"]
        if fact["load"] == words.LOADED and ctx.ended_at - fact["ts"] > LOAD_WINDOW:
            return None
        after = None if fact["load"] == words.LOAD_FAILED else round(max(0.0, ctx.ended_at - fact["ts"]), 1)
    elif path:
        if first is not None and ctx.ended_at - first > LOAD_WINDOW:
            return None
        after = round(max(0.0, ctx.ended_at - first), 1) if first is not None else None
    elif first is not None or not failed_in_load(ctx.log_path):
        return None
    else:
        path, after = newest_known(ctx.before), None
        if path is None:
            return None
    saved = ((ctx.before or {}).get("saves") or {}).get(path)
    ctx.load_failure = (path, saved[0] if saved else None, after, previous(ctx.before, path))
    return ctx.load_failure


def as_beat(loaded) -> dict | None:
    """A failure's `loaded` as its beat carries it: {path, step, after, previous: {path, step} or None}."""
    if not loaded:
        return None
    prev = loaded[3] if len(loaded) > 3 else None
    return {"path": loaded[0], "step": loaded[1], "after": loaded[2],
            "previous": {"path": prev[0], "step": prev[1]} if prev else None}


class NoCheckpoint:
    """On the coordinator's node: the job's trainers have written no checkpoint for job.watchdog.no_checkpoint
    seconds (counted from the newest checkpoint of the running generation, else from its first step record):
    one `no_checkpoint` event (an alert kind), again only after a newer checkpoint or in a new generation."""

    def __init__(self, watchdog, events):
        limit = (watchdog or {}).get("no_checkpoint") if isinstance(watchdog, dict) else None
        self.limit = float(limit) if words.number(limit) is not None and limit > 0 else None
        self.events = events
        self.said = None

    def check(self, co, ledger, now: float) -> None:
        if self.limit is None or co is None or ledger.status.status != JobState.RUNNING:
            return
        with co.lock:
            tables = {node: dict(peer.procs) for node, peer in co.board.peers.items() if node not in co.board.out}
        live = [(node, name, p) for node, procs in tables.items() for name, p in procs.items()
                if isinstance(p, dict) and p.get("role") == "trainer" and p.get("state") in LIVE_STATES]
        saved = [(p["ckpt"], node, name) for node, name, p in live
                 if isinstance(p.get("ckpt"), dict) and words.number(p["ckpt"].get("at")) is not None]
        starts = [p["since"] for _, _, p in live if words.number(p.get("since")) is not None]
        newest = max(saved, key=lambda s: s[0]["at"]) if saved else None
        since = newest[0]["at"] if newest else min(starts) if starts else None
        if since is None or now - since < self.limit:
            return
        key = (ledger.generation, since)
        if self.said == key:
            return
        self.said = key
        limit = "job.watchdog.no_checkpoint: %s" % words.seconds_text(self.limit)
        if newest:
            ck, node, name = newest
            where = " (%s)" % ck["path"] if ck.get("path") else ""
            reason = "no checkpoint for %s (%s): the last was %s's on %s, step %s%s" % (
                words.seconds_text(now - since), limit, name, node, words.step_text(ck.get("step")), where)
            self.events.write(EventKind.NO_CHECKPOINT, reason, name, role="trainer", origin=node,
                              generation=ledger.generation, ckpt_step=ck.get("step"), ckpt_at=ck["at"])
        else:
            reason = "no checkpoint for %s (%s): none written since generation %d's first step" % (
                words.seconds_text(now - since), limit, ledger.generation)
            self.events.write(EventKind.NO_CHECKPOINT, reason, generation=ledger.generation)
