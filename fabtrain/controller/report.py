"""Turning task results into what the terminal shows: tables and one-liners."""
from __future__ import annotations

import time

from fabtrain.controller import checkpoints, records
from fabtrain.controller.jobstate import NodeObservation, Verdict, job_verdict, observe_status
from fabtrain.controller.lifecycle import NodeCheck, StartResult
from fabtrain.controller.preflight import Bandwidth, NetworkCheck
from fabtrain.contract.events import ROUTINE
from fabtrain.contract.states import LIVE, JobState, ProcessState, stopped_by
from fabtrain.plan.plan import IFACE_VARS, Plan, render_shell, render_start
from fabtrain.contract.opreplies import Listened, Reached, Status
from fabtrain.contract.replies import JOB_RUNNING, running_job
from fabtrain.contract import gpus as gpu_words
from fabtrain.controller.verdict_text import sentence
from fabtrain.controller.terminal import visible
from fabtrain.remote.transport import Reply, down_label


def failed_line(r: Reply) -> str:
    """`node: FAILED: why`, the node named once (a node's error already begins with its name)."""
    why = r.error or "failed"
    return f"{r.node}: FAILED: {why[len(r.node) + 2:] if why.startswith(f'{r.node}: ') else why}"


def table(rows: list[list[str]], header: list[str]) -> str:
    rows = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_text(plan: Plan, notes: list[str] = (), asked: bool = True) -> str:
    """What `fab plan` prints; `asked`: the nodes were asked which ports are free (not --offline)."""
    out = [f"# job {plan.job_id} on cluster {plan.cluster}: mode {plan.mode}, sgd {plan.sgd}"]
    if plan.pserver_endpoints:
        out.append(f"# pservers: {','.join(plan.pserver_endpoints)}")
    out.append(f"# master (trainer 0): {plan.master}")
    auto_note = "  (auto: free now; a start chooses again)" if asked else "  (auto: picked without asking the nodes; a start chooses among the free ones)"
    out.append(f"# {ports_text(plan.ports, plan.auto_ports)}" + (auto_note if plan.auto_ports else ""))
    out += [f"# note: {n}" for n in notes]
    for n in plan.nodes:
        out.append("")
        out.append(f"## node {n.node} ({n.host}), workspace {n.workspace}")
        if n.spare:
            out.append("# spare: its agent starts these only in a lost trainer node's slot, renumbered into it")
        if not n.processes:
            out.append("# (nothing to run)")
            continue
        out.append(f"WS={n.workspace}")
        for p in n.processes:
            out.append(f"# {p.name}")
            out.append(render_shell(p))
        if plan.watchdog.get("enabled"):
            agent = plan.agent_process(n.node)
            out.append("# agent (the watchdog; runs from fabtrain's runtime, shipped by fab deploy)")
            out.append(render_start(agent["env"], agent["launch"], agent["cwd"], agent["log"]))
    return "\n".join(out)


def ports_text(ports: dict, auto=(), drawn=()) -> str:
    """ports: master_port 29500, pserver_port 23017 (auto), watchdog_port 7180; an `auto` one of None is
    drawn where the controller does not see it (in a Slurm allocation), one in `drawn` was drawn there."""
    def said(k, v):
        if v is None:
            return f"{k} auto (drawn in the allocation)"
        return f"{k} {v}" + (" (auto, drawn in the allocation)" if k in drawn else " (auto)" if k in auto else "")
    shown = [said(k, v) for k, v in ports.items() if v is not None or k in auto]
    return "ports: " + ", ".join(shown)


def _listen_cell(entries: list[Listened]) -> str:
    marks = {"ok": "ok", "taken": "TAKEN", "error": "ERROR"}
    return ", ".join(f"{e.port} {marks.get(e.state, e.state)}" for e in entries) or "-"


def _reach_cell(targets: list[Reached]) -> str:
    if not targets:
        return "-"
    ok = [t for t in targets if t.state == "ok"]
    ways = sorted({f"{t.iface or '?'} {t.local}" for t in ok})
    bad = {}
    for t in targets:
        if t.state != "ok":
            bad[t.state] = bad.get(t.state, 0) + 1
    text = f"{len(ok)}/{len(targets)}" + (f" via {', '.join(ways)}" if ways else "")
    return text + "".join(f", {n} {state}" for state, n in sorted(bad.items()))


