"""`fab watch`: follow a job in the terminal until it ends.

Polls every node once per --interval through the Collector (one `collect`
command per node), shows per-node health and per-trainer progress (redrawn in
place on a terminal, appended as plain lines otherwise), prints the agents'
events as they happen, and returns the job's outcome as the exit code.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

from fabtrain.controller.collector import Collector
from fabtrain.controller.report import human_bytes
from fabtrain.remote.session import Session

EXIT_FINISHED, EXIT_FAILED, EXIT_KILLED, EXIT_TIMEOUT = 0, 1, 3, 124
LIVE = ("running", "sleeping", "stopped", "zombie")


def _pct(v) -> str:
    return f"{v:.0f}%" if isinstance(v, (int, float)) else "-"


def _bytes(n) -> str:
    return human_bytes(n, compact=True)


def _age(ts, now) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    d = max(0.0, now - ts)
    return f"{d:.1f}s" if d < 60 else f"{d / 60:.0f}m"


def event_line(ev: dict) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(ev.get("ts") or 0))
    who = ev.get("name") or (f"{ev['role']}-{ev['rank']}" if ev.get("role") is not None and ev.get("rank") is not None else "")
    sig = f" [{ev['signal']}]" if ev.get("signal") else ""
    return f"{t} {ev.get('node', '?')} {ev.get('kind', '?')}{' ' + who if who else ''}{sig}: {ev.get('reason', '')}"


def outcome(col: Collector) -> tuple[str, bool, str]:
    """(state, ended, why): state is running, starting, finished, failed or killed."""
    with col.lock:
        views = list(col.nodes.values())
        events = list(col.events)
    reachable = [v for v in views if v.up]
    procs = [p for v in reachable for p in v.processes if p.get("name") != "agent"]
    live = [p for p in procs if p.get("state") in LIVE]
    kinds = {e.get("kind") for e in events}
    failed = next((e for e in reversed(events) if e.get("kind") == "job_failed"), None)
    if any(v.killed for v in views):
        state, why = "killed", "stopped by fab kill-all"
    elif failed is not None:
        state, why = "failed", failed.get("reason", "")
    elif "finished" in kinds:
        state, why = "finished", "every trainer exited with code 0"
    else:
        state, why = col.job_state(), ""
        if state == "failed":  # no agent said so (watchdog off): the processes' exit codes tell
            bad = [f"{p['name']} exited ({p.get('exit_code')})" for p in procs
                   if p.get("state") == "exited" and p.get("exit_code") not in (0, None)]
            why = ", ".join(bad) or "a process was lost"
    pending = any(p.get("state") == "not started" for p in procs)
    ended = bool(reachable) and not live and (state in ("finished", "failed", "killed")) and \
        (state != "finished" or not pending)
    if state == "failed" and "kept" in kinds:
        ended = True  # on_failure keep: the survivors stay for debugging; the job is over all the same
        why += "; on_failure keep: survivors left running for debugging (fab status, fab kill-all)"
    return state, ended, why


def frame(col: Collector, now: float, began: float, fresh: dict | None = None) -> list[str]:
    """The redrawn part. `fresh` maps node -> (health ts, controller time it first changed to that):
    snapshot ages are measured on the controller's clock, so node clock skew does not matter."""
    fresh = {} if fresh is None else fresh
    state, _, why = outcome(col)
    with col.lock:
        views = list(col.nodes.values())
        progress = sorted(col.progress.values(), key=lambda p: (p.role != "trainer", str(p.rank)))
        job = col.job_id_seen()
    lines = [f"job {job or '-'}: {state}{' (' + why + ')' if why and state != 'running' else ''}   "
             f"watching {now - began:.0f}s"]
    rows = [["node", "cpu", "mem", "load", "gpu", "agent", "processes"]]
    for v in views:
        if v.up is False:
            rows.append([v.name, "UNREACHABLE", "", "", "", "", (v.error or "")[:90]])
            continue
        h = v.health if isinstance(v.health, dict) and v.health.get("job_id") in (None, v.job_id) else {}
        host = h.get("host") or {}
        gpus = h.get("gpus") or []
        gpu = ",".join(f"{_pct(g.get('util'))}/{_bytes(g.get('mem_used'))}" for g in gpus) or "-"
        load = (host.get("load") or ["-"])[0]
        agent_state = next((p["state"] for p in v.processes if p.get("name") == "agent"), None)
        if h:
            ts = h.get("ts")
            if fresh.get(v.name, (None,))[0] != ts:
                fresh[v.name] = (ts, now)
            changed = fresh[v.name][1]
            stale = now - changed > 3 * (h.get("interval") or 1) + 2 and agent_state == "running"
            agent = f"{'STALE ' if stale else ''}{_age(changed, now)}"
        else:
            agent = agent_state or "-"
        by_name = {p.get("name"): p for p in (h.get("processes") or [])}
        procs = []
        for p in v.processes:
            if p.get("name") == "agent":
                continue
            s = p.get("state", "?")
            if s == "exited":
                s = f"exited({p.get('exit_code')})"
            hp = by_name.get(p.get("name")) or {}
            if hp.get("zombies") or p.get("zombies"):
                s += f"+{hp.get('zombies') or p.get('zombies')}Z"
            procs.append(f"{p.get('name')} {s}")
        rows.append([v.name, _pct(host.get("cpu_percent")), _pct(host.get("mem_percent")),
                     str(load), gpu, agent, ", ".join(procs) or ("no job" if not v.job_id else "-")])
    lines += _table(rows)
    trainers = [["process", "node", "step", "loss", "samples/s", "last record"]]
    for p in progress:
        r = p.last
        loss = r.get("loss")
        sps = r.get("samples_per_s")
        trainers.append([p.name, p.node, str(r.get("step", "-")),
                         f"{loss:.4g}" if isinstance(loss, (int, float)) else "-",
                         f"{sps:.0f}" if isinstance(sps, (int, float)) else "-",
                         _age(p.last_ts, now) + " ago" if p.last_ts else "-"])
    if len(trainers) > 1:
        lines += _table(trainers)
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def watch(session: Session, interval: float = 1.0, timeout: float | None = None, job_id: str | None = None,
          out: TextIO | None = None, tty: bool | None = None) -> int:
    out = out or sys.stdout
    tty = out.isatty() if tty is None else tty
    col = Collector(session, job_id=job_id)
    began = time.time()
    seen: set = set()
    fresh: dict = {}
    drawn = 0
    last_plain = ("", 0.0)
    while True:
        t0 = time.time()
        col.poll()
        now = time.time()
        with col.lock:
            events = list(reversed(col.events))  # oldest first
        new = []
        for ev in events:
            key = (ev.get("ts"), ev.get("node"), ev.get("kind"), ev.get("name"), ev.get("pid"), ev.get("reason"))
            if key not in seen:
                seen.add(key)
                new.append(ev)
        state, ended, why = outcome(col)
        lines = frame(col, now, began, fresh)
        if tty:
            buf = f"\x1b[{drawn}F\x1b[J" if drawn else ""
            buf += "".join(event_line(e) + "\n" for e in new)
            buf += "\n".join(lines) + "\n"
            out.write(buf)
            drawn = len(lines)
        else:
            for e in new:
                out.write(event_line(e) + "\n")
            # Plain output (a log file, CI): a frame when a node's state changes, else every 10 s.
            summary = "\n".join(line for line in lines[1:] if not line.startswith(tuple(col.progress)))
            if summary != last_plain[0] or now - last_plain[1] >= 10 or ended:
                out.write("\n".join(lines) + "\n")
                last_plain = (summary, now)
        out.flush()
        if ended:
            unreachable = [v.name for v in col.nodes.values() if v.up is False]
            if unreachable:
                out.write(f"note: {', '.join(unreachable)} unreachable: not seen how it ended there "
                          "(its agent tears down by itself)\n")
            out.write(f"job {col.job_id_seen()}: {state}{' (' + why + ')' if why else ''}\n")
            out.flush()
            return {"finished": EXIT_FINISHED, "failed": EXIT_FAILED, "killed": EXIT_KILLED}[state]
        if col.job_id_seen() is None and all(v.up for v in col.nodes.values()) and now - began > 5 * interval:
            out.write("no job on any node\n")
            return EXIT_FAILED
        if timeout is not None and now - began >= timeout:
            out.write(f"watch: timed out after {timeout:g} s; the job is {state}\n")
            out.flush()
            return EXIT_TIMEOUT
        time.sleep(max(0.0, interval - (time.time() - t0)))
