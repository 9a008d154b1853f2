"""The library behind the lifecycle tasks: check, provision, deploy, start, status, logs, kill-all.

Each function does its work on every node in parallel (one remote command per
node where it can) and returns per-node results; printing is `report`'s job.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fabtrain.controller import preflight, records, state
from fabtrain.controller.terminal import VisibleLines
from fabtrain.errors import UserError
from fabtrain.contract import jobid
from fabtrain.contract.clock import boot_id
from fabtrain.contract.opreplies import Probe
from fabtrain.plan.runtime import PACKAGE_ROOT, runtime_files, runtime_version
from fabtrain.plan.plan import Network, Plan, make_plan, new_job_id
from fabtrain.contract.replies import COORDINATOR_LISTENS
from fabtrain.contract.states import START_FAILED, STOP_GRACE
from fabtrain.plan.ports import configured_ports, needed_ports
from fabtrain.remote import rpc
from fabtrain.remote.rsync import Rsync, rsync
from fabtrain.remote.session import Session
from fabtrain.remote.transport import NO_REPLY, UNREACHABLE, Reply, Transport

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
CODE_IDENTITY = ".fabtrain-code.json"  # beside the code on each node: which code it is
# Never shipped, whatever the project: version control, virtualenvs, caches,
# fabtrain's own state. A project adds its own in .fabtrainignore (rsync patterns).
DEPLOY_EXCLUDES = (".git/", ".hg/", ".venv/", "venv/", "__pycache__/", "*.pyc", ".fabtrain/",
                   ".pytest_cache/", "*.egg-info/")
IGNORE_FILE = ".fabtrainignore"
MIN_DISK_FREE = 1 << 30


# -- check ---------------------------------------------------------------------------


VERSIONS = ("python", "torch", "paddle", "cuda")  # what a Probe says that must be the same on every node


@dataclass
class NodeCheck:
    node: str
    ok: bool
    probe: Probe | None = None  # None: the node gave none (down says why)
    problems: list[str] = field(default_factory=list)
    clock_offset: tuple[float, float] | None = None  # (lo, hi) bounds, seconds; (0, 0) on this machine
    down: str | None = None  # NodeError.kind when the probe got no answer, or a malformed one
    differs: list[str] = field(default_factory=list)  # of VERSIONS, those that differ across the nodes


def check(session: Session, timeout: float | None = None, stand_ins: bool = False) -> list[NodeCheck]:
    """timeout: for each node's answer (None: the transport's own). stand_ins: the nodes are another machine's
    view of the job's workspaces (a Slurm allocation's, from the login node: its backend asks the allocation's
    own nodes), so their GPUs are not the job's: CUDA is not asked, and none is no problem."""
    cluster = session.cluster

    def probe(t: Transport):
        t0 = time.time()
        payload = {"cluster": cluster.name, **({"torch_cuda": False} if stand_ins else {})}
        result = rpc.call(t, "probe", payload, timeout=timeout)
        return result, t0, time.time()

    checks = []
    for reply in session.map(probe):
        if not reply.ok:
            checks.append(NodeCheck(reply.node, False, problems=[reply.error], down=reply.kind))
            continue
        result, t0, t1 = reply.value
        # A node on this machine's kernel reads this machine's clock: no offset, whatever the round trip took.
        same_clock = result.boot_id is not None and result.boot_id == boot_id()
        offset = (0.0, 0.0) if same_clock else (result.time - t1, result.time - t0)
        c = NodeCheck(reply.node, True, result, clock_offset=offset)
        c.problems = _problems(cluster, cluster.node(reply.node), result, gpus_here=not stand_ins)
        c.ok = not c.problems
        checks.append(c)

    # Versions that differ across nodes: a classic source of hangs and wrong results.
    for key in VERSIONS:
        if len({getattr(c.probe, key) for c in checks if c.probe}) > 1:
            for c in checks:
                if c.probe:
                    c.differs.append(key)
    return checks