def network_text(check: NetworkCheck, cluster) -> str:
    """fab check's network section: one row per node, then one line per problem."""
    env = dict(cluster.job.env)
    rows = []
    for node in cluster.nodes:
        r = check.replies.get(node.name)
        if r is None or not r.ok:
            rows.append([node.name, node.address, "", "", "", down_label(r.kind if r else None)])
            continue
        v = r.value
        pinned = [env[var] + f" ({var} in job.env)" for var in IFACE_VARS if var in env][:1]
        iface = pinned[0] if pinned else node.iface + " (iface:)" if node.iface else v.iface or "?"
        if v.speed:
            iface += f" {v.speed}Mb/s"
        address = node.address + ("" if v.address_local else " (not here)")
        state = "PROBLEM" if any(p.startswith(f"{node.name}:") or p.startswith(f"{node.name} ") for p in check.problems) else "ok"
        rows.append([node.name, address, iface, _listen_cell(v.listen), _reach_cell(v.reach), state])
    out = [ports_text(check.network.ports, check.network.auto),
           table(rows, ["node", "address", "interface", "listens", "reached", "state"])]
    out += [f"note: {n}" for n in check.notes]
    out += check.problems
    return "\n".join(out)


def bandwidth_text(bw: Bandwidth) -> str:
    """fab check --bandwidth: bus bandwidth, the slowest node, and what the links promise."""
    out = [f"bandwidth: all-reduce of {human_bytes(bw.bytes)} over {len(bw.nodes)} nodes ({bw.backend}, met at {bw.rendezvous}): "
           f"bus {bw.bus_gbps:.2f} Gb/s ({bw.bus_gbps / 8:.2f} GB/s), {bw.seconds * 1000:.1f} ms each"]
    if bw.slowest:
        node, gbps = bw.slowest
        out.append(f"slowest node: {node} (its link to the next node: {gbps:.2f} Gb/s)")
    if bw.promised_mbps:
        share = bw.bus_gbps * 1000 / bw.promised_mbps
        out.append(f"the slowest interface promises {bw.promised_mbps} Mb/s: the bus gets {share:.0%} of it")
    else:
        out.append("the interfaces do not say their speed (loopback and most virtual links): nothing to compare with")
    return "\n".join(out)


def code_text(code: dict | None) -> str:
    """Which code a job runs, as `fab deploy`/`fab status` say it: a commit (+dirty) or a hash."""
    code = code if isinstance(code, dict) else {}  # from the node: untrusted
    if code.get("commit") and isinstance(code["commit"], str):
        return code["commit"][:12] + ("+dirty" if code.get("dirty") is True else "")
    return f"hash {code['hash'][:64]}" if code.get("hash") and isinstance(code["hash"], str) else "unknown"


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
        if p is None:
            rows.append([c.node, down_label(c.down), "", "", "", "", "", "", ""])
            continue
        differs = set(c.differs)

        def flag(key, text):
            return f"{text} (!)" if key in differs else text
        lo, hi = c.clock_offset
        clock = "0 (this machine)" if lo == hi == 0 else f"±{(hi - lo) / 2:.2f}s" if lo <= 0 <= hi \
            else f"{(lo + hi) / 2:+.2f}s"
        rows.append([c.node, "ok" if c.ok else "PROBLEM", flag("python", p.python),
                     flag("torch", p.torch or "-"), flag("cuda", p.cuda or "-") + f" gpus={p.gpus}",
                     flag("paddle", p.paddle or "-"), p.psutil or "-",
                     human_bytes(p.disk_free), clock])
    out = [table(rows, ["node", "state", "python", "torch", "cuda", "paddle", "psutil", "disk free", "clock"])]
    for c in checks:
        for problem in c.problems:
            out.append(f"{c.node}: {problem}" if not problem.startswith(c.node) else problem)
    for c in checks:
        inventory = c.probe.gpu_inventory if c.probe else None
        if inventory and (inventory["gpus"] or inventory["source"] == "stand-in"):
            out.extend(f"{c.node}: {line}" for line in gpu_words.describe(inventory))
    if any(c.differs for c in checks):
        out.append("(!) differs across nodes")
    return "\n".join(out)


