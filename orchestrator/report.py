"""Turning task results into what the terminal shows: tables and one-liners."""
from __future__ import annotations

import time

from .lifecycle import NodeCheck, StartResult
from .plan import Plan, render_shell
from .transport import Reply


def table(rows: list[list[str]], header: list[str]) -> str:
    rows = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_text(plan: Plan) -> str:
    out = [f"# job {plan.job_id} on cluster {plan.cluster}: mode {plan.mode}, sgd {plan.sgd}"]
    if plan.pserver_endpoints:
        out.append(f"# pservers: {','.join(plan.pserver_endpoints)}")
    out.append(f"# master (trainer 0): {plan.master}")
    for n in plan.nodes:
        out.append("")
        out.append(f"## node {n.node} ({n.host}), workspace {n.workspace}")
        if not n.processes:
            out.append("# (nothing to run)")
            continue
        out.append(f"WS={n.workspace}")
        for p in n.processes:
            out.append(f"# {p.name}")
            out.append(render_shell(p))
    return "\n".join(out)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def check_text(checks: list[NodeCheck]) -> str:
    rows = []
    for c in checks:
        p = c.probe
        if not p:
            rows.append([c.node, "UNREACHABLE", "", "", "", "", "", "", ""])
            continue
        differs = set(p.get("differs", []))

        def flag(key, text):
            return f"{text} (!)" if key in differs else text
        lo, hi = c.clock_offset
        clock = f"±{(hi - lo) / 2:.2f}s" if lo <= 0 <= hi else f"{(lo + hi) / 2:+.2f}s"
        rows.append([c.node, "ok" if c.ok else "PROBLEM", flag("python", p["python"]),
                     flag("torch", p["torch"] or "-"), flag("cuda", p["cuda"] or "-") + f" gpus={p['gpus']}",
                     flag("paddle", p["paddle"] or "-"), p["psutil"] or "-",
                     human_bytes(p["disk_free"]), clock])
    out = [table(rows, ["node", "state", "python", "torch", "cuda", "paddle", "psutil", "disk free", "clock"])]
    for c in checks:
        for problem in c.problems:
            out.append(f"{c.node}: {problem}" if not problem.startswith(c.node) else problem)
    if any("differs" in c.probe for c in checks):
        out.append("(!) differs across nodes")
    return "\n".join(out)


def start_text(result: StartResult, roles: tuple[str, ...]) -> str:
    out = []
    for r in result.replies:
        if not r.ok:
            out.append(f"{r.node}: FAILED: {r.error}")
            continue
        names = ", ".join(f"{s['name']} (pid {s['pid']})" for s in r.value["started"])
        out.append(f"{r.node}: started {names}")
        for f in r.value["failed"]:
            out.append(f"{r.node}: {f['name']} exited at once with code {f['exit_code']}: {' | '.join(f['log'])}")
        for w in r.value["warnings"]:
            out.append(f"{r.node}: warning: {w}")
    out.append(f"job {result.job_id}: {' and '.join(roles)} started")
    return "\n".join(out)


def process_state_text(p: dict) -> str:
    if p["state"] == "exited":
        return f"exited ({p.get('exit_code')})"
    if p.get("zombies"):
        return f"{p['state']} +{p['zombies']} zombie"
    return p["state"]


def process_failed(p: dict) -> bool:
    return (p["state"] == "exited" and p.get("exit_code") != 0) or p["state"] in ("lost",)


def status_text(replies: list[Reply]) -> tuple[str, bool]:
    """The status table, and whether anything failed."""
    rows, notes, failed = [], [], False
    now = time.time()
    for r in replies:
        if not r.ok:
            rows.append([r.node, "-", "UNREACHABLE", "", ""])
            notes.append(r.error)
            failed = True
            continue
        v = r.value
        if not v["job_id"]:
            rows.append([r.node, "-", "no job", "", ""])
            continue
        for p in v["processes"]:
            uptime = f"{p['uptime']:.0f}s" if p.get("uptime") else ""
            rows.append([r.node, p["name"], process_state_text(p), uptime, p.get("last_line", "")[:80]])
            failed |= process_failed(p)
        if v.get("killed"):
            notes.append(f"{r.node}: job {v['job_id']} was stopped by kill-all")
        if v.get("health_ts") and now - v["health_ts"] > 10 and any(p["name"] == "agent" and p["state"] == "running" for p in v["processes"]):
            notes.append(f"{r.node}: agent heartbeat stale ({now - v['health_ts']:.0f}s old)")
        ev = v.get("last_event")
        if ev:
            notes.append(f"{r.node}: last event: {ev.get('kind')} {ev.get('role', '')}-{ev.get('rank', '')}: {ev.get('reason', '')}")
    job_ids = {r.value["job_id"] for r in replies if r.ok and r.value["job_id"]}
    head = f"job {', '.join(sorted(job_ids)) or '-'}"
    return "\n".join([head, table(rows, ["node", "process", "state", "uptime", "last log line"]), *notes]), failed


def kill_text(replies: list[Reply]) -> tuple[str, bool]:
    out, clean = [], True
    for r in replies:
        if not r.ok:
            out.append(f"{r.node}: FAILED: {r.error}")
            clean = False
            continue
        killed = r.value["killed"]
        if killed:
            what = ", ".join(f"{k['name']}{' child' if k.get('child') else ''} pid {k['pid']} ({k['signal']}{', orphan' if k.get('orphan') else ''})" for k in killed)
            out.append(f"{r.node}: killed {what}")
        else:
            out.append(f"{r.node}: nothing running")
        if r.value["left"]:
            out.append(f"{r.node}: STILL ALIVE: pids {', '.join(map(str, r.value['left']))}")
            clean = False
    return "\n".join(out), clean
