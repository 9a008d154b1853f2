"""`fab watch`: follow a job in the terminal until it ends.

Polls every node once per --interval through the Collector (one `collect`
command per node), shows per-node health and per-trainer progress (redrawn in
place on a terminal, appended as plain lines otherwise), prints the agents'
events as they happen, and returns the job's outcome as the exit code: the
state `jobstate.job_verdict` decides (as `fab status` and the dashboard do),
0 finished, 1 failed, 3 killed.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from fabtrain.controller import checkpoints
from fabtrain.controller.collector import Collector, NodeSnapshot, Snapshot
from fabtrain.controller.jobstate import WATCH_EXIT, Verdict
from fabtrain.controller.lifecycle import no_job
from fabtrain.controller.report import human_bytes
from fabtrain.contract.states import JobState, ProcessState
from fabtrain.controller.terminal import visible
from fabtrain.controller.verdict_text import duration_text
from fabtrain.contract import progress as hook
from fabtrain.remote.session import Session
from fabtrain.remote.transport import down_label

EXIT_FINISHED, EXIT_FAILED, EXIT_KILLED = (WATCH_EXIT[s] for s in (JobState.FINISHED, JobState.FAILED, JobState.KILLED))
EXIT_TIMEOUT = 124
PLAIN_EVERY = 10.0  # seconds between frames off a terminal when nothing changed (docs/watchdog.md)


def _pct(v) -> str:
    return f"{v:.0f}%" if isinstance(v, (int, float)) else "-"


def _bytes(n) -> str:
    return human_bytes(n, compact=True)


def _age(ts, now) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    d = max(0.0, now - ts)
    return f"{d:.1f}s" if d < 60 else f"{d / 60:.0f}m"


def _clock(ts) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(ts or 0))
    except (OverflowError, ValueError, OSError):  # a checked but absurd ts (year 10^290)
        return "??:??:??"


def event_line(ev: dict) -> str:
    t = _clock(ev.get("ts"))
    who = ev.get("name") or (f"{ev['role']}-{ev['rank']}" if ev.get("role") is not None and ev.get("rank") is not None else "")
    sig = f" [{ev['signal']}]" if ev.get("signal") else ""
    return visible(f"{t} {ev.get('node', '?')} {ev.get('kind', '?')}{' ' + who if who else ''}{sig}: {ev.get('reason', '')}")


def frame(snap: Snapshot, now: float, began: float, fresh: dict | None = None, scheduler: str | None = None) -> list[str]:
    """The redrawn part. `fresh` maps node -> (health ts, controller time it first changed to that):
    snapshot ages are measured on the controller's clock, so node clock skew does not matter.
    `scheduler`: the scheduler's own line on the job (Slurm's state), shown under the job's."""
    fresh = {} if fresh is None else fresh
    verdict = snap.verdict
    why = visible(verdict.summary())
    lines = [f"job {snap.job_id or '-'}: {verdict.state}{' (' + why + ')' if why and verdict.state != JobState.RUNNING else ''}"
             f"{'  [' + verdict.restarts + ']' if verdict.restarts else ''}"
             f"   watching {now - began:.0f}s"]
    lines += [visible(scheduler)] if scheduler else []
    lines += [f"note: {note}" for note in verdict.notes]
    # what this generation resumed from (the agents' `resumed` sentences: controller/checkpoints.py)
    lines += [visible(line) for line in checkpoints.resumed_lines(
        [(v.name, v.health) for v in snap.nodes if v.job_id == snap.job_id])]
    for node, d in sorted(snap.dropped.items()):
        lines.append(f"note: {node}: {d['count']} malformed record(s) dropped (latest: {d['last']})")
    rows = [["node", "cpu", "mem", "load", "gpu", "agent", "processes"]]
    for v in snap.nodes:
        rows.append(_node_row(v, verdict, now, fresh))
    lines += _table(rows)
    trainers = [["process", "node", "step", "loss", "samples/s", "last checkpoint", "last record"]]
    for p in sorted(snap.progress.values(), key=lambda p: (p.role != "trainer", hook.process_of(p.name), str(p.rank))):
        r = p.last
        # samples/s of its last record that has one (the dashboard's number: an evaluation's record has none)
        loss, sps = r.get("loss"), p.rate if p.rate is not None else r.get("samples_per_s")
        # The record's own time (the node's clock), not when watch first read it: a job
        # that finished an hour ago shows its last record an hour old.
        written = r.get("ts") if isinstance(r.get("ts"), (int, float)) else p.last_ts
        trainers.append([p.name, p.node, _step(r),
                         f"{loss:.4g}" if loss is not None else "-", f"{sps:.0f}" if sps is not None else "-",
                         visible(checkpoints.cell(r, now)), _age(written, now) + " ago" if written else "-"])
    # A trainer with no record yet: its last log line is its sign of life.
    quiet = [(v.name, p) for v in snap.nodes if v.job_id == snap.job_id for p in v.processes
             if p["name"].startswith("trainer") and p["name"] not in snap.progress]
    for node, p in quiet:
        line = visible((p.get("last_line") or "").strip())[:100]
        trainers.append([p["name"], node, "-", "-", "-", "-", f"none yet; log: {line}" if line else "none yet"])
    if len(trainers) > 1:
        lines += _table(trainers)
    return lines