def force_text(stopped: list[Reply]) -> str:
    """What `--force` stopped before the start: the job(s) it killed, per node."""
    jobs = sorted({k.job_id for r in stopped if r.ok for k in r.value.killed})
    head = f"--force: stopped job {', '.join(jobs)} first" if jobs else "--force: no job was running"
    text, _ = kill_text(stopped)
    return head + ("\n" + text if jobs or not all(r.ok for r in stopped) else "")


def running_here(r: Reply) -> tuple[str, list[str]] | None:
    """(the job, its processes) where a node refused a start because another job runs there; else None."""
    return running_job(r.detail) if not r.ok and r.code == JOB_RUNNING else None


def running_refusal(result: StartResult) -> str | None:
    """When nothing started because another job runs: one line naming it, else None."""
    if any(r.ok and r.value.started for r in result.replies):
        return None
    running: dict[str, list[str]] = {}
    for r in result.replies:
        job = running_here(r)
        if job:
            running.setdefault(job[0], []).append(f"{r.node}: {', '.join(job[1])}")
    if not running:
        return None
    jobs = ", ".join(f"job {job} is running ({'; '.join(where)})" for job, where in sorted(running.items()))
    return (f"nothing was started: {jobs}; `fab kill-all` stops it, "
            f"or --force stops it and then starts a new job")


def start_text(result: StartResult, roles: tuple[str, ...]) -> str:
    out = []
    for r in result.replies:
        if not r.ok:
            out.append(failed_line(r))
            continue
        names = ", ".join(f"{s.name} (pid {s.pid})" for s in r.value.started)
        out.append(f"{r.node}: started {names}")
        for f in r.value.failed:
            out.append(f"{r.node}: {f.name} exited at once with code {f.exit_code}: {visible(' | '.join(f.log))}")
        for w in r.value.warnings:
            out.append(f"{r.node}: warning: {w}")
    if result.complete:
        out.append(f"job {result.job_id}: {' and '.join(roles)} started; "
                   f"{ports_text(result.plan.ports, result.plan.auto_ports)}")
        return "\n".join(out)
    out.append(f"job {result.job_id}: {' and '.join(roles)} NOT started on every node (see above)")
    if result.undone is not None:  # all or nothing: what had started is stopped
        text, clean = kill_text(result.undone)
        out += [f"stopping job {result.job_id} on every node: {visible(result.why)}", text]
        if clean:
            out.append(f"job {result.job_id}: nothing of it is left running")
    return "\n".join(out)


def _ago(ts: float | None, now: float) -> str:
    if not isinstance(ts, (int, float)):
        return ""
    d = max(0.0, now - ts)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago"


def _process_rows(obs: NodeObservation, verdict: Verdict, now: float) -> list[list[str]]:
    """One row per process: the job's view of its state, and what its agent sees while the agent
    runs (a gone agent's last snapshot says nothing about now: its columns stay empty)."""
    agent_alive = any(p["name"] == "agent" and p["state"] in LIVE for p in obs.processes)
    seen = {p["name"]: p for p in (obs.agent or {}).get("processes") or []} if agent_alive else {}
    rows = []
    for p in obs.processes:
        view = verdict.process(obs.name, p["name"])
        state = view.label if view else p["state"]
        if p.get("zombies"):
            state += f" +{p['zombies']} zombie"
        if p.get("left_behind"):
            state += f" +{p['left_behind']} left behind"
        uptime = f"{p['uptime']:.0f}s" if p.get("uptime") else ""
        a = seen.get(p["name"], {})
        agent_state = a.get("state", "")
        if a.get("hung"):
            agent_state += " HUNG"
        if a.get("killed_by_agent"):
            agent_state += " (by agent)"
        behind = verdict.straggler(obs.name, p["name"])
        if behind:
            agent_state += " " + behind.mark
        ended = p["state"] not in LIVE
        progress = _ago(a.get("last_progress"), now) if a and not ended and a.get("state") not in ("exited", "killed") else ""
        rows.append([obs.name, p["name"], state, uptime, agent_state, progress,
                     visible(p.get("last_line") or "")[:70]])
    return rows


