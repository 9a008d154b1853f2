"""What fabtrain does ON a node: probe, provision, start, status, logs, kill, verify.

The controller sends this package to the node with every call
(fabtrain.remote.rpc) and fabtrain.node.serve runs the op the request
names, so it needs no deployed code, only the Python standard library
(3.8+). That is what lets ``fab kill-all`` work on a node whose code
directory is gone, and ``fab check`` before anything was deployed. An op
takes the request's payload and returns what goes back as the reply; it
raises UserFacing for a refusal the user should read as one line.
"""
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- small helpers ------------------------------------------------------------------


def expand(value, ws):
    return value.replace("$WS", ws)


def atomic_write(path, data, mode=0o644):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def boot_time():
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def proc_stat(pid):
    """(state, ppid, pgid, create_time, cpu_seconds) from /proc/<pid>/stat, or None if gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
    state, ppid, pgid = rest[0], int(rest[1]), int(rest[2])
    cpu = (int(rest[11]) + int(rest[12])) / CLK_TCK
    create_time = BOOT_TIME + int(rest[19]) / CLK_TCK
    return state, ppid, pgid, create_time, cpu


BOOT_TIME = boot_time()


def same_process(pid, create_time):
    """True if pid is alive and is the process we started (not a reused pid)."""
    st = proc_stat(pid)
    return st is not None and st[0] != "Z" and abs(st[3] - create_time) < 1.0


def is_dead(pid):
    st = proc_stat(pid)
    # A zombie is dead: it holds no memory, no port, no GPU; PID 1 reaps lazily here.
    return st is None or st[0] in ("Z", "X")


def all_pids():
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def environ_of(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return f.read()
    except OSError:
        return b""


def my_ancestors():
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        st = proc_stat(pid)
        if st is None:
            break
        pid = st[1]
    return pids


def marked_pids(ws):
    """Every live process whose environment carries this workspace's job marker."""
    marker = ("FABTRAIN_WORKSPACE=%s" % ws).encode() + b"\0"
    skip = my_ancestors()
    found = []
    for pid in all_pids():
        if pid in skip:
            continue
        env = environ_of(pid)
        if env and (env.startswith(marker) or b"\0" + marker in env) and not is_dead(pid):
            found.append(pid)
    return found


_children = None  # ppid -> [pid], from one /proc scan; reset at the start of each op


def children_of(pid):
    global _children
    if _children is None:
        _children = {}
        for p in all_pids():
            st = proc_stat(p)
            if st is not None:
                _children.setdefault(st[1], []).append(p)
    return list(_children.get(pid, ()))


def fresh_scan():
    """Forget the cached /proc scan: an op sees processes as they are now."""
    global _children
    _children = None


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


def workspace(payload):
    return os.path.abspath(os.path.expanduser(payload["workspace"]))


OWNER_FILE = ".fabtrain-owner.json"


