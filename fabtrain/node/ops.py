"""What fabtrain does ON a node: probe, provision, start, status, logs, kill, verify, collect.

The controller sends this package to the node with every call
(fabtrain.remote.rpc) and fabtrain.node.serve runs the op the request
names, so it needs no deployed code, only the Python standard library
(3.8+). That is what lets ``fab kill-all`` work on a node whose code
directory is gone, and ``fab check`` before anything was deployed. An op
takes the request's payload and returns what goes back as the reply; it
raises UserFacing for a refusal the user should read as one line.

Every node-side call imports this module, so what only some ops need
(hashlib, shutil, the GPU inventory; `fab check`'s probe is a module of its
own) is imported in those ops: `fab status` on 64 nodes pays each import 64 times.
"""
import json
import os
import signal
import sys
import time

from fabtrain.contract.launcher import SCRIPT, is_launcher
from fabtrain.node import atomic, gpulease, launch, procfs, progress, runtime
from fabtrain.node.elsewhere import elsewhere, running_elsewhere, states_from_health
from fabtrain.node.kill import family, send, starter, stop_all, trusted
from fabtrain.node.killevents import append_events, write_kill_events
from fabtrain.contract import opreplies, records as fields
from fabtrain.contract.opreplies import (Chunk, Collect, Killed, Kill, Logs, NotStarted, Start, Started, Status, Verify,
                                        kept)
from fabtrain.contract.replies import COORDINATOR_LISTENS, UserFacing, job_running
from fabtrain.node.workspace import (check_workspace, claim_workspace, code_refusal, job_dir, make_private_dirs,
                                     snapshot_code, workspace)
from fabtrain.node.spawn import expand, name_programs, program_of, spawn
from fabtrain.contract.events import EventKind, read_events
from fabtrain.contract.states import (KILLERS, START_FAILED, STOP_GRACE, ProcessState, killed_marker, read_marker,
                                      signal_name, signal_of, state_of)
from fabtrain.contract.jobfolder import EVENTS, JOBS, METRICS, JobFolder

PROGRAM_WAIT = 3.0  # seconds a start waits for each launcher to fork its program


# -- small helpers ------------------------------------------------------------------


def tail_lines(path, n, max_bytes=65536):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n:] if n > 0 else []


def run_records(jd):
    """(name, record) of every run record in a job directory."""
    run_dir = JobFolder(jd).run
    out = []
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        if name.endswith(".json"):
            record = atomic.read_json(os.path.join(run_dir, name))
            if isinstance(record, dict) and isinstance(record.get("pid"), int):
                out.append((name[:-5], record))
    return out


# -- process state -----------------------------------------------------------------


def process_record(jd, name, procs, kids):
    """One job process as node ops' status reports it: its run record, whether it lives, how it ended."""
    run = atomic.read_json(JobFolder(jd).run_record(name))
    if not isinstance(run, dict) or "pid" not in run:
        return {"state": str(ProcessState.NOT_STARTED)}
    launcher, ctime = run["pid"], run.get("create_time")
    info = {"pid": run.get("program_pid") or launcher, "launcher_pid": launcher,
            "started_at": run.get("started_at"), "uptime": None}
    code = launch.read_exit(JobFolder(jd).exit_record(name))
    alive = procfs.alive(launcher, ctime, procs)
    if code is not None:
        info.update(state=str(state_of(False, exit_code=code)), exit_code=code, signal=signal_name(signal_of(code)))
        left = family(run, procs, kids) if alive else []
        if left:
            info["left_behind"] = len(left)  # still under its launcher; the agent or kill-all ends them
        return info
    if alive:
        program = program_of(run, procs, kids)
        main = procs.get(program) or procs[launcher]
        info.update(state=str(state_of(True, main.state)), uptime=time.time() - ctime, program_pid=program,
                    pid=program or launcher)
        zombies = [k for k in kids.get(program, ()) if k in procs and procs[k].dead] if program else []
        if zombies:
            info["zombies"] = len(zombies)
        return info
    info.update(state=str(state_of(False, before_boot=(ctime or 0) < procfs.BOOT_TIME)), exit_code=None,
                reason="its launcher (pid %d) died without recording an exit code" % launcher)
    return info


