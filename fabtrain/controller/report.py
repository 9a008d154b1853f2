"""Turning task results into what the terminal shows: tables and one-liners."""
from __future__ import annotations

import time

from fabtrain.controller.lifecycle import NodeCheck, StartResult
from fabtrain.plan.plan import Plan, render_shell
from fabtrain.remote.transport import Reply


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


def human_bytes(n: float | None, compact: bool = False) -> str:
    """1536 -> "1.5 KiB" (compact: "1.5K"); None or not a number -> "?" ("-")."""
    if not isinstance(n, (int, float)):
        return "-" if compact else "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            shown = unit[0] if compact else f" {unit}"
            return f"{n:.0f}{shown}" if unit == "B" else f"{n:.1f}{shown}"
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
    if result.complete:
        out.append(f"job {result.job_id}: {' and '.join(roles)} started")
    else:
        out.append(f"job {result.job_id}: {' and '.join(roles)} NOT started on every node (see above)")
    return "\n".join(out)


def process_state_text(p: dict) -> str:
    if p["state"] == "exited":
        return f"exited ({p.get('exit_code')})"
    if p["state"] == "killed" and p.get("signal"):
        return f"killed ({p['signal']})"
    if p.get("zombies"):
        return f"{p['state']} +{p['zombies']} zombie"
    return p["state"]


def process_failed(p: dict, killed_by_fab: bool = False) -> bool:
    """Ended badly: a non-zero exit, or killed (137, or with its launcher) other than by `fab kill-all`."""
    return (p["state"] == "exited" and p.get("exit_code") != 0) or p["state"] == "lost" or \
        (p["state"] == "killed" and not killed_by_fab)


ROUTINE_EVENTS = ("agent_started", "agent_exit", "agent_stopped")


def _agent_view(v: dict) -> dict:
    """The node agent's health.json for this job (empty if none, or another job's)."""
    h = v.get("health")
    return h if isinstance(h, dict) and h.get("job_id") == v.get("job_id") else {}


def _ago(ts: float | None, now: float) -> str:
    if not isinstance(ts, (int, float)):
        return ""
    d = max(0.0, now - ts)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago"


def status_text(replies: list[Reply]) -> tuple[str, bool]:
    """The status table, and whether anything failed.

    Each process shows what node_ops sees (state, uptime, last log line) and
    what the node's agent (watchdog) sees: its state there and when the
    process last made progress. Notes flag zombies, orphans, stale or missing
    agents, and the job's status as the agents know it.
    """
    rows, notes, failed = [], [], False
    now = time.time()
    job_views: dict[tuple, list[str]] = {}
    for r in replies:
        if not r.ok:
            rows.append([r.node, "-", "UNREACHABLE", "", "", "", ""])
            notes.append(r.error)
            failed = True
            continue
        v = r.value
        if not v["job_id"]:
            rows.append([r.node, "-", "no job", "", "", "", ""])
            continue
        now = v.get("time") or time.time()  # the node's clock: health.json's times are the node's
        h = _agent_view(v)
        seen = {p.get("name"): p for p in h.get("processes") or []}
        job = h.get("job") or {}
        finished = job.get("status") == "finished"
        for p in v["processes"]:
            uptime = f"{p['uptime']:.0f}s" if p.get("uptime") else ""
            a = seen.get(p["name"], {})
            agent_state = ""
            if a:
                agent_state = a.get("state", "")
                if a.get("hung"):
                    agent_state += " HUNG"
                if a.get("killed_by_agent"):
                    agent_state += " (by agent)"
            progress = _ago(a.get("last_progress"), now) if a and a.get("state") not in ("exited", "killed") else ""
            rows.append([r.node, p["name"], process_state_text(p), uptime, agent_state, progress,
                         p.get("last_line", "")[:70]])
            # Stopped by its agent because the job finished (pservers): not a failure.
            if not (finished and a.get("killed_by_agent")):
                failed |= process_failed(p, bool(v.get("killed")))
        if v.get("killed"):
            notes.append(f"{r.node}: job {v['job_id']} was stopped by kill-all")
        agent = next((p for p in v["processes"] if p["name"] == "agent"), None)
        live = [p["name"] for p in v["processes"] if p["name"] != "agent" and p["state"] in ("running", "stopped", "zombie")]
        interval = h.get("interval") or 1.0
        health_ts = h.get("ts") or v.get("health_ts")
        if agent and agent["state"] == "running" and health_ts and now - health_ts > max(10.0, 3 * interval + 2):
            notes.append(f"{r.node}: STALE agent heartbeat: health.json is {now - health_ts:.0f}s old (interval {interval:g}s)")
            failed = True
        if live and (agent is None or agent["state"] not in ("running", "stopped")):
            notes.append(f"{r.node}: NO WATCHDOG: the agent is not running while {', '.join(live)} run(s) here"
                         " (fab kill-all stops them)")
        zombies = sum(p.get("zombies") or 0 for p in h.get("processes") or []) or \
            sum(p.get("zombies") or 0 for p in v["processes"])
        if zombies:
            notes.append(f"{r.node}: {zombies} ZOMBIE process(es): defunct children not reaped by their parent")
        for o in h.get("orphans") or []:
            notes.append(f"{r.node}: ORPHAN pid {o.get('pid')} ({o.get('name')}): {o.get('reason')}; being killed")
        coord = h.get("coordinator") or {}
        for lost in coord.get("lost") or []:
            notes.append(f"{r.node}: the agents lost contact with node {lost}")
        if job.get("status") in ("failed", "finished"):
            key = (job["status"], job.get("reason"), job.get("on_failure"))
            job_views.setdefault(key, []).append(r.node)
        events = [e for e in (h.get("events") or []) if e.get("kind") not in ROUTINE_EVENTS]
        ev = events[-1] if events else v.get("last_event")
        if ev:
            who = ev.get("name") or (f"{ev.get('role')}-{ev.get('rank')}" if ev.get("role") is not None else "")
            notes.append(f"{r.node}: last event: {ev.get('kind')}{' ' + who if who else ''}: {ev.get('reason', '')}"
                         f" ({_ago(ev.get('ts'), now)})")
    for (status, reason, on_failure), nodes in job_views.items():
        if status == "failed":
            failed = True
            what = "survivors left running for debugging (on_failure keep)" if on_failure == "keep" \
                else "torn down on every node (on_failure kill-job)"
            notes.insert(0, f"watchdog: JOB FAILED: {reason}; {what}  [{', '.join(nodes)}]")
        else:
            notes.insert(0, f"watchdog: job finished: {reason}  [{', '.join(nodes)}]")
    job_ids = {r.value["job_id"] for r in replies if r.ok and r.value["job_id"]}
    head = f"job {', '.join(sorted(job_ids)) or '-'}"
    return "\n".join([head, table(rows, ["node", "process", "state", "uptime", "agent", "progress", "last log line"]),
                      *notes]), failed


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
        for record in r.value.get("untrusted") or []:
            out.append(f"{r.node}: ignored run record {record}: not a process of this workspace's jobs")
        if r.value["left"]:
            out.append(f"{r.node}: STILL ALIVE: pids {', '.join(map(str, r.value['left']))}")
            clean = False
    return "\n".join(out), clean