def _problems(cluster, node, probe: Probe, gpus_here: bool = True) -> list[str]:
    """What keeps one node from running the job, by its probe: a line each."""
    problems = []
    missing = [tool for tool in probe.tools.missing() if tool != "rsync"]
    if missing:
        problems.append(f"missing {', '.join(missing)} (coreutils/util-linux)")
    if not probe.tools.rsync and not node.is_local:
        problems.append("rsync not installed (needed by deploy and copy-data)")
    commands = [cluster.job.trainer.command] + ([cluster.job.pserver.command] if cluster.job.mode == "pserver" else [])
    uses_workload = any("workload." in cmd for cmd in commands)
    if uses_workload and not probe.torch:
        problems.append("torch not installed (the reference workload needs it)")
    if cluster.job.trainer.use_gpu and "trainer" in node.roles and not probe.gpus and gpus_here:
        problems.append("use_gpu is set but torch sees no GPU")
    if probe.workspace_conflict:
        problems.append(probe.workspace_conflict)
    if probe.disk_free < MIN_DISK_FREE:
        problems.append(f"only {probe.disk_free >> 20} MiB free in the workspace")
    return problems


# -- provision -------------------------------------------------------------------------


def provision(session: Session, venv: bool = False, wheelhouse: str | None = None,
              requirements: list[str] | None = None) -> list[Reply]:
    reqs = requirements if requirements is not None else _node_requirements()

    if wheelhouse and not Path(wheelhouse).expanduser().is_dir():
        raise UserError(f"--wheelhouse {wheelhouse}: not a directory (make one with: pip download -d DIR -r requirements-node.txt)")

    def one(t: Transport):
        if wheelhouse:
            rsync(t, [str(Path(wheelhouse).expanduser()) + "/"], t.node.workspace + "/wheelhouse")
        return rpc.call(t, "provision", {"venv": venv, "wheelhouse": bool(wheelhouse), "requirements": reqs})

    return session.map(one)


def _node_requirements() -> list[str]:
    path = PROJECT_ROOT / "requirements-node.txt"
    return read_requirements(path) if path.exists() else []


def read_requirements(path) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"--requirements {path}: {e.strerror}") from None
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


# -- deploy --------------------------------------------------------------------------


def deploy(session: Session) -> list[Reply]:
    """Ship the project's code (job.code) to <workspace>/code and fabtrain's node
    runtime to <workspace>/runtime/<version> on every node; fast when nothing changed."""
    cluster = session.cluster
    source = cluster.code_dir()
    if not source.is_dir():
        raise UserError(f"{cluster.path}: job.code: {source} is not a directory")
    own = fabtrain_folders(source, cluster)
    excludes = [f"--exclude={e}" for e in (*DEPLOY_EXCLUDES, *_local_excludes(source, own))]
    if (source / IGNORE_FILE).is_file():
        excludes.append(f"--exclude-from={source / IGNORE_FILE}")
    identity = code_identity(source, own)
    with tempfile.TemporaryDirectory(prefix="fabtrain-deploy-") as tmp:
        (Path(tmp) / CODE_IDENTITY).write_text(json.dumps(identity))

        def one(t: Transport):
            # -R keeps each file's path below the /./ marker: fabtrain/node/... under runtime/<version>.
            runtime = [f"{PACKAGE_ROOT.parent}/./{rel}" for rel in runtime_files()]
            # The runtime's copy runs while the code's does: they go to different folders, and
            # each is an OpenSSH connection and a remote rsync, whose start-up one after the
            # other would be most of a one-node deploy's wait (bench/fanout.py --profile).
            with Rsync(t, runtime, f"{t.node.workspace}/runtime/{runtime_version()}", ["-R"]) as runtime_copy:
                stats = rsync(t, [f"{source}/", f"{tmp}/{CODE_IDENTITY}"], t.node.workspace + "/code",
                              ["--delete", *excludes])
                runtime_copy.finish(3600)
            return {**stats, "code": identity}
        return session.map(one)


def fabtrain_folders(source: Path, cluster) -> list[str]:
    """What fabtrain itself writes that lies inside job.code, relative to it: the data dir, every node's
    workspace as this machine sees it (a relative one is under the home directory, where node ops start;
    a home the nodes share is this one), and the controller's state. Never shipped as code: a workspace
    inside the code would be shipped into itself on every deploy."""
    places = [cluster.data_dir(), state.folder()]
    for node in cluster.nodes:
        ws = Path(os.path.expanduser(node.workspace))
        places.append(ws if ws.is_absolute() else Path.home() / ws)
    found = []
    for place in places:
        place = place.resolve()
        if source in place.parents and place.relative_to(source).as_posix() not in found:
            found.append(place.relative_to(source).as_posix())
    return found


