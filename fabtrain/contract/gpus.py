"""A node's GPU inventory in words: `fab check`'s lines, a start's refusal, the dashboard's summary.

The inventory is the record node ops' probe and status send (fabtrain/node/gpuinv.py builds it):
{"source", "gpus": [{"index", "free", "health", "processes": [{"pid", "user", "command", "mem"}],
"leased_by", "lease_job", "lease_user"}], "error"}. Everything here reads that record alone, so the
controller says what the node saw, not what its own machine holds.
"""


def describe(inv):
    """Lines for `fab check`: total and free, then each busy or flagged GPU with who holds it."""
    gpus = inv["gpus"]
    if not gpus:
        return ["GPUs: none (%s)" % inv.get("error", "none found")]
    free = [g for g in gpus if g["free"] and not g["health"]]
    lines = ["GPUs: %d, free %d%s" % (len(gpus), len(free), " (stand-in)" if inv["source"] == "stand-in" else "")]
    for g in gpus:
        flag = " (!) " + ", ".join(g["health"]) if g["health"] else ""
        for p in g["processes"]:
            lines.append("  GPU %d%s: %s pid %d %s %s MiB" % (g["index"], flag, p["user"], p["pid"], p["command"],
                                                             p["mem"] if p.get("mem") is not None else "?"))
        if "leased_by" in g:
            lines.append("  GPU %d%s: %s" % (g["index"], flag, lease_holder(g)))
        elif flag and not g["processes"]:
            lines.append("  GPU %d%s" % (g["index"], flag))
    return lines


def lease_holder(gpu):
    """Who holds a GPU's fabtrain lease, in words: the job where this user can read it."""
    job = "fabtrain job %s" % gpu["lease_job"] if gpu.get("lease_job") else "a fabtrain job"
    return "leased by %s, %s pid %d" % (job, gpu.get("lease_user") or "?", gpu["leased_by"])


def who(gpu):
    """Who keeps a GPU from being free, in one clause: its processes, its lease, and its health flag."""
    parts = ["%s pid %d %s %s MiB" % (p["user"], p["pid"], p["command"], p["mem"] if p.get("mem") is not None else "?")
             for p in gpu["processes"]]
    if "leased_by" in gpu:
        parts.append(lease_holder(gpu))
    if gpu["health"]:
        parts.append("(!) " + ", ".join(gpu["health"]))
    return ", ".join(parts) or "free"


def holder_text(gpu):
    return "GPU %d: %s" % (gpu["index"], who(gpu))


def summary(inv):
    """What the dashboard shows of a node's GPUs: total, free, and who holds each busy or flagged one."""
    gpus = inv["gpus"]
    return {"source": inv["source"], "total": len(gpus), "free": sum(1 for g in gpus if g["free"] and not g["health"]),
            "busy": [{"index": g["index"], "by": who(g)} for g in gpus if not g["free"] or g["health"]]}