# -- operations --------------------------------------------------------------------


def live_job_processes(jd, procs=None):
    """Names of a job's processes whose launcher is still alive (procs: a table to look in; else each is read)."""
    return [name for name, run in run_records(jd) if procfs.alive(run["pid"], run.get("create_time"), procs)]


def hosts_coordinator(job):
    """This node runs the job's coordinator (the agent of the plan's first node)."""
    return (job.get("nodes") or [{}])[0].get("name") == job["node"]


def start_agent(agent, jd, ws, base_env, leases=()):
    """Start the agent: (its Popen, its run record, where events.jsonl ended before it: what
    await_coordinator reads from)."""
    events = JobFolder(jd).events
    offset = os.path.getsize(events) if os.path.exists(events) else 0
    p, record = spawn(agent, ws, base_env, leases=leases)
    return p, record, offset


def await_coordinator(p, offset, agent, job, jd, ws, warnings, tell_listening=False):
    """On the node that hosts the coordinator, until the agent holds its port (then, if tell_listening,
    print COORDINATOR_LISTENS: node ops' streamed line to the controller). Agents refuse a coordinator
    that cannot prove the job's secret, so a job whose coordinator cannot listen (another program on
    job.watchdog.port) has none: UserFacing, the agent's reason."""
    events = JobFolder(jd).events
    deadline = time.time() + 15
    while time.time() < deadline:
        kinds = {ev.get("kind"): ev.get("reason") for ev in read_events(events, offset)}
        if EventKind.AGENT_STARTED in kinds:
            if tell_listening:  # before the reply: the controller starts the other nodes on it, while
                # this start goes on with the node's own processes and their settle time
                sys.stdout.write(COORDINATOR_LISTENS + "\n")
                sys.stdout.flush()
            return
        if p.poll() is not None:
            raise UserFacing(kinds.get(EventKind.COORDINATOR_ERROR) or "the agent exited at once with code %s: %s" % (
                p.returncode, " | ".join(tail_lines(expand(agent["log"], ws), 3))))
        time.sleep(0.02)
    warnings.append("the agent has not started its coordinator within 15 s (see `fab status`)")


def _agent_first(payload, agent, job, jd, ws, base_env, leases, warnings):
    """Start the agent before the programs: (its Popen, its run record, what to await its coordinator with
    once the programs started, or None)."""
    runtime.install(expand(agent["cwd"], ws))  # a job never runs without its agent: no deploy needed
    p, record, offset = start_agent(agent, jd, ws, base_env, leases)
    if not hosts_coordinator(job):
        return p, record, None
    if payload.get("together"):
        return p, record, (p, offset)
    # The controller starts the other nodes once it listens: on the coordinator's node the programs
    # start after it too, so a job without a coordinator starts nowhere.
    try:
        await_coordinator(p, offset, agent, job, jd, ws, warnings, payload.get("tell_listening", False))
    except UserFacing as e:
        raise UserFacing("%s; nothing of job %s was started here" % (e, job["job_id"]))
    return p, record, None


def op_start(payload):
    job = payload["job"]
    ws = workspace(job)
    # Logs, metrics, events, health and run records: this user's only (the programs inherit the umask).
    os.umask(0o077)
    jd = job_dir(ws, job["job_id"])  # a bad id is refused before anything is made
    refusal = check_workspace(ws) or claim_workspace(ws, job["cluster"], job["node"])
    if refusal:
        raise UserFacing(refusal)
    refusal = code_refusal(ws, jd)
    if refusal:
        raise UserFacing("%s; nothing of job %s was started here" % (refusal, job["job_id"]))

    # Refuse to start over a running job unless told (`--force` kills it first on the controller side),
    # before anything of the new job exists here. Each record's launcher is read alone, not a scan of
    # /proc: every node of a start does this at once, and a scan's CPU is what the start itself needs.
    jobs_root = os.path.join(ws, JOBS)
    for other in sorted(os.listdir(jobs_root)) if os.path.isdir(jobs_root) else []:
        if other != job["job_id"]:
            live = live_job_processes(os.path.join(jobs_root, other))
            if live:
                raise job_running(other, live)
    # The job's GPUs here: leased by its first start on this node, before anything of it runs.
    from fabtrain.node import gpustart

    leases, gpu_warnings = gpustart.take(job, atomic.read_json(JobFolder(jd).job_json))
    try:
        return _start_leased(payload, job, ws, jd, leases, gpu_warnings)
    finally:
        gpulease.release(leases)  # the job's processes hold their own descriptors


