"""Checkpoints in words: the last one a rank saved, what a failure now would lose, what a restart resumed from.

The launcher's progress hook (fabtrain/node/progress_frameworks.py) records each checkpoint save of an
unchanged program in the rank's metrics records (docs/progress.md): a record at once when a save returns
(`"checkpoint": "saved"`), and the same `ckpt_*` fields in every record after it; a load before the
program's first step is its `resumed_from`. The agent (what a restart resumed from, the restart loop a
damaged checkpoint makes) and the controller's views (fab status, fab watch, the dashboard, /metrics)
say them with these words. Standard library only: shipped to the nodes with the contract.
"""

CKPT_FIELDS = ("ckpt_step", "ckpt_at", "ckpt_path", "ckpt_bytes", "ckpt_seconds", "ckpt_async", "ckpt_landed_at")
SAVED = "saved"  # a record's "checkpoint" when a save just returned


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


def resumed_text(generation, path, step=None, saved_before=None, lost=None, previous_last=None):
    """What generation g started from: `generation 2 resumed from out/ckpt.pt (step 1200, saved 14 min before
    the failure): 310 steps lost`, or `generation 2 loaded no checkpoint: it started from step 0 (1510 steps of
    generation 1 lost)`."""
    if not path:
        text = "generation %d loaded no checkpoint: it started from step 0" % generation
        if number(previous_last) is not None:
            text += " (%s steps of generation %d lost)" % (step_text(previous_last), generation - 1)
        return text
    text = "generation %d resumed from %s" % (generation, path)
    said = (["step %s" % step_text(step)] if number(step) is not None else []) + \
        (["saved %s before the failure" % seconds_text(saved_before)] if number(saved_before) is not None else [])
    if said:
        text += " (%s)" % ", ".join(said)
    if number(lost) is not None:
        text += ": %s step%s lost" % (step_text(lost), "" if lost == 1 else "s")
    elif number(step) is None:
        text += " (no save of it was seen in the generations before)"
    return text


def damaged_text(first, second, after, path, step=None):
    """`generation 2 and 3 failed 4 s after loading out/ckpt.pt (step 1200): the checkpoint may be damaged`, or
    `... failed loading out/ckpt.pt ...` where both failed in the load itself (`after` None)."""
    when = "failed %s after loading" % seconds_text(after) if number(after) is not None else "failed loading"
    return "generation %d and %d %s %s%s: the checkpoint may be damaged" % (
        first, second, when, path, " (step %s)" % step_text(step) if number(step) is not None else "")