def claim_workspace(ws, cluster, node):
    """Make the workspace this node's, or say whose it is.

    Two nodes must never share one workspace (two nodes on one machine, or
    servers that share /home over NFS): each would see, watch and kill the
    other's processes as its own. The first node to use a workspace claims it
    with a marker made with O_EXCL (atomic, on NFS too); any other node is
    refused. Returns None, or the one-line refusal.
    """
    marker = os.path.join(ws, OWNER_FILE)
    me = {"cluster": cluster, "node": node}
    try:
        os.makedirs(ws, mode=0o700, exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        if not isinstance(e, FileExistsError):
            return "cannot use workspace %s: %s" % (ws, e.strerror or e)
        owner = read_json(marker, {})
        if {k: owner.get(k) for k in me} == me:
            return None
        return ("workspace %s is already node %r of cluster %r (one machine, or storage shared between "
                "servers): give node %r its own (nodes[].workspace, or leave it out for <cluster.workspace>/%s); "
                "if that node is gone, remove %s" % (ws, owner.get("node"), owner.get("cluster"), node, node, marker))
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    return None


def job_dir(ws, job_id=None):
    if job_id:
        return os.path.join(ws, "jobs", job_id)
    cur = os.path.join(ws, "current")
    return os.path.realpath(cur) if os.path.islink(cur) else None


# -- process state -----------------------------------------------------------------


def process_state(jd, name):
    """State of one job process: its run record, whether it lives, how it ended."""
    run = read_json(os.path.join(jd, "run", name + ".json"))
    if run is None:
        return {"state": "not started"}
    info = {"pid": run["pid"], "started_at": run.get("started_at"), "uptime": None}
    exit_path = os.path.join(jd, "run", name + ".exit")
    if os.path.exists(exit_path):
        try:
            code = int(open(exit_path).read().strip())
        except ValueError:
            code = None
        info.update(state="exited", exit_code=code)
        return info
    if same_process(run["pid"], run["create_time"]):
        # The wrapper sh is the group leader; the program is its child.
        kids = children_of(run["pid"])
        st = proc_stat(kids[0] if kids else run["pid"])
        letter = st[0] if st else "?"
        info["state"] = {"T": "stopped", "t": "stopped", "Z": "zombie"}.get(letter, "running")
        info["uptime"] = time.time() - run["create_time"]
        info["program_pid"] = kids[0] if kids else None
        zombies = [k for k in children_of(kids[0]) if (proc_stat(k) or "?")[0] == "Z"] if kids else []
        if zombies:
            info["zombies"] = len(zombies)
        return info
    info["state"] = "killed" if os.path.exists(os.path.join(jd, "killed")) else "lost"
    return info


# -- operations --------------------------------------------------------------------


def op_probe(payload):
    ws = workspace(payload)
    probe = {
        "workspace_conflict": claim_workspace(ws, payload["cluster"], payload["node"]),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "python_path": sys.executable,
        "workspace": ws,
        "time": time.time(),
        "cpus": os.cpu_count(),
        "tools": {t: bool(shutil.which(t)) for t in ("rsync", "setsid", "nohup", "stdbuf")},
    }
    existing = ws
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    du = shutil.disk_usage(existing)
    probe["disk_free"] = du.free
    probe["disk_total"] = du.total
    try:
        with open("/proc/meminfo") as f:
            probe["mem_total"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        probe["mem_total"] = None
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        metadata = None

    def version(dist):
        try:
            return metadata.version(dist) if metadata else None
        except Exception:
            return None

    probe["psutil"] = version("psutil")
    probe["paddle"] = version("paddlepaddle") or version("paddlepaddle-gpu")
    probe["torch"] = version("torch")
    probe["cuda"] = None
    probe["gpus"] = 0
    if probe["torch"] and payload.get("torch_cuda", True):
        # Only importing torch tells whether CUDA works; ~1 s, so only for check.
        code = "import torch,json;print(json.dumps([torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda]))"
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            ok, count, cuda = json.loads(out.stdout.strip().splitlines()[-1])
            probe["cuda"] = cuda if ok else None
            probe["gpus"] = count
        except Exception as e:  # a broken torch install is a finding, not a crash
            probe["torch_error"] = str(e)[:200]
    return probe


def op_provision(payload):
    ws = workspace(payload)
    for sub in ("code", "data", "jobs", "runtime"):
        os.makedirs(os.path.join(ws, sub), exist_ok=True)
    result = {"workspace": ws, "venv": None}
    if payload.get("venv"):
        venv = os.path.join(ws, "venv")
        if not os.path.exists(os.path.join(venv, "bin", "python")):
            subprocess.run([sys.executable, "-m", "venv", venv], check=True, capture_output=True)
        pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
        wheelhouse = os.path.join(ws, "wheelhouse")
        if payload.get("wheelhouse"):
            pip += ["--no-index", "--find-links", wheelhouse]
        reqs = payload.get("requirements") or []
        if reqs:
            out = subprocess.run(pip + reqs, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError("pip install failed: " + (out.stderr.strip().splitlines() or ["?"])[-1])
        result["venv"] = os.path.join(venv, "bin", "python")
    return result


def live_job_processes(jd):
    live = []
    for name in sorted(os.listdir(os.path.join(jd, "run"))) if os.path.isdir(os.path.join(jd, "run")) else []:
        if name.endswith(".json"):
            run = read_json(os.path.join(jd, "run", name))
            if run and same_process(run["pid"], run["create_time"]):
                live.append(name[:-5])
    return live


def spawn(proc, ws, base_env):
    """Start one process: own session, nohup, line-buffered, stdin /dev/null."""
    env = dict(base_env)
    for k, v in proc["env"].items():
        v = expand(v, ws)
        if k == "PATH":
            v = v.replace("$PATH", base_env.get("PATH", "/usr/bin:/bin"))
            v = ":".join(os.path.expanduser(part) for part in v.split(":"))
        env[k] = v
    log = open(expand(proc["log"], ws), "ab")
    argv = [expand(a, ws) for a in proc["launch"]]
    cwd = expand(proc["cwd"], ws)
    if not os.path.isdir(cwd):
        os.makedirs(cwd, exist_ok=True)
    try:
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, close_fds=True)
    finally:
        log.close()
    st = proc_stat(p.pid)
    record = {"name": proc["name"], "role": proc["role"], "rank": proc["rank"], "pid": p.pid,
              "pgid": p.pid, "create_time": st[3] if st else time.time(), "argv": argv[6:],
              "started_at": time.time()}
    atomic_write(expand(proc["run"], ws), json.dumps(record))
    return p, record


CODE_IDENTITY = ".fabtrain-code.json"  # written by `fab deploy`: which code this is


def snapshot_code(ws, jd):
    """The job's own copy of <ws>/code, made once, at its first start: jobs/<id>/code.

    Hard links, so unchanged files cost nothing; `fab deploy` (rsync) replaces a
    file by renaming a new one over it, never writing into it, so a deploy while
    the job runs leaves the job's code as it was. Returns which code it is.
    """
    src, dst = os.path.join(ws, "code"), os.path.join(jd, "code")
    if not os.path.isdir(dst):
        tmp = dst + ".tmp.%d" % os.getpid()
        if os.path.isdir(src):
            shutil.copytree(src, tmp, symlinks=True, copy_function=os.link)
        else:
            os.makedirs(tmp)  # nothing deployed: commands that need no shipped code still run
        os.replace(tmp, dst)
    return read_json(os.path.join(dst, CODE_IDENTITY), {})


def start_agent(agent, job, jd, ws, base_env, warnings):
    """Start the agent; on the node that hosts the coordinator, first, and only once it holds the port.

    Agents refuse a coordinator that cannot prove the job's secret, so a job whose
    coordinator cannot listen (another program on job.watchdog.port) has none:
    that fails the start here, before any of the job's processes runs.
    """
    events = os.path.join(jd, "events.jsonl")
    offset = os.path.getsize(events) if os.path.exists(events) else 0
    p, record = spawn(agent, ws, base_env)
    if (job.get("nodes") or [{}])[0].get("name") != job["node"]:
        return record
    deadline = time.time() + 15
    while time.time() < deadline:
        kinds = {}
        try:
            with open(events) as f:
                f.seek(offset)
                lines = f.read().splitlines()
        except OSError:
            lines = []  # not written yet
        for text in lines:
            try:
                ev = json.loads(text)
                kinds[ev.get("kind")] = ev.get("reason")
            except (ValueError, AttributeError):
                pass  # a line being written
        if "agent_started" in kinds:
            return record
        if p.poll() is not None:
            why = kinds.get("coordinator_error") or "the agent exited at once with code %s: %s" % (
                p.returncode, " | ".join(tail_lines(expand(agent["log"], ws), 3)))
            raise UserFacing("%s; nothing of job %s was started here" % (why, job["job_id"]))
        time.sleep(0.05)
    warnings.append("the agent has not started its coordinator within 15 s (see `fab status`)")
    return record


def op_start(payload):
    job = payload["job"]
    ws = workspace(job)
    refusal = claim_workspace(ws, job["cluster"], job["node"])
    if refusal:
        raise UserFacing(refusal)
    jd = os.path.join(ws, "jobs", job["job_id"])
    for sub in ("logs", "run", "metrics"):
        os.makedirs(os.path.join(jd, sub), exist_ok=True)

    # Refuse to start over a running job unless told (`--force` kills it first on the controller side).
    for other in sorted(os.listdir(os.path.join(ws, "jobs"))):
        other_dir = os.path.join(ws, "jobs", other)
        if other != job["job_id"]:
            live = live_job_processes(other_dir)
            if live:
                raise UserFacing("job %s is still running here (%s); stop it with `fab kill-all` or pass --force"
                                 % (other, ", ".join(live)))
    roles = set(payload["roles"])
    wanted = [p for p in job["processes"] if p["role"] in roles]
    already = set(live_job_processes(jd))
    for p in wanted:
        if p["name"] in already:
            raise UserFacing("%s of job %s is already running here" % (p["name"], job["job_id"]))

    job["code"] = snapshot_code(ws, jd)
    # 0600: it holds the coordinator's secret.
    atomic_write(os.path.join(jd, "job.json"), json.dumps(job, indent=1), mode=0o600)
    tmp_link = os.path.join(ws, ".current.%d" % os.getpid())
    os.symlink(os.path.join("jobs", job["job_id"]), tmp_link)
    os.replace(tmp_link, os.path.join(ws, "current"))

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FABTRAIN_")}
    warnings, agent_record = [], None
    agent = payload.get("agent")
    if agent and "agent" not in already:
        runtime = os.path.join(expand(agent["cwd"], ws), "fabtrain", "node")
        if os.path.isdir(runtime):
            agent_record = start_agent(agent, job, jd, ws, base_env, warnings)
        else:
            warnings.append("watchdog not started: fabtrain's node runtime %s is missing (run `fab deploy` first)"
                            % runtime)
    started, popen = [], []
    for proc in wanted:
        p, record = spawn(proc, ws, base_env)
        popen.append((p, proc))
        started.append(record)
    if agent_record:
        started.append(agent_record)

    # A program that cannot start (not found, bad flag) usually dies at once:
    # say so now rather than leave it for `fab status`.
    deadline = time.time() + payload.get("settle", 0.1)
    failed = []
    while time.time() < deadline and popen:
        time.sleep(0.05)
        for p, proc in list(popen):
            if p.poll() is not None:
                popen.remove((p, proc))
                if p.returncode != 0:
                    failed.append({"name": proc["name"], "exit_code": p.returncode,
                                   "log": tail_lines(expand(proc["log"], ws), 3)})
    return {"job_dir": jd, "started": started, "failed": failed, "warnings": warnings}


def op_status(payload):
    fresh_scan()
    ws = workspace(payload)
    jd = job_dir(ws, payload.get("job_id"))
    if not jd or not os.path.isdir(jd):
        return {"job_id": None, "processes": []}
    job = read_json(os.path.join(jd, "job.json"), {})
    names = [p["name"] for p in job.get("processes", [])]
    if os.path.exists(os.path.join(jd, "run", "agent.json")):
        names.append("agent")
    procs = []
    for name in names:
        info = process_state(jd, name)
        info["name"] = name
        info["last_line"] = (tail_lines(os.path.join(jd, "logs", name + ".log"), 1) or [""])[0][-200:]
        procs.append(info)
    known = set()
    for name in names:
        run = read_json(os.path.join(jd, "run", name + ".json"))
        if run:
            known.add(run["pid"])
            known.update(children_of(run["pid"]))
    health = read_json(os.path.join(jd, "health.json"))
    events = tail_lines(os.path.join(jd, "events.jsonl"), 1)
    return {
        "job_id": os.path.basename(jd),
        "code": job.get("code"),
        "processes": procs,
        "killed": os.path.exists(os.path.join(jd, "killed")),
        "health_ts": health.get("ts") if isinstance(health, dict) else None,
        "health": health if payload.get("health") else None,
        "last_event": json.loads(events[0]) if events else None,
        "time": time.time(),
    }


def op_logs(payload):
    ws = workspace(payload)
    jd = job_dir(ws, payload.get("job_id"))
    if not jd or not os.path.isdir(jd):
        raise UserFacing("no job here yet")
    node = payload["node"]
    logs_dir = os.path.join(jd, "logs")
    names = sorted(f[:-4] for f in os.listdir(logs_dir) if f.endswith(".log"))
    offsets = {}
    for name in names:
        path = os.path.join(logs_dir, name + ".log")
        for line in tail_lines(path, payload.get("lines", 20)):
            sys.stdout.write("[%s %s] %s\n" % (node, name, line))
        offsets[name] = os.path.getsize(path)
    sys.stdout.flush()
    if not payload.get("follow"):
        return None
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
        if not live_job_processes(jd):
            return None
        time.sleep(0.2)


def op_kill(payload):
    """SIGTERM every job process group, grace, SIGKILL; then sweep by job marker."""
    fresh_scan()
    ws = workspace(payload)
    grace = float(payload.get("grace", 5.0))
    jobs_root = os.path.join(ws, "jobs")
    targets = {}  # pid -> description
    groups = {}  # pgid -> description
    touched_jobs = set()
    for job_id in sorted(os.listdir(jobs_root)) if os.path.isdir(jobs_root) else []:
        run_dir = os.path.join(jobs_root, job_id, "run")
        for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
            if not name.endswith(".json"):
                continue
            run = read_json(os.path.join(run_dir, name))
            if run and same_process(run["pid"], run["create_time"]):
                desc = {"job_id": job_id, "name": run["name"], "pid": run["pid"]}
                groups[run["pgid"]] = desc
                targets[run["pid"]] = desc
                touched_jobs.add(job_id)
    swept = []
    for pid in marked_pids(ws):
        st = proc_stat(pid)
        if pid not in targets and st and st[2] in groups:
            # A child still in its process group: not an orphan, killed with the group.
            targets[pid] = dict(groups[st[2]], pid=pid, child=True)
        elif pid not in targets:
            env = dict(kv.split(b"=", 1) for kv in environ_of(pid).split(b"\0") if b"=" in kv)
            desc = {"job_id": env.get(b"FABTRAIN_JOB_ID", b"?").decode(), "pid": pid,
                    "name": "%s-%s" % (env.get(b"FABTRAIN_ROLE", b"?").decode(), env.get(b"FABTRAIN_RANK", b"?").decode()),
                    "orphan": True}
            targets[pid] = desc
            swept.append(pid)
            if desc["job_id"] != "?":
                touched_jobs.add(desc["job_id"])
    for job_id in touched_jobs:
        jd = os.path.join(jobs_root, job_id)
        if os.path.isdir(jd):
            open(os.path.join(jd, "killed"), "a").close()

    def send(sig):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in targets:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def group_members():
        members = set()
        if groups:
            for pid in all_pids():
                st = proc_stat(pid)
                if st and st[2] in groups and st[0] not in ("Z", "X"):
                    members.add(pid)
        return members

    def alive():
        return [p for p in set(targets) | group_members() if not is_dead(p)]

    killed_with = {}
    if targets:
        send(signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and alive():
            time.sleep(0.05)
        survivors = alive()
        for pid in targets:
            killed_with[pid] = "SIGKILL" if pid in survivors else "SIGTERM"
        if survivors:
            send(signal.SIGKILL)
            for pid in survivors:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 5
            while time.time() < deadline and alive():
                time.sleep(0.05)
    # A last sweep: anything with the marker that appeared meanwhile (a child forked during the grace).
    late = [p for p in marked_pids(ws) if p not in targets]
    for pid in late:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.1 if late else 0)
    left = sorted(set(alive()) | {p for p in marked_pids(ws)})
    killed = [dict(targets[p], signal=killed_with.get(p, "SIGKILL")) for p in sorted(targets)]
    now = time.time()
    for job_id in touched_jobs:
        ev = os.path.join(jobs_root, job_id, "events.jsonl")
        if not os.path.isdir(os.path.dirname(ev)):
            continue
        # One event per process (its wrapper, the program and children share it).
        by_name = {}
        for k in killed:
            if k["job_id"] == job_id:
                by_name.setdefault(k["name"], []).append(k)
        with open(ev, "a") as f:
            for name, ks in sorted(by_name.items()):
                role, _, rank = name.rpartition("-")
                orphan = any(k.get("orphan") for k in ks)
                f.write(json.dumps({
                    "ts": now, "node": payload.get("node"), "kind": "killed", "role": role,
                    "rank": int(rank) if rank.isdigit() else rank, "pid": min(k["pid"] for k in ks),
                    "pids": sorted(k["pid"] for k in ks),
                    "reason": "fab kill-all" + (" (orphan: pid file lost or left its group)" if orphan else ""),
                    "signal": "SIGKILL" if any(k["signal"] == "SIGKILL" for k in ks) else "SIGTERM"}) + "\n")
    return {"killed": killed, "left": left, "late": late}


def op_verify(payload):
    """sha256 of files under a directory against what the manifest says."""
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
    return {"files": result, "disk_free": du.free}


def op_collect(payload):
    """Everything the controller watches, read incrementally by byte offset.

    payload["offsets"] maps a file under the job dir (metrics/<name>.jsonl,
    events.jsonl, logs/<name>.log) to the offset already read. Only whole
    lines are returned, so a record is never split; at most max_bytes per file
    per call, so a long run is caught up over several calls.
    """
    fresh_scan()
    ws = workspace(payload)
    jd = job_dir(ws, payload.get("job_id"))
    reply = {"time": time.time(), "job_id": None}
    if not jd or not os.path.isdir(jd):
        return reply
    job_id = os.path.basename(jd)
    reply["job_id"] = job_id
    offsets = payload.get("offsets", {}) if payload.get("job_id") in (None, job_id) else {}
    status = op_status({"workspace": payload["workspace"], "job_id": job_id})
    reply["processes"] = status["processes"]
    reply["killed"] = status["killed"]
    reply["health"] = read_json(os.path.join(jd, "health.json"))
    max_bytes = int(payload.get("max_bytes", 1 << 20))
    wanted = ["events.jsonl"] + ["metrics/" + f for f in sorted(os.listdir(os.path.join(jd, "metrics")))
                                 if f.endswith(".jsonl")] if os.path.isdir(os.path.join(jd, "metrics")) else ["events.jsonl"]
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
        files[rel] = {"offset": start + end, "size": size, "data": data[:end].decode("utf-8", "replace")}
    reply["files"] = files
    return reply


class UserFacing(Exception):
    """A refusal to report as one line, not a crash."""


OPS = {"probe": op_probe, "provision": op_provision, "start": op_start, "status": op_status,
       "logs": op_logs, "kill": op_kill, "verify": op_verify, "collect": op_collect}