def _start_leased(payload, job, ws, jd, leases, warnings):
    folder = JobFolder(jd)
    make_private_dirs(ws, os.path.join(ws, JOBS), jd, folder.logs, folder.run, folder.metrics)
    roles = set(payload["roles"])
    # A rank that mpirun starts is not started here; mpirun itself starts with the trainers.
    wanted = [p for p in job["processes"] if p.get("starts_with", p["role"]) in roles and not p.get("started_by")]
    already = set(live_job_processes(jd))
    for p in wanted:
        if p["name"] in already:
            raise UserFacing("%s of job %s is already running here" % (p["name"], job["job_id"]))

    job["code"] = snapshot_code(ws, jd)
    # This node's part of the job: the same while anything of it runs here (a start of another role, an
    # agent its keeper restarts), a new one once nothing did (a replacement pod): the coordinator tells
    # a node's part started again from the part it knew going on (board.py, `part`).
    earlier = atomic.read_json(JobFolder(jd).job_json) if already else None
    job["part"] = (earlier or {}).get("part") or os.urandom(8).hex()
    # 0600: it holds the coordinator's secret.
    for rel, text in sorted(job.get("files", {}).items()):  # mpirun's hostfile and ssh config
        make_private_dirs(os.path.dirname(os.path.join(jd, rel)))
        atomic.write(os.path.join(jd, rel), text)
    atomic.write(JobFolder(jd).job_json, json.dumps(job, indent=1))
    # The progress hook beside the launcher's sitecustomize.py (which loads it), before launch.py:
    # a rank mpirun starts waits for launch.py, so it finds both.
    hook = launch.hook_dir(jd)
    make_private_dirs(os.path.dirname(hook), hook)
    for name, text in progress.sources().items():
        atomic.write(os.path.join(hook, name), text)
    atomic.write(os.path.join(jd, SCRIPT), launch.source())
    tmp_link = os.path.join(ws, ".current.%d" % os.getpid())
    os.symlink(os.path.join(JOBS, job["job_id"]), tmp_link)
    os.replace(tmp_link, os.path.join(ws, "current"))

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FABTRAIN_")}
    started, failed, by_name = [], [], {}
    agent = payload.get("agent")
    fds = tuple(leases.values())
    coordinator = None  # the agent whose coordinator is awaited after the programs started (together)
    if agent and "agent" not in already:
        by_name[agent["name"]] = agent
        p, record, coordinator = _agent_first(payload, agent, job, jd, ws, base_env, fds, warnings)
        started.append((p, record))
    for proc in wanted:
        by_name[proc["name"]] = proc
        try:
            started.append(spawn(proc, ws, base_env, leases=fds))
        except OSError as e:
            failed.append(NotStarted(name=proc["name"], exit_code=127,
                                     log=["cannot start %s: %s" % (proc["launch"][0], e.strerror)]))
    if coordinator:
        # "together" (a hosted platform: a Slurm step, a pod): every node starts at once, the other nodes'
        # programs without waiting for this one's coordinator, so this node's do not wait either (the
        # agent's start is then off the path to the first step). Without a coordinator the job cannot
        # run: what started here is stopped as a failed start, and the platform's step fails.
        try:
            await_coordinator(*coordinator, agent, job, jd, ws, warnings)
        except UserFacing as e:
            op_kill({"workspace": ws, "job_id": job["job_id"], "by": START_FAILED, "reason": str(e),
                     "node": job["node"], "grace": float(job["watchdog"].get("grace", STOP_GRACE))})
            raise UserFacing("%s; what had started of job %s here was stopped" % (e, job["job_id"]))
    name_programs(started, ws, by_name, time.time() + PROGRAM_WAIT)

    # A program that cannot start (not found, bad flag) usually dies at once:
    # say so now rather than leave it for `fab status`.
    deadline = time.time() + payload.get("settle", 0.1)
    watching = list(started)
    while time.time() < deadline and watching:
        time.sleep(0.05)
        for p, record in list(watching):
            if p.poll() is not None:
                watching.remove((p, record))
                if p.returncode != 0:
                    failed.append(NotStarted(name=record["name"], exit_code=p.returncode,
                                             log=tail_lines(expand(by_name[record["name"]]["log"], ws), 3)))
    shown = [Started(name=r["name"], role=r["role"], rank=r["rank"], pid=r.get("program_pid") or r["pid"],
                     launcher_pid=r["pid"]) for _, r in started]
    return Start(job_dir=jd, started=shown, failed=failed, warnings=warnings).wire()