def _node_notes(obs: NodeObservation, value: Status, now: float) -> tuple[list[str], bool]:
    """What `fab status` flags on one node (stale or missing agent, zombies, orphans, lost peers,
    the last event), and whether it is a problem (exit 1)."""
    notes, problem = [], False
    h = obs.agent or {}
    if obs.killed:
        how = "stopped because its start failed (all or nothing)" if obs.stop_reason else stopped_by(obs.killed_by)
        notes.append(f"{obs.name}: job {obs.job_id} was {how}")
    agent = next((p for p in obs.processes if p["name"] == "agent"), None)
    live = [p["name"] for p in obs.processes if p["name"] != "agent" and p["state"] in LIVE]
    interval = h.get("interval") or 1.0
    health_ts = h.get("ts") or value.health_ts
    if agent and agent["state"] == ProcessState.RUNNING and health_ts and now - health_ts > max(10.0, 3 * interval + 2):
        notes.append(f"{obs.name}: STALE agent heartbeat: health.json is {now - health_ts:.0f}s old (interval {interval:g}s)")
        problem = True
    if live and (agent is None or agent["state"] not in (ProcessState.RUNNING, ProcessState.SLEEPING, ProcessState.STOPPED)):
        notes.append(f"{obs.name}: NO WATCHDOG: the agent is not running while {', '.join(live)} run(s) here"
                     " (fab kill-all stops them)")
    # The agent counts a zombie once defunct ZOMBIE_MIN_AGE (a busy parent reaps late); node ops' own
    # count, a single look, only where no agent reports.
    zombies = sum(p.get("zombies") or 0 for p in h.get("processes") or []) if h else \
        sum(p.get("zombies") or 0 for p in obs.processes)
    if zombies:
        notes.append(f"{obs.name}: {zombies} ZOMBIE process(es): defunct children not reaped by their parent")
    for p in obs.processes:
        if p.get("reason"):  # an end no exit code says (node ops: its launcher died without one)
            notes.append(f"{obs.name}: {p['name']}: {visible(p['reason'])}")
    for o in h.get("orphans") or []:
        notes.append(f"{obs.name}: ORPHAN pid {o.get('pid')} ({o.get('name')}): {o.get('reason')}; being killed")
    coord = h.get("coordinator") or {}
    if isinstance(coord.get("term"), int) and coord["term"] > 1 and coord.get("node"):  # a job that elects
        notes.append(f"{obs.name}: coordinator now on {coord['node']} (term {coord['term']})")
    for lost in (h.get("coordinator") or {}).get("lost") or []:
        notes.append(f"{obs.name}: the agents lost contact with node {lost}")
    events = [e for e in h.get("events") or [] if e["kind"] not in ROUTINE]
    ev = events[-1] if events else _last_event(value)
    if ev:
        who = ev.get("name") or (f"{ev.get('role')}-{ev.get('rank')}" if ev.get("role") is not None else "")
        notes.append(f"{obs.name}: last event: {ev['kind']}{' ' + who if who else ''}: {visible(ev.get('reason', ''))}"
                     f" ({_ago(ev.get('ts'), now)})")
    return notes, problem


def _last_event(value: Status) -> dict | None:
    try:
        return records.event_record(value.last_event) if value.last_event is not None else None
    except records.Malformed:
        return None


def status_text(replies: list[Reply]) -> tuple[str, bool]:
    """The status table, and whether something is wrong (exit 1).

    The job's state is `job_verdict`'s, as in `fab watch` and the dashboard.
    Each process shows that state, uptime and last log line, and what the
    node's agent (watchdog) sees: its state there and when it last made
    progress. Notes flag zombies, orphans, stale or missing agents. Wrong:
    the job failed, a node is unreachable, or an agent's heartbeat is stale.
    """
    observations = [observe_status(r) for r in replies]
    verdict = job_verdict(observations)
    rows, notes, problem = [], [], verdict.state == JobState.FAILED
    saved: list = []  # (node, health.json, its time): each trainer's last checkpoint (controller/checkpoints.py)
    for r, obs in zip(replies, observations):
        if not r.ok:
            rows.append([r.node, "-", down_label(r.kind), "", "", "", ""])
            notes.append(r.error)
            problem = True
            continue
        if not obs.job_id:
            rows.append([r.node, "-", "no job", "", "", "", ""])
            continue
        node_time = r.value.time
        now = node_time if node_time is not None else time.time()  # health.json's times are the node's
        rows += _process_rows(obs, verdict, now)
        saved.append((obs.name, obs.agent, now))
        more, wrong = _node_notes(obs, r.value, now)
        notes += more
        problem |= wrong
    job_ids = sorted({o.job_id for o in observations if o.job_id})
    head = f"job {', '.join(job_ids) or '-'}: {verdict.state}" + (f" ({verdict.restarts})" if verdict.restarts else "")
    codes = {code_text(r.value.code) for r in replies if r.ok and r.value.job_id}
    if codes:
        head += f"  code {', '.join(sorted(codes))}"  # more than one: nodes run different code
    times = [r.value.time for r in replies if r.ok and r.value.time is not None]
    said = sentence(verdict, max(times, default=time.time()))  # the words of the dashboard's banner
    healths = [(o.name, o.agent) for o in observations if o.job_id]
    saved = [visible(line) for line in checkpoints.resumed_lines(healths) + checkpoints.health_lines(saved)] + \
        [line for line in [checkpoints.none_yet(healths)] if line and verdict.state == JobState.RUNNING]
    return "\n".join([head, table(rows, ["node", "process", "state", "uptime", "agent", "progress", "last log line"]),
                      said, *verdict.notes, *saved, *notes]), problem