def _local_excludes(source: Path, own: list[str]) -> list[str]:
    """rsync patterns, anchored at job.code, for fabtrain's own folders and any virtualenv of this project."""
    found = [f"/{rel}/" for rel in own]
    for child in source.iterdir():
        if child.is_dir() and (child / "pyvenv.cfg").exists():
            found.append(f"/{child.name}/")
    return found


def code_identity(source: Path, own: list[str] = ()) -> dict:
    """Which code this is: the git commit and whether the tree differs from it, else a content hash.
    own: fabtrain's folders inside it (fabtrain_folders), which are not the code."""
    def git(*args):
        out = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else None
    try:
        commit = git("rev-parse", "HEAD")
        if commit:
            changed = git("status", "--porcelain", "--untracked-files=normal", "--", ".",
                          *(f":(exclude){rel}" for rel in own))
            return {"commit": commit, "dirty": bool(changed)}
    except (OSError, subprocess.TimeoutExpired):
        pass  # no git here: fall back to a hash
    digest = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file() and not _never_shipped(p, source, own)):
        digest.update(path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes())
    return {"hash": digest.hexdigest()[:16]}


def _never_shipped(path: Path, source: Path, own: list[str]) -> bool:
    rel = path.relative_to(source)
    return any(p in (".git", ".venv", "venv", "__pycache__", ".fabtrain") for p in rel.parts[:-1]) or \
        any(rel.as_posix().startswith(f"{folder}/") for folder in own)


# -- start ---------------------------------------------------------------------------


@dataclass
class StartResult:
    job_id: str
    plan: Plan
    replies: list[Reply]
    stopped: list[Reply] = field(default_factory=list)  # --force: kill-all's replies, before the start
    undone: list[Reply] | None = None  # an incomplete start: what stopping the job's processes did per node
    why: str = ""  # an incomplete start: which node failed, and how

    @property
    def complete(self) -> bool:
        """Every node started every process it was asked to."""
        return all(r.ok and not r.value.failed for r in self.replies)

    def failures(self) -> list[str]:
        """One clause a node or process that did not start, naming the node."""
        out = []
        for r in self.replies:
            if not r.ok:
                out.append(r.error if r.error.startswith(f"{r.node}:") else f"{r.node}: {r.error}")
            else:
                out += [f"{r.node}: {f.name} exited at once with code {f.exit_code}" for f in r.value.failed]
        return out


def start(session: Session, roles: tuple[str, ...], force: bool = False, grace: float = STOP_GRACE,
          resume_from: str | None = None) -> StartResult:
    cluster = session.cluster
    if cluster.job.mode == "collective" and "pserver" in roles:
        raise UserError(f"{cluster.path}: job.mode is collective: there are no pservers to start; run fab start-trainers")
    previous = state.load(cluster.name)
    if "pserver" in roles or cluster.job.mode == "collective":
        job_id = new_job_id()
    else:
        # start-trainers in pserver mode joins the job whose pservers are up.
        if previous.get("roles") != ["pserver"]:
            raise UserError("no job is waiting for trainers: run `fab start-pserver start-trainers` to start a new job")
        job_id = jobid.checked(previous.get("job_id"), lambda why: UserError(
            f"the controller's state of cluster {cluster.name}: {why}; start a new job with `fab start-pserver start-trainers`"))
        _require_pservers(session, job_id)
    if resume_from is None and job_id == previous.get("job_id"):
        resume_from = previous.get("resume_from")
    jobid.checked(resume_from, lambda why: UserError(f"--resume-from: {why}"), optional=True)
    by = "fab start-pserver --force" if "pserver" in roles else "fab start-trainers --force"
    stopped = kill_all(session, grace=grace, by=by) if force else []
    # The agents' coordinator only listens to beats that carry the job's secret.
    secret = previous.get("secret") if job_id == previous.get("job_id") else None
    secret = secret or secrets.token_hex(16)
    with rpc.Channels() as channels:  # the port probe's node-side process does the start too
        network = _start_network(session, job_id, previous, roles, channels.call)
        plan = make_plan(cluster, job_id, resume_from=resume_from, secret=secret, network=network)
        replies = _start_nodes(session, plan, roles, channels.call)
    if any(r.ok and r.value.started for r in replies):  # a start every node refused is no job
        joined = job_id == previous.get("job_id")
        started_roles = sorted(set(previous.get("roles", [])) | set(roles)) if joined else sorted(roles)
        state.save(cluster.name, job_id=job_id, roles=started_roles, cluster=cluster.path, resume_from=resume_from,
                   secret=secret, network=network.to_dict())
    result = StartResult(job_id, plan, replies, stopped)
    stop_incomplete_start(session, result, cluster.job.watchdog.grace)
    return result