def op_status(payload):
    return job_status(payload).wire()


def job_status(payload):
    """The Status of the payload's job (the node's current one where none is named)."""
    ws = workspace(payload)
    jd = job_dir(ws, payload.get("job_id"))
    if not jd or not os.path.isdir(jd):
        return Status(processes=[])
    procs = procfs.below(record["pid"] for _, record in run_records(jd))  # the launchers and what they run
    kids = procfs.children_map(procs)
    job = atomic.read_json(JobFolder(jd).job_json, {})
    health = atomic.read_json(JobFolder(jd).health)
    if elsewhere(job):  # a Slurm node's records, read on the login node: its agent knows, not our /proc
        return status_reply(jd, job, states_from_health(job, health), health, payload)
    names = [p["name"] for p in job.get("processes", [])]
    if os.path.exists(JobFolder(jd).run_record("agent")):
        names.append("agent")
    out = []
    for name in names:
        info = process_record(jd, name, procs, kids)
        info["name"] = name
        info["last_line"] = (tail_lines(JobFolder(jd).log(name), 1) or [""])[0][-200:]
        out.append(fields.record(fields.STATUS_PROCESS, **info))
    return status_reply(jd, job, out, health, payload)


def status_reply(jd, job, processes, health, payload):
    events = tail_lines(JobFolder(jd).events, 1)
    try:
        last_event = json.loads(events[0]) if events else None
    except ValueError:
        last_event = None
    killed_by, stop_reason = read_marker(JobFolder(jd).killed)
    # What the job's files say goes into the reply only where it fits its field (else None): a file holds
    # whatever was written there, and a reply that does not fit its type is the whole node's failure.
    obj = opreplies.record
    health = kept(obj, health)
    return Status(job_id=os.path.basename(jd), processes=processes, killed=os.path.exists(JobFolder(jd).killed),
                  code=kept(obj, job.get("code")), slurm=kept(obj, job.get("slurm")),
                  killed_by=killed_by, stop_reason=stop_reason,
                  health_ts=kept(opreplies.number, health.get("ts")) if health else None,
                  health=health if payload.get("health") else None, last_event=kept(obj, last_event),
                  time=time.time())