def kill_text(replies: list[Reply]) -> tuple[str, bool]:
    out, clean = [], True
    for r in replies:
        if not r.ok:
            out.append(failed_line(r))
            clean = False
            continue
        killed = r.value.killed
        if killed:
            what = ", ".join(f"{k.name}{' child' if k.child else ''} pid {k.pid} ({k.signal}{', orphan' if k.orphan else ''})"
                             for k in killed)
            out.append(f"{r.node}: killed {what}")
        else:
            out.append(f"{r.node}: nothing running")
        for record in r.value.untrusted:
            out.append(f"{r.node}: ignored run record {record}: not a process of this workspace's jobs")
        if r.value.left:
            out.append(f"{r.node}: STILL ALIVE: pids {', '.join(map(str, r.value.left))}")
            clean = False
    return "\n".join(out), clean


# -- what a Backend's verbs returned (fabtrain/backends/results.py), as fab says it -------------------


def replies_text(replies: list[Reply], ok_text) -> tuple[str, bool]:
    """A line a node: ok_text(its value), or why it failed; and whether one failed."""
    lines = [f"{r.node}: {ok_text(r.value)}" if r.ok else failed_line(r) for r in replies]
    return "\n".join(lines), any(not r.ok for r in replies)


def planned_text(planned) -> str:
    """fab plan: the place's own file as it is (it ends its own last line), else the plan's commands."""
    if planned.script is not None:
        return planned.script
    return plan_text(planned.plan, planned.notes, asked=planned.asked) + "\n"


def checked_text(checked, cluster) -> str:
    parts = [check_text(checked.nodes) + "\n"]
    if checked.network is not None:
        parts.append(network_text(checked.network, cluster))
    if checked.bandwidth is not None:
        problems = checked.bandwidth.problems
        parts.append("\n".join(problems) if problems else bandwidth_text(checked.bandwidth))
    return "\n".join(parts + checked.place)


def started_lines(started) -> list[str]:
    """What fab says of a start fab made on the nodes itself (a place that is given the job said it as it went)."""
    result = started.result
    if result is None:
        return []
    lines = [force_text(result.stopped)] if started.forced else []
    if started.refused:  # the nodes that said something else than "a job runs here"
        return lines + [failed_line(r) for r in result.replies if not r.ok and not running_here(r)]
    return lines + [start_text(result, started.roles)]


def job_status_text(shown) -> tuple[str, bool]:
    """fab status of a JobStatus: the table, the ports, the place's word; and whether something is wrong."""
    if shown.waiting:
        return shown.waiting, False
    if shown.pods is not None:
        return shown.pods, shown.pods_failed
    text, failed = status_text(shown.replies)
    parts = [text]
    if shown.ports:
        chosen, auto, drawn = shown.ports
        parts.append(ports_text(chosen, auto, drawn=drawn))
    return "\n".join(parts + shown.place), failed


def stopped_text(stopped) -> str:
    """fab kill-all of a Stopped: each node's kill, then the place's word."""
    parts = [kill_text(stopped.replies)[0]] if stopped.replies else []
    return "\n".join(parts + stopped.place)
