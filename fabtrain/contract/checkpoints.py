"""Checkpoints in words: the last one a rank saved, what a failure now would lose, what a restart resumed from.

The launcher's progress hook (fabtrain/node/progress_frameworks.py) records each checkpoint save of an
unchanged program in the rank's metrics records (docs/progress.md): a record at once when a save returns
(`"checkpoint": "saved"`), and the same `ckpt_*` fields in every record after it; a load before the
program's first step is its `resumed_from` (and, in the file beside the records, `<metrics>.load`, each load
before the first step as it returned or raised: LOADED, LOAD_FAILED). The agent (what a restart resumed from, the restart loop a
damaged checkpoint makes) and the controller's views (fab status, fab watch, the dashboard, /metrics)
say them with these words. Standard library only: shipped to the nodes with the contract.
"""

CKPT_FIELDS = ("ckpt_step", "ckpt_at", "ckpt_path", "ckpt_bytes", "ckpt_seconds", "ckpt_async", "ckpt_landed_at")
SAVED = "saved"  # a record's "checkpoint" when a save just returned
# The hook's line in `<metrics>.load` (contract/jobfolder.py's load_file) for a load before the first step:
# {"ts", "pid", "rank", "load": LOADED or LOAD_FAILED, "path", "seconds", "error" (a failed one's)}.
LOADED, LOAD_FAILED = "loaded", "failed"
RESUME_ENV = "FABTRAIN_RESUME_FROM"  # a restarted generation's checkpoint to resume from (agent/relaunch.py)
ON_BAD_CHECKPOINT = ("stop", "previous")  # job.watchdog.on_bad_checkpoint: the first is the default