def op_logs(payload):
    ws = workspace(payload)
    jd = job_dir(ws, payload.get("job_id"))
    if not jd or not os.path.isdir(jd):
        return Logs(job_id=None).wire()  # the controller says it once for every node: lifecycle.no_job
    node = payload["node"]
    if payload.get("stacks"):
        return print_stacks(jd, node)
    logs_dir = JobFolder(jd).logs
    names = sorted(f[:-4] for f in os.listdir(logs_dir) if f.endswith(".log"))
    offsets = {}
    for name in names:
        path = os.path.join(logs_dir, name + ".log")
        for line in tail_lines(path, payload.get("lines", 20)):
            sys.stdout.write("[%s %s] %s\n" % (node, name, line))
        offsets[name] = os.path.getsize(path)
    sys.stdout.flush()
    if not payload.get("follow"):
        return Logs(job_id=os.path.basename(jd)).wire()
    partial = {}
    while True:
        for name in names:
            path = os.path.join(logs_dir, name + ".log")
            with open(path, "rb") as f:
                f.seek(offsets[name])
                data = f.read()
            if not data:
                continue
            offsets[name] += len(data)
            data = partial.pop(name, b"") + data
            *lines, rest = data.split(b"\n")
            if rest:
                partial[name] = rest
            for line in lines:
                sys.stdout.write("[%s %s] %s\n" % (node, name, line.decode("utf-8", "replace")))
        sys.stdout.flush()
        if not live_job_processes(jd) and not running_elsewhere(jd):
            return Logs(job_id=os.path.basename(jd)).wire()
        time.sleep(0.2)


def print_stacks(jd, node):
    """The stacks the agent saved before a hang's teardown, prefixed [node name]: every process of a job
    process wrote its own (stacks/<name>.<pid>.txt, whose first line says its pid and rank); those that
    never dumped (empty files) are left out."""
    sdir = JobFolder(jd).stacks
    files = sorted(f for f in os.listdir(sdir) if f.endswith(".txt")) if os.path.isdir(sdir) else []
    names = []
    for f in files:
        path = os.path.join(sdir, f)
        try:
            if not os.path.getsize(path):
                continue
        except OSError:
            continue
        head, _, pid = f[:-4].rpartition(".")
        name = head if pid.isdigit() and head else f[:-4]
        names.append(name)
        for line in tail_lines(path, 10 ** 4, max_bytes=1 << 20):
            sys.stdout.write("[%s %s] %s\n" % (node, name, line))
    if not names:
        sys.stdout.write("[%s] no stacks saved (they are taken before a hang's teardown)\n" % node)
    sys.stdout.flush()
    return Logs(job_id=os.path.basename(jd)).wire()


def kill_targets(ws, records, skip, only=None, sweep=None, starters=()):
    """Everything of the workspace's jobs (of job `only`, if given) alive now: {pid: what it is}; launchers
    apart (they go by themselves). sweep: a procfs.Sweep to poll with (what it finds becomes its hot pids).
    starters: (job id, name, (pid, create time)) of the daemons that started job processes (kill.starter)."""
    procs = sweep.scan() if sweep else procfs.scan()
    kids = procfs.children_map(procs)
    found, launchers = {}, {}
    for job_id, name, (pid, ctime) in starters:
        if procfs.alive(pid, ctime, procs):
            found.setdefault(pid, {"job_id": job_id, "name": name, "pid": pid, "starter": True})
    for job_id, record in records:
        if not procfs.alive(record["pid"], record.get("create_time"), procs):
            continue
        desc = {"job_id": job_id, "name": record["name"], "pid": record["pid"]}
        argv = procfs.cmdline(record["pid"])
        # An empty command line is a launcher on its way out (the kernel has let go of its memory, not yet
        # of its pid): it is waited for as the launcher it is, never counted as a process this kill stopped.
        if not argv or is_launcher(argv):
            launchers[record["pid"]] = desc
        else:  # a record of something else than our launcher (an older fabtrain's wrapper): signal it
            found[record["pid"]] = desc
        program = program_of(record, procs, kids)
        for pid in family(record, procs, kids):
            found.setdefault(pid, {"job_id": job_id, "name": record["name"], "pid": pid, "child": pid != program})
    for pid in sweep.marked(procs, skip) if sweep else procfs.marked(ws, procs, skip):
        if pid in found or pid in launchers:
            continue
        env = procfs.environ(pid)
        job_id = env.get(b"FABTRAIN_JOB_ID", b"?").decode()
        if only is not None and job_id != only:
            continue
        name = "%s-%s" % (env.get(b"FABTRAIN_ROLE", b"?").decode(), env.get(b"FABTRAIN_RANK", b"?").decode())
        found[pid] = {"job_id": job_id, "pid": pid, "name": name, "orphan": True}
    if sweep:
        sweep.hot = set(found) | set(launchers) | {r["pid"] for _, r in records} | {s[2][0] for s in starters}
    return found, launchers