def _step(rec: dict) -> str:
    """The step, out of the run's total steps with the time left where the framework knows them."""
    step, total = rec.get("step"), rec.get("total_steps")
    if step is None:
        return "-"
    if not isinstance(total, (int, float)) or total <= 0:
        return str(step)
    text = f"{step}/{total:.0f}"
    st = rec.get("step_time")
    if isinstance(st, (int, float)) and st > 0 and total > step:
        text += f" (eta {duration_text((total - step) * st)})"
    return text


def _node_row(v: NodeSnapshot, verdict: Verdict, now: float, fresh: dict) -> list[str]:
    if v.up is False:
        return [v.name, down_label(v.down), "", "", "", "", (v.error or "")[:90]]
    h = v.health if v.health and v.health.get("job_id") in (None, v.job_id) else {}
    host = h.get("host") or {}
    gpu = ",".join(f"{_pct(g.get('util'))}/{_bytes(g.get('mem_used'))}" for g in h.get("gpus") or []) or "-"
    load = (host.get("load") or ["-"])[0]
    agent_state = v.agent_state()
    if h:
        ts = h["ts"]
        if fresh.get(v.name, (None,))[0] != ts:
            fresh[v.name] = (ts, now)
        changed = fresh[v.name][1]
        stale = now - changed > 3 * (h.get("interval") or 1) + 2 and agent_state == ProcessState.RUNNING
        agent = f"{'STALE ' if stale else ''}{_age(changed, now)}"
    else:
        agent = agent_state or "-"
    zombies = {hp["name"]: hp.get("zombies") for hp in h.get("processes") or []}
    procs = []
    for p in v.processes:
        if p["name"] == "agent":
            continue
        seen = verdict.process(v.name, p["name"])
        s = seen.label if seen else p["state"]
        z = zombies.get(p["name"]) or p.get("zombies")
        behind = verdict.straggler(v.name, p["name"])
        procs.append(f"{p['name']} {s}{f'+{z}Z' if z else ''}{' ' + behind.mark if behind else ''}")
    return [v.name, _pct(host.get("cpu_percent")), _pct(host.get("mem_percent")), str(load), gpu, agent,
            ", ".join(procs) or ("no job" if not v.job_id else "-")]


def plain_state(snap: Snapshot) -> tuple:
    """What is a change for plain output: the job's state and notes, each node up or down,
    its agent's state, each process's state and which ranks are stragglers. Not CPU, memory, load,
    steps, rates or ages."""
    verdict = snap.verdict
    nodes = []
    for v in snap.nodes:
        procs = []
        for p in v.processes:
            seen = verdict.process(v.name, p["name"])
            procs.append((p["name"], seen.label if seen else p["state"]))
        nodes.append((v.name, v.up, v.down, v.agent_state(), tuple(procs)))
    return (snap.job_id, verdict.state, verdict.restarts, tuple(verdict.notes), tuple(nodes),
            tuple((s.node, s.name) for s in verdict.stragglers))


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def watch(session: Session, interval: float = 1.0, timeout: float | None = None, job_id: str | None = None,
          out: TextIO | None = None, tty: bool | None = None,
          scheduler_line: Callable[[Snapshot], str | None] | None = None) -> int:
    """Follow the job until it ends; its exit code. `scheduler_line` (snapshot -> a line): the scheduler's
    own word on the job (fabtrain.slurm.jobs.ShownLine), shown under the job's line; while its `waiting` is
    true (the scheduler's job has not ended), no job on any node is a job still to come, not a mistake."""
    out = out or sys.stdout
    tty = out.isatty() if tty is None else tty
    col = Collector(session, job_id=job_id)
    began = time.time()
    seen: set = set()
    fresh: dict = {}
    drawn = 0
    last_plain: tuple = ((), 0.0)
    while True:
        t0 = time.time()
        col.poll()
        now = time.time()
        snap = col.snapshot()
        verdict = snap.verdict
        scheduler = scheduler_line(snap) if scheduler_line else None
        none_here = all(n.up for n in snap.nodes) and not any(n.job_id for n in snap.nodes) and \
            not (scheduler_line and scheduler_line.waiting)
        if job_id and none_here:
            raise no_job(job_id)  # not "starting": it never will
        new = []
        for ev in reversed(snap.events):  # oldest first
            key = (ev.get("ts"), ev["node"], ev["kind"], ev.get("name"), ev.get("pid"), ev.get("reason"))
            if key not in seen:
                seen.add(key)
                new.append(ev)
        lines = frame(snap, now, began, fresh, scheduler)
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
            summary = (plain_state(snap), scheduler)
            if summary != last_plain[0] or now - last_plain[1] >= PLAIN_EVERY or verdict.ended:
                out.write("\n".join(lines) + "\n")
                last_plain = (summary, now)
        out.flush()
        if verdict.ended:
            if verdict.unreachable:
                out.write(f"note: {', '.join(verdict.unreachable)} unreachable: not seen how it ended there "
                          "(its agent tears down by itself)\n")
            why = verdict.summary()
            out.write(f"job {snap.job_id}: {verdict.state}{' (' + why + ')' if why else ''}\n")
            out.flush()
            return verdict.exit_code
        # Every node answered and none has the job (none yet, or not the --job asked for).
        if none_here and now - began > 5 * interval:
            raise no_job(job_id)
        if timeout is not None and now - began >= timeout:
            where = f"not on any node yet ({scheduler})" if scheduler and not any(n.job_id for n in snap.nodes) \
                else verdict.state
            out.write(f"watch: timed out after {timeout:g} s; the job is {where}\n")
            out.flush()
            return EXIT_TIMEOUT
        time.sleep(max(0.0, interval - (time.time() - t0)))