def _start_nodes(session: Session, plan: Plan, roles: tuple[str, ...], call) -> list[Reply]:
    """The start op on every node with one of `roles`. With the watchdog on, the coordinator's
    node first: its start waits for its agent to listen, and on one machine that agent otherwise
    shares the CPU with every other node's start (64 nodes: ~8 s for it, ~0.4 s alone). The other
    nodes start as soon as that node says its agent listens (a line before its reply), so they find
    it listening while its own processes start and settle; or, if it never says so, once it answered."""
    cluster = session.cluster
    nodes = [cluster.node(n.node) for n in plan.nodes if any(p.role in roles for p in n.processes)]

    def one(t: Transport, stream=None):
        payload = {"job": plan.job_json(t.node.name), "roles": list(roles)}
        if cluster.job.watchdog.enabled:
            payload["agent"] = plan.agent_process(t.node.name)
        if stream is not None:
            payload["tell_listening"] = True
        return call(t, "start", payload, timeout=120, last=True, stream=stream)

    first = [n for n in nodes if cluster.job.watchdog.enabled and n.name == plan.nodes[0].node]
    if not first:
        return session.map(one, nodes)
    listens = threading.Event()

    class Lines:  # the first node's start prints nothing else
        def write(self, text: str) -> None:
            if text.strip() == COORDINATOR_LISTENS:
                listens.set()

        def flush(self) -> None:
            pass

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"start {first[0].name}") as pool:
        first_start = pool.submit(session.map, lambda t: one(t, Lines()), first)
        first_start.add_done_callback(lambda _: listens.set())  # or answered without it (it failed)
        listens.wait()
        others = session.map(one, [n for n in nodes if n not in first])
        return first_start.result() + others  # a bug's exception in that thread is raised here


def stop_incomplete_start(session: Session, result: StartResult, grace: float) -> None:
    """All or nothing: a start that some node refused, or where a process died at once, stops what
    it started of the job on every node (its pservers too: they would wait for the missing trainers
    until startup_timeout), through node ops' kill and its one escalation (SIGTERM, the job's
    watchdog.grace, SIGKILL).
    Each node's job gets a `start_failed` event naming the node that failed and why, and its
    `killed` marker says the same, so the agents neither restart nor tear down on their own and
    `fab status` reads a failure, not a kill-all. A start that started nothing anywhere (every node
    refused: a job already running, say) has nothing to undo and is left alone."""
    if result.complete:
        return
    maybe_started = any(r.ok and r.value.started for r in result.replies) or \
        any(not r.ok and r.kind == NO_REPLY for r in result.replies)  # it may have started there
    if not maybe_started:
        return
    result.why = f"the start failed: {'; '.join(result.failures())}"
    payload = {"grace": grace, "job_id": result.job_id, "reason": result.why, "by": START_FAILED}
    # Every node's marker before any node's signal: a trainer that dies because another node's pserver was
    # stopped is then read by its agent as stopped, not as a failure of its own. Only the nodes that answered
    # the start are marked first (one that did not would hold the stop up for its timeout twice); the stop
    # marks the others.
    answered = {r.node for r in result.replies if r.ok}
    session.map(lambda t: rpc.call(t, "kill", {**payload, "signal": False}, timeout=60),
                [n for n in session.cluster.nodes if n.name in answered])
    result.undone = session.map(lambda t: rpc.call(t, "kill", payload, timeout=grace + 60))


def _require_pservers(session: Session, job_id: str) -> None:
    """start-trainers joins a pserver job only while every one of its pservers runs."""
    nodes = [n for n in session.cluster.nodes if "pserver" in n.roles]
    problems = []
    for r in session.map(lambda t: rpc.call(t, "status", {"job_id": job_id}, timeout=60), nodes):
        if not r.ok:
            problems.append(r.error)
            continue
        pservers = [p for p in records.kept_processes(r.value.processes) if p["name"].startswith("pserver-")]
        if not pservers:
            problems.append(f"{r.node}: no pserver of job {job_id}")
        for p in pservers:
            if p["state"] not in ("running", "sleeping"):
                code = f" ({p['exit_code']})" if p.get("exit_code") is not None else ""
                problems.append(f"{p['name']} on {r.node} {p['state']}{code}")
    if problems:
        raise UserError(f"job {job_id}: its pservers are not running ({'; '.join(problems)}); "
                        "start a new job with `fab start-pserver start-trainers`")