def op_kill(payload):
    """SIGTERM everything of every job in the workspace, grace, SIGKILL; launchers record the exit codes and go.

    "by" (one of states.KILLERS) is who stops it: the first line of each job's `killed` marker. With
    "job_id", only that job's processes; with "by" a failed start (all or nothing), "reason" says why:
    the marker's next line, and a `start_failed` event says it first. Otherwise "reason" words the
    `killed` events (default: who). "mark": false leaves the marker alone (a job the agents ended);
    "signal": false only marks (the controller marks every node before it stops any: a process that
    dies because another node's was stopped is then read as stopped, not as a failure of its own).
    """
    ws = workspace(payload)
    grace = float(payload.get("grace", STOP_GRACE))
    by = payload.get("by") if payload.get("by") in KILLERS else KILLERS[0]
    only, reason = payload.get("job_id"), payload.get("reason")
    jobs_root = os.path.join(ws, JOBS)
    procs = procfs.scan()
    skip = procfs.ancestors()
    records, untrusted, starters = [], [], []
    for job_id in sorted(os.listdir(jobs_root)) if os.path.isdir(jobs_root) else []:
        if only is not None and job_id != only:
            continue
        for name, record in run_records(os.path.join(jobs_root, job_id)):
            daemon = starter(record, procs)  # Open MPI's orted: it outlives a job whose mpirun died badly
            if daemon and daemon[0] not in skip and daemon not in [s[2] for s in starters]:
                starters.append((job_id, name, daemon))
            if trusted(record, procs, ws):
                records.append((job_id, record))
            elif procfs.alive(record["pid"], record.get("create_time"), procs) and record["pid"] not in skip:
                # A live process that is not ours (no job marker, or not leading its group): never signalled.
                untrusted.append("jobs/%s/run/%s.json (pid %d)" % (job_id, name, record["pid"]))
    described, sweep = {}, procfs.Sweep(ws, procs=procs)

    def find():
        found, _ = kill_targets(ws, records, skip, only, sweep, starters)
        if not found:  # the cheap view's "all gone" is checked by a full scan before the stop ends
            found, _ = kill_targets(ws, records, skip, only, starters=starters)
        for pid, desc in found.items():  # as first seen: a child whose program is gone later reads as an orphan
            described.setdefault(pid, desc)
        return list(found)

    def launchers_left():  # the sweep's view; "none" is checked by a full scan
        return kill_targets(ws, records, skip, only, sweep)[1] or kill_targets(ws, records, skip, only)[1]

    first, _ = kill_targets(ws, records, skip, only, sweep, starters)
    touched = {d["job_id"] for d in first.values()} | {job_id for job_id, _ in records}
    if only is not None and only in (os.listdir(jobs_root) if os.path.isdir(jobs_root) else ()):
        touched.add(only)  # a name found in jobs/, never a path the payload made up
    for job_id in touched if payload.get("mark", True) else ():  # not for a job whose agents already ended it
        if os.path.isdir(os.path.join(jobs_root, job_id)):
            # Before any signal: the agents read it (a user's act or a failed start: no restart, no failure).
            why = reason if by == START_FAILED else None  # otherwise `reason` only words the killed events
            folder = JobFolder(os.path.join(jobs_root, job_id))
            if read_marker(folder.killed) == (by, why):
                continue  # marked so by the stop's marking pass: its event is said once, its time kept
            if why:
                append_events(folder.events, [{
                    "ts": time.time(), "node": payload.get("node"), "kind": EventKind.START_FAILED, "reason": why}])
            atomic.write(folder.killed, killed_marker(by, why))
    if payload.get("signal", True) is False:  # marking only: every node is marked before any node signals
        return Kill(killed=[], left=[], untrusted=untrusted).wire()
    sent, left = stop_all(find, grace)
    # With their programs gone, the launchers record the exit codes and exit; a stuck one gets SIGKILL.
    deadline = time.time() + 2
    stuck = launchers_left()
    while stuck and time.time() < deadline:
        time.sleep(0.02)
        stuck = launchers_left()
    for pid in stuck:
        send(pid, signal.SIGKILL)
        sent[pid] = "SIGKILL"
    time.sleep(0.05 if left or stuck else 0)
    found, launchers = kill_targets(ws, records, skip, only, starters=starters)
    left = sorted(set(found) | set(launchers))
    killed = [Killed(signal=sent[p], **described[p]) for p in sorted(sent) if p in described]
    write_kill_events(jobs_root, touched, killed, payload.get("node"), reason or by)
    return Kill(killed=killed, left=left, untrusted=untrusted).wire()