def number(v):
    """A finite int or float, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v if v == v and v not in (float("inf"), float("-inf")) else None


def last_checkpoint(rec):
    """The last checkpoint a record says its rank saved: {step, at, path, bytes, seconds, async, landed_at}
    (None where the record does not say), or None when it carries no checkpoint."""
    if not isinstance(rec, dict) or number(rec.get("ckpt_step")) is None:
        return None
    path = rec.get("ckpt_path")
    return {"step": rec["ckpt_step"], "at": number(rec.get("ckpt_at")),
            "path": path if isinstance(path, str) and path else None,
            "bytes": number(rec.get("ckpt_bytes")), "seconds": number(rec.get("ckpt_seconds")),
            "async": rec.get("ckpt_async") is True, "landed_at": number(rec.get("ckpt_landed_at"))}


def at_risk(ckpt, step, now):
    """What a failure now would lose: (steps, seconds) since the checkpoint (None where not known)."""
    if not ckpt:
        return None, None
    steps = step - ckpt["step"] if number(step) is not None and number(ckpt.get("step")) is not None else None
    seconds = max(0.0, now - ckpt["at"]) if number(now) is not None and ckpt.get("at") is not None else None
    return (max(0, steps) if steps is not None else None), seconds


def seconds_text(s):
    """0.002 -> "2 ms", 0.4 -> "0.4 s", 3.14 -> "3.1 s", 4 -> "4 s", 840 -> "14 min", 9000 -> "2.5 h", 300000 -> "3.5 days"."""
    s = max(0.0, float(s))
    if s < 0.1:
        return "%.0f ms" % (s * 1000)
    if s < 10:
        return "%s s" % ("%.1f" % s).rstrip("0").rstrip(".")
    if s < 90:
        return "%.0f s" % s
    if s < 90 * 60:
        return "%.0f min" % (s / 60)
    if s < 48 * 3600:
        return "%.1f h" % (s / 3600)
    return "%.1f days" % (s / 86400)


def size_text(n):
    """1288490188 -> "1.2 GiB"; None -> None."""
    if number(n) is None:
        return None
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return "%d B" % n if unit == "B" else "%.1f %s" % (n, unit)
        n /= 1024.0
    return None


def step_text(step):
    return "%d" % step if number(step) is not None and float(step).is_integer() else "%s" % (step,)


def checkpoint_text(ckpt, step, now, live=True):
    """`step 1200, 14 min ago, 1.2 GiB in 3.1 s (out/ckpt.pt); a failure now loses 310 steps, 14 min` (the last
    part only while it runs: `live`)."""
    parts = ["step %s" % step_text(ckpt["step"])]
    if ckpt.get("at") is not None and number(now) is not None:
        parts.append("%s ago" % seconds_text(now - ckpt["at"]))
    size, took = size_text(ckpt.get("bytes")), ckpt.get("seconds")
    if size or took is not None:
        parts.append(" in ".join(x for x in (size, seconds_text(took) if took is not None else None) if x))
    text = ", ".join(parts)
    if ckpt.get("async"):
        text += " (async, %s)" % ("landed" if ckpt.get("landed_at") is not None else "still being written")
    if ckpt.get("path"):
        text += " (%s)" % ckpt["path"]
    steps, seconds = at_risk(ckpt, step, now) if live else (None, None)
    risk = [x for x in ("%d step%s" % (steps, "" if steps == 1 else "s") if steps is not None else None,
                        seconds_text(seconds) if seconds is not None else None) if x]
    return text + ("; a failure now loses %s" % ", ".join(risk) if risk else "")


def resumed_text(generation, path, step=None, saved_before=None, lost=None, previous_last=None, fallback=None):
    """What generation g started from: `generation 2 resumed from out/ckpt.pt (step 1200, saved 14 min before
    the failure): 310 steps lost`, or `generation 2 loaded no checkpoint: it started from step 0 (1510 steps of
    generation 1 lost)`. `fallback`: what on_bad_checkpoint previous pointed it at (the Board's `resume_from`):
    `..., the checkpoint before out/ckpt-1200.pt, which generation 1 and 2 failed loading`, or, where the
    program loaded another file, `(FABTRAIN_RESUME_FROM named out/ckpt-1000.pt, the checkpoint before ...)`."""
    before = _before_text(fallback)
    if not path:
        text = "generation %d loaded no checkpoint: it started from step 0" % generation
        if number(previous_last) is not None:
            text += " (%s steps of generation %d lost)" % (step_text(previous_last), generation - 1)
        return text + (" (FABTRAIN_RESUME_FROM named %s, %s)" % (fallback["path"], before) if before else "")
    text = "generation %d resumed from %s" % (generation, path)
    said = (["step %s" % step_text(step)] if number(step) is not None else []) + \
        (["saved %s before the failure" % seconds_text(saved_before)] if number(saved_before) is not None else [])
    if said:
        text += " (%s)" % ", ".join(said)
    if before and fallback["path"] == path:
        text += ", %s" % before
    elif before:
        text += " (FABTRAIN_RESUME_FROM named %s, %s)" % (fallback["path"], before)
    if number(lost) is not None:
        text += ": %s step%s lost" % (step_text(lost), "" if lost == 1 else "s")
    elif number(step) is None:
        text += " (no save of it was seen in the generations before)"
    return text


def _failed_loading(first, second, after):
    """`generation 1 and 2 failed loading`, or `... failed 4 s after loading` (`after`: seconds, None: in the load)."""
    when = "failed %s after loading" % seconds_text(after) if number(after) is not None else "failed loading"
    return "generation %d and %d %s" % (first, second, when)


def _before_text(fallback):
    """`the checkpoint before out/ckpt-1200.pt, which generation 1 and 2 failed loading`, or None."""
    if not isinstance(fallback, dict) or not isinstance(fallback.get("path"), str) or \
            not isinstance(fallback.get("instead_of"), str):
        return None
    failed = fallback.get("failed")
    if not (isinstance(failed, (list, tuple)) and len(failed) == 2 and all(isinstance(g, int) for g in failed)):
        return "the checkpoint before %s" % fallback["instead_of"]
    return "the checkpoint before %s, which %s" % (fallback["instead_of"], _failed_loading(
        failed[0], failed[1], fallback.get("after")))


def fallback_text(generation, fallback):
    """What on_bad_checkpoint previous does: `generation 3 resumes from out/ckpt-1000.pt, the checkpoint before
    out/ckpt-1200.pt, which generation 1 and 2 failed loading`."""
    return "generation %d resumes from %s, %s" % (generation, fallback["path"], _before_text(fallback))


def damaged_text(first, second, after, path, step=None):
    """`generation 2 and 3 failed 4 s after loading out/ckpt.pt (step 1200): the checkpoint may be damaged`, or
    `... failed loading out/ckpt.pt ...` where both failed in the load itself (`after` None)."""
    return "%s %s%s: the checkpoint may be damaged" % (
        _failed_loading(first, second, after), path, " (step %s)" % step_text(step) if number(step) is not None else "")