def _start_network(session: Session, job_id: str, previous: dict, roles: tuple[str, ...], call=rpc.call) -> Network:
    """The job's ports and interfaces. A new job: one probe fan-out, which refuses a
    taken fixed port before anything starts and chooses the `auto` ones. Trainers
    joining a job's pservers take what it started with: job.json must not change."""
    if job_id != previous.get("job_id"):
        return preflight.prepare_start(session, job_id, roles, call)
    if isinstance(previous.get("network"), dict):
        return Network.from_dict(previous["network"])
    if any(configured_ports(session.cluster)[k] is None for k in needed_ports(session.cluster)):
        raise UserError(f"job {job_id}: its auto ports are not in this controller's state: "
                        "fab kill-all, then start the job again")
    return preflight.prepare_start(session, job_id, roles, call)


# -- status, logs, kill-all -----------------------------------------------------------------


def status(session: Session, job_id: str | None = None, health: bool = False, timeout: float = 60) -> list[Reply]:
    jobid.checked(job_id, UserError, optional=True)
    replies = session.map(lambda t: rpc.call(t, "status", {"job_id": job_id, "health": health}, timeout=timeout))
    if job_id:
        require_job(replies, job_id)
    return replies


def logs(session: Session, lines: int = 20, follow: bool = False, job_id: str | None = None, out=None,
         stacks: bool = False) -> list[Reply]:
    out = VisibleLines(out or sys.stdout)  # a program's escape sequences never reach the terminal as such
    payload = {"lines": lines, "follow": follow, "job_id": jobid.checked(job_id, UserError, optional=True)}
    if stacks:
        payload["stacks"] = True
    return session.map(lambda t: rpc.call(t, "logs", payload, stream=out))


STACK_LINE = re.compile(r"^\[(\S+) (\S+)\] ?(.*)$")  # node ops' `logs --stacks` lines: [node process] text


def stacks(session: Session, node: str, job_id: str | None, timeout: float = 30.0) -> dict[str, list[str]]:
    """One node's saved stacks (what `fab logs --stacks` prints for it), {process: lines}; empty when
    none were saved. Raises rpc.NodeError when the node cannot be asked."""
    out = io.StringIO()
    rpc.call(session.transport(session.cluster.node(node)), "logs", {"stacks": True, "lines": 0, "job_id": job_id}, timeout=timeout,
             stream=out)
    by_process: dict[str, list[str]] = {}
    for line in out.getvalue().splitlines():
        m = STACK_LINE.match(line)
        if m and m.group(1) == node:
            by_process.setdefault(m.group(2), []).append(m.group(3))
    return by_process


def no_job(job_id: str | None) -> UserError:
    """How every task says that the job asked for is on no node (exit 2, as for any id typed wrong)."""
    return UserError(f"no job {job_id} on any node" if job_id else "no job has started here yet")


def require_job(replies: list[Reply], job_id: str | None) -> None:
    """Raise no_job when every node answered and none has the job (status and logs replies)."""
    if replies and all(r.ok and not r.value.job_id for r in replies):
        raise no_job(job_id)


def kill_all(session: Session, grace: float = STOP_GRACE, by: str = "fab kill-all") -> list[Reply]:
    """Stop every process of every job on every node; `by` (one of contract.states.KILLERS) is who
    the job's events and state say stopped it.

    Every node's jobs are marked before any node's are signalled, as a failed start's stop does: a
    trainer that dies because another node's rank was stopped is then read by its agent as stopped by
    `by`, not as a failure of its own (which would write a failure, or restart under on_failure:
    restart). A node the marking pass could not reach is not tried again: it would hold the stop up
    for its connect timeout twice; its reply is that pass's, and the caller names it."""
    payload = {"grace": grace, "by": by}
    with rpc.Channels() as channels:  # both passes ask the same node-side process: one start a node
        marked = session.map(lambda t: channels.call(t, "kill", {**payload, "signal": False}, timeout=60))
        unreached = {r.node: r for r in marked if not r.ok and r.kind == UNREACHABLE}
        stopped = {r.node: r for r in session.map(lambda t: channels.call(t, "kill", payload, timeout=grace + 60,
                                                                          last=True),
                                                  [n for n in session.cluster.nodes if n.name not in unreached])}
    return [unreached.get(n.name) or stopped[n.name] for n in session.cluster.nodes]