def op_verify(payload):
    """sha256 of files under a directory against what the manifest says."""
    import hashlib
    import shutil

    base = os.path.expanduser(expand(payload["dir"], workspace(payload)))
    result = {}
    for name, want in sorted(payload["files"].items()):
        path = os.path.join(base, name)
        try:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            result[name] = "ok" if h.hexdigest() == want else "mismatch"
        except FileNotFoundError:
            result[name] = "missing"
        except OSError as e:
            result[name] = "error: %s" % e.strerror
    du = shutil.disk_usage(base if os.path.isdir(base) else workspace(payload) if os.path.isdir(workspace(payload)) else "/")
    return Verify(files=result, disk_free=du.free).wire()


def op_collect(payload):
    """Everything the controller watches, read incrementally by byte offset.

    payload["offsets"] maps a file under the job dir (metrics/<name>.jsonl,
    events.jsonl, logs/<name>.log) to the offset already read. Only whole
    lines are returned, so a record is never split; at most max_bytes per file
    per call, so a long run is caught up over several calls.
    """
    ws = workspace(payload)
    jd = job_dir(ws, payload.get("job_id"))
    now, gpus = time.time(), None
    if payload.get("gpus"):  # who holds the node's GPUs (the dashboard asks every few polls: nvidia-smi is slow)
        from fabtrain.contract.gpus import summary
        from fabtrain.node import gpuinv

        gpus = summary(gpuinv.inventory())
    if not jd or not os.path.isdir(jd):
        return Collect(time=now, gpus=gpus).wire()
    job_id = os.path.basename(jd)
    offsets = payload.get("offsets", {}) if payload.get("job_id") in (None, job_id) else {}
    status = job_status({"workspace": payload["workspace"], "job_id": job_id})
    return Collect(time=now, job_id=job_id, gpus=gpus, processes=status.processes, killed=status.killed,
                   killed_by=status.killed_by, stop_reason=status.stop_reason, slurm=status.slurm,
                   health=atomic.read_json(JobFolder(jd).health), files=_appended(jd, offsets, payload)).wire()


def _appended(jd, offsets, payload):
    """{file: Chunk} of what was appended to the job's events, metrics and the logs asked since `offsets`."""
    max_bytes = int(payload.get("max_bytes", 1 << 20))
    metrics = JobFolder(jd).metrics
    wanted = [EVENTS] + ([METRICS + "/" + f for f in sorted(os.listdir(metrics)) if f.endswith(".jsonl")]
                         if os.path.isdir(metrics) else [])
    wanted += [k for k in offsets if k.startswith("logs/") and k not in wanted]
    files = {}
    for rel in wanted:
        if ".." in rel.split("/"):
            continue
        path = os.path.join(jd, rel)
        start = int(offsets.get(rel, 0))
        try:
            size = os.path.getsize(path)
            if size < start:
                start = 0  # truncated or replaced: read again from the top
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(min(max_bytes, size - start))
        except OSError:
            continue
        end = data.rfind(b"\n") + 1  # whole lines only
        files[rel] = Chunk(offset=start + end, size=size, data=data[:end].decode("utf-8", "replace"))
    return files


OPS = {"start": op_start, "status": op_status, "logs": op_logs, "kill": op_kill, "verify": op_verify,
       "collect": op_collect}
