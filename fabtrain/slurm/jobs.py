"""A job on Slurm: render and submit, wait for the allocation, read Slurm's state, cancel.

fab keeps the Slurm job id beside fabtrain's in the controller's state. Slurm's
state is read from squeue while the job is queued or running, then from
`scontrol show job` (until MinJobAge), and only then from sacct, where
accounting is on. Everything about the processes (status, logs, the
dashboard) is read from the node workspaces on the shared filesystem, as for
SSH nodes.
"""
from __future__ import annotations

import json
import re
import secrets
import threading
import time
from dataclasses import dataclass

from fabtrain.contract.jobfolder import SlurmFolder
from fabtrain.contract.states import KILLERS, STOP_GRACE
from fabtrain.controller import preflight, state, terminal
from fabtrain.errors import UserError
from fabtrain.contract import slurm as slurm_output
from fabtrain.plan.plan import Plan, make_plan, new_job_id
from fabtrain.remote import rpc
from fabtrain.remote.transport import NodeError
from fabtrain.remote.session import Session
from fabtrain.slurm import allocports
from fabtrain.slurm.commands import TOOLS, SlurmCommands
from fabtrain.slurm.script import absolute as script_absolute, job_folder, job_name, render, sbatch_options

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE")
ID_RE = re.compile(r"^\d+(_\d+)?$")


@dataclass(frozen=True)
class SlurmState:
    job: str  # Slurm's job id
    state: str  # PENDING, RUNNING, COMPLETED, ... or UNKNOWN
    reason: str = ""  # why it is pending (Resources, Priority, PartitionConfig, ...), or how it ended
    nodes: str = ""
    exit_code: str = ""
    source: str = "squeue"

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def line(self) -> str:
        why = f" ({self.reason})" if self.reason and self.reason not in ("None", "(null)") else ""
        where = f" on {self.nodes}" if self.nodes and self.nodes != "(null)" and self.state == "RUNNING" else ""
        code = f", exit code {self.exit_code}" if self.exit_code and self.ended else ""
        return f"slurm job {self.job}: {self.state}{why}{where}{code}"


@dataclass
class Submitted:
    job_id: str
    slurm_job: str | None  # None: only recorded (start-pserver waits for start-trainers)
    plan: Plan
    script: str
    state: SlurmState | None = None


def prepare(session: Session, roles: tuple[str, ...], job_id: str | None = None,
            resume_from: str | None = None, readable: bool = False) -> tuple[Plan, str]:
    """The plan and its batch script, with `auto` ports left to the allocation to draw (no node is there to
    ask before it; the plan's own are stand-ins). `readable`: the plan's data summarised (fab plan)."""
    cluster = session.cluster
    job_id = job_id or new_job_id()
    network = preflight.choose_ports(cluster, {})
    plan = make_plan(cluster, job_id, resume_from=resume_from, network=network)
    # An `auto` port is drawn in the allocation (slurm/allocports.py): the plan made again with it moved
    # shows where it goes.
    moved = {s: make_plan(cluster, job_id, resume_from=resume_from, network=allocports.shifted(network, s))
             for s in network.auto}
    return plan, render(cluster, plan, roles, SlurmCommands(session).home(), grace=cluster.job.watchdog.grace,
                        readable=readable, moved=moved)


def make_job_folder(session: Session, job_id: str) -> str:
    """The job's folder on the shared filesystem: Slurm opens --output there before the script runs."""
    commands = SlurmCommands(session)
    folder = job_folder(session.cluster, job_id, commands.home())
    out = commands.run(["mkdir", "-p", "-m", "700", "--", folder])
    if not out.ok:
        raise UserError(f"cannot make the job's folder {folder}: {out.error()}")
    return folder


def submit(session: Session, roles: tuple[str, ...], resume_from: str | None = None,
           force: bool = False) -> Submitted:
    """start-pserver / start-trainers: one Slurm job holding every role.

    In pserver mode start-pserver only records the new job; the start-trainers
    after it submits the one allocation that runs pservers and trainers.
    """
    cluster = session.cluster
    previous = state.load(cluster.name)
    if cluster.job.mode == "collective" and "pserver" in roles:
        raise UserError(f"{cluster.path}: job.mode is collective: there are no pservers to start; run fab start-trainers")
    if "pserver" in roles or cluster.job.mode == "collective":
        job_id = new_job_id()
    elif previous.get("roles") == ["pserver"] and not previous.get("slurm_job"):
        job_id, resume_from = previous["job_id"], previous.get("resume_from")
    else:
        raise UserError("no job is waiting for trainers: run `fab start-pserver start-trainers` to start a new job")
    # The next job works in the same node workspaces: one job of the cluster at a time, as on SSH nodes.
    queued = our_jobs(session, {current(session)} - {None})
    if queued and force:
        cancel_all(session)
    elif queued:
        raise UserError(f"slurm job {', '.join(queued)} of this cluster is still queued or running; "
                        "stop it with `fab kill-all` or pass --force")
    every = ("pserver", "trainer") if cluster.job.mode == "pserver" else ("trainer",)
    plan, script = prepare(session, every, job_id, resume_from)
    if cluster.job.mode == "pserver" and "trainer" not in roles:
        state.save(cluster.name, job_id=job_id, roles=["pserver"], cluster=cluster.path, resume_from=resume_from)
        return Submitted(job_id, None, plan, script)
    make_job_folder(session, job_id)
    out = SlurmCommands(session).run(["sbatch", "--parsable"], stdin=script)
    if not out.ok:
        raise UserError(f"sbatch refused the job: {out.error()}")
    slurm_job = out.stdout.strip().split(";")[0]
    if not ID_RE.match(slurm_job):
        raise UserError(f"sbatch answered {out.stdout.strip()[:80]!r}, not a job id")
    record_jobs(session, recorded_jobs(session) + [slurm_job])
    state.save(cluster.name, job_id=job_id, roles=list(every), cluster=cluster.path, resume_from=resume_from,
               slurm_job=slurm_job, network={"ports": drawn_at_submit(plan), "auto": list(plan.auto_ports), "ifaces": {}})
    return Submitted(job_id, slurm_job, plan, script)


def drawn_at_submit(plan: Plan) -> dict:
    """The plan's ports as the controller knows them: an `auto` one is drawn in the allocation (None here)."""
    return {k: None if k in plan.auto_ports else v for k, v in plan.ports.items()}


def slurm_state(session: Session, slurm_job: str) -> SlurmState:
    """Slurm's word on one job: squeue, then scontrol, then sacct where accounting is on."""
    run = SlurmCommands(session).run
    out = run(["squeue", "-h", "-j", slurm_job, "-o", "%T|%r|%N"])
    if out.ok and out.stdout.strip():
        st, reason, nodes = (out.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return SlurmState(slurm_job, st, reason, nodes)
    out = run(["scontrol", "show", "job", "-o", slurm_job])
    if out.ok and out.stdout.strip():
        fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
        return SlurmState(slurm_job, fields.get("JobState", "UNKNOWN"), fields.get("Reason", ""),
                          fields.get("NodeList", ""), fields.get("ExitCode", ""), "scontrol")
    out = run(["sacct", "-n", "-X", "-P", "-j", slurm_job, "-o", "State,ExitCode,NodeList"])
    if out.ok and out.stdout.strip():
        st, code, nodes = (out.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return SlurmState(slurm_job, st.split()[0], "", nodes, code, "sacct")
    return SlurmState(slurm_job, "UNKNOWN", "no longer in squeue or scontrol, and accounting is off", source="none")


def shown_line(session: Session, ran: set[tuple[str, str]], job_id: str | None = None) -> str | None:
    """Slurm's state of the job a view shows (`fab status`, `fab watch`, the dashboard), as one line.

    `ran` is the (fabtrain job, Slurm job) pairs the nodes name (a script submitted by hand too); before the
    job runs, the controller's state names it. `job_id` limits it to one fabtrain job. None: no Slurm job known.
    """
    shown = _shown(session, ran, job_id)
    return shown[1] if shown else None


def _shown(session: Session, ran: set[tuple[str, str]], job_id: str | None) -> tuple[SlurmState, str] | None:
    ran = set(ran)
    saved = state.load(session.cluster.name)
    if saved.get("slurm_job") and saved.get("job_id") and (job_id in (None, saved["job_id"])):
        ran.add((saved["job_id"], saved["slurm_job"]))
    if not ran:
        return None
    # Job ids sort by their start: the newest is the one shown, or the one still waiting for its allocation.
    job, slurm_job = max(ran)
    st = slurm_state(session, slurm_job)
    line = st.line()
    if st.state == "NODE_FAIL":
        lost = lost_node(session, job, slurm_job)
        line += f" (node {lost} failed)" if lost else ""
    attempt = current_attempt(session, job)
    if attempt:
        line += f"; {attempt}"
    if stopped_for_time_limit(session, job):
        line += f" (its programs were stopped {session.cluster.scheduler.term_before} s before its time limit)"
    return st, line


class ShownLine:
    """`shown_line` for a view that redraws every second (fab watch, the dashboard): Slurm is asked at most
    every `every` seconds, or when the nodes name another job, as each ask runs squeue (over SSH, a round trip).
    `waiting`: Slurm's job has not ended (queued, or running but its nodes have not started fabtrain's job yet
    when no node has it), so a view that finds no job on any node waits instead of giving up."""

    def __init__(self, session: Session, every: float = 5.0):
        self.session, self.every = session, every
        self.waiting = False
        self._lock = threading.Lock()
        self._asked: tuple | None = None
        self._line: str | None = None
        self._at = 0.0

    def __call__(self, snap) -> str | None:
        """The line for a collector's Snapshot."""
        ran = frozenset((n.job_id, n.slurm_job) for n in snap.nodes if n.job_id and n.slurm_job)
        asked = (snap.job_id, ran)
        with self._lock:
            if asked != self._asked or time.monotonic() - self._at >= self.every:
                try:
                    shown = _shown(self.session, set(ran), snap.job_id)
                    self._line, self.waiting = (shown[1], not shown[0].ended) if shown else (None, False)
                except UserError as e:  # a login node that stopped answering: said, not raised into the view
                    self._line = f"slurm: {e}"
                self._asked, self._at = asked, time.monotonic()
            return self._line


def wait_for_allocation(session: Session, slurm_job: str, show, timeout: float | None = None,
                        interval: float = 0.5) -> SlurmState:
    """Until the job runs or ends: show(line, final) on every change (a live PENDING line, then RUNNING)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    while True:
        st = slurm_state(session, slurm_job)
        done = st.state == "RUNNING" or st.ended or (deadline is not None and time.monotonic() > deadline)
        if st.line() != last or done:
            show(st.line(), done)
            last = st.line()
        if done:
            return st
        time.sleep(interval)


def current(session: Session, job_id: str | None = None) -> str | None:
    """The Slurm job of fabtrain's current job (or of `job_id`), from the controller's state."""
    saved = state.load(session.cluster.name)
    if job_id and saved.get("job_id") != job_id:
        return None
    return saved.get("slurm_job")


def submitted_job(session: Session) -> str | None:
    """fabtrain's job id of the Slurm job fab submitted last (None: none, or pserver mode's recorded half)."""
    saved = state.load(session.cluster.name)
    return saved.get("job_id") if saved.get("slurm_job") else None


SUBMITTED = ".slurm"  # the controller's file of this cluster's Slurm job ids: {"jobs": [...]}
LIVE_STATES = "PENDING,RUNNING,SUSPENDED,CONFIGURING,REQUEUED,REQUEUE_HOLD,REQUEUE_FED,RESIZING"


def recorded_jobs(session: Session) -> list[str]:
    """The Slurm jobs this cluster's fabtrain jobs were submitted as, not yet seen ended (the controller's state)."""
    jobs = state.load_file(session.cluster.name, SUBMITTED).get("jobs")
    return [j for j in jobs if isinstance(j, str) and ID_RE.match(j)] if isinstance(jobs, list) else []


def record_jobs(session: Session, jobs: list[str]) -> None:
    state.save_file(session.cluster.name, SUBMITTED, {"jobs": sorted(set(jobs), key=_order)})


def _order(slurm_job: str) -> tuple[int, str]:
    return int(slurm_job.split("_")[0]), slurm_job


def our_jobs(session: Session, also: set[str] = frozenset()) -> list[str]:
    """Which of the Slurm jobs this cluster submitted (and `also`: those its nodes name) are queued or running.
    By id, never by name: a job of the same name submitted from elsewhere is not this cluster's."""
    ids = sorted(set(recorded_jobs(session)) | set(also), key=_order)
    if not ids:
        return []
    out = SlurmCommands(session).run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i", "-t", LIVE_STATES])
    if not out.ok and "Invalid job id" not in out.stderr:
        raise UserError(f"squeue: {out.error()}")
    live = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if not out.ok:  # an id Slurm forgot (MinJobAge) fails the whole list: ask for each one alone
        live = [j for j in ids if slurm_state(session, j).state in LIVE_STATES.split(",")]
    record_jobs(session, [j for j in recorded_jobs(session) if j in live])
    return live


@dataclass
class Cancelled:
    jobs: list[SlurmState]
    marked: list[str]  # nodes whose job was marked as killed on purpose
    left: list[str]  # Slurm jobs still not ended when fab stopped waiting


def cancel_all(session: Session, grace: float = STOP_GRACE, wait: float = 60.0, by: str = KILLERS[0]) -> Cancelled:
    """fab kill-all (or the dashboard's Kill, `by`): mark the job killed on every node where it still runs (the
    agents read it), scancel this cluster's Slurm jobs by id, wait until Slurm says they ended. A job that already
    ended keeps its outcome."""
    nodes = session.cluster.nodes  # stand-ins on one filesystem, reached the same way: one call marks them all
    try:
        said = rpc.call(session.transport(nodes[0]), "mark_killed",
                        {"workspaces": [n.workspace for n in nodes], "by": by}, timeout=60).nodes
    except NodeError as e:
        raise UserError(f"kill-all: cannot mark the job killed in the workspaces ({e}); nothing was cancelled") from None
    marked = [n.name for n, r in zip(nodes, said) if r.marked]
    named = {r.slurm_job for r in said if r.slurm_job and ID_RE.match(r.slurm_job)}
    ids = our_jobs(session, named)
    if ids:
        out = SlurmCommands(session).run(["scancel", *ids])
        if not out.ok and "already completing or completed" not in out.stderr:
            raise UserError(f"scancel: {out.error()}")
    deadline = time.monotonic() + grace + wait
    while True:
        states = [slurm_state(session, j) for j in ids]
        left = [s.job for s in states if not s.ended and s.state != "UNKNOWN"]
        if not left or time.monotonic() > deadline:
            record_jobs(session, [j for j in recorded_jobs(session) if j in left])
            return Cancelled(states, marked, left)
        time.sleep(0.1)


def lost_node(session: Session, job_id: str, slurm_job: str) -> str | None:
    """The Slurm node srun said it lost (`srun: error: Node failure on n3`, in the job's output), or None."""
    commands = SlurmCommands(session)
    out = commands.run(["grep", "-h", "--", slurm_output.NODE_FAILURE,
                        f"{job_folder(session.cluster, job_id, commands.home())}/slurm-{slurm_job}.out"])
    lost = slurm_output.lost_node(out.stdout) if out.ok else None
    return terminal.visible(lost) if lost else None


def _folder_json(session: Session, job_id: str, name: str) -> dict:
    """A JSON object the job's Slurm attempts leave in its folder, as the controller reaches it; {}: none yet,
    or not an object."""
    commands = SlurmCommands(session)
    out = commands.run(["cat", "--", f"{job_folder(session.cluster, job_id, commands.home())}/{name}"])
    try:
        said = json.loads(out.stdout) if out.ok else None
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


def current_attempt(session: Session, job_id: str) -> str | None:
    """"attempt 2 of 4: requeued after preemption" once a requeued job's next Slurm attempt started, else None."""
    said = _folder_json(session, job_id, slurm_output.ATTEMPT_FILE).get("line")
    return terminal.visible(said) if isinstance(said, str) else None


def drawn_ports(session: Session, job_id: str) -> dict:
    """{setting: port} the allocation drew for the job's `auto` ports (its ports.json, the attempt running
    or the last); {} before the draw, or from a file that does not say ports."""
    ports = _folder_json(session, job_id, slurm_output.DRAWN_PORTS_FILE).get("ports")
    if not isinstance(ports, dict):
        return {}
    return {k: v for k, v in ports.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            and 1 <= v <= 65535}


def stopped_for_time_limit(session: Session, job_id: str) -> bool:
    """The batch shell got Slurm's warning (--signal) and every node stopped its programs."""
    commands = SlurmCommands(session)
    return commands.run(["test", "-e", SlurmFolder(job_folder(session.cluster, job_id, commands.home())).time_limit]).ok


def check_tools(session: Session) -> list[str]:
    """Problems with the scheduler for `fab check`: its commands, the partition, enough nodes."""
    spec, commands, problems = session.cluster.scheduler, SlurmCommands(session), []
    for tool in TOOLS:
        try:
            commands.run([tool, "--version"])
        except UserError as e:
            problems.append(str(e))
    if problems:
        return problems
    out = commands.run(["scontrol", "show", "partition", "-o", *([spec.partition] if spec.partition else [])])
    if not out.ok or not out.stdout.strip():
        problems.append(f"partition {spec.partition or '(default)'}: {out.error() if not out.ok else 'not found'}")
        return problems
    parts = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.stdout.splitlines()]
    part = next((p for p in parts if not spec.partition and p.get("Default") == "YES"), parts[0])
    total = int(part.get("TotalNodes", "0") or 0)
    if total < spec.nodes:
        problems.append(f"scheduler.nodes is {spec.nodes} but partition {part.get('PartitionName')} has {total} "
                        "nodes: the job would stay PENDING")
    return problems


# Run by the cluster's python on every node of a short allocation (fab check): the token written on the login node,
# the interpreter, the frameworks' versions, and which of the job's programs its PATH lacks. One JSON line a node.
NODE_CHECK = """
import json, os, platform, shutil, sys
from importlib import metadata
def version(*dists):
    for d in dists:
        try:
            return metadata.version(d)
        except Exception:
            pass
programs = json.loads(sys.argv[2])
path = os.environ.get("PATH", "")
print(json.dumps({"token": open(sys.argv[1]).read(), "node": os.environ.get("SLURMD_NODENAME"),
                  "python": platform.python_version(), "torch": version("torch"),
                  "paddle": version("paddlepaddle", "paddlepaddle-gpu"),
                  "missing": [p for p, where in programs if not shutil.which(p, path=where.replace("$PATH", path))]}))
"""


@dataclass
class NodesCheck:
    problems: list[str]
    said: str  # what every node answered (or that no allocation was free to ask), when nothing is wrong


def frameworks(commands: list[str]) -> list[str]:
    """The frameworks the job's commands use: torch (torchrun, torch.distributed, the reference workload), paddle."""
    text = " ".join(commands)
    used = []
    if "torch" in text or "workload." in text:
        used.append("torch")
    if "paddle" in text:
        used.append("paddle")
    return used


def check_nodes(session: Session, wait: int = 10) -> NodesCheck:
    """What the start needs, asked of every node of a short allocation (`srun --immediate`): a token written here
    read there (the shared filesystem fabtrain assumes), the cluster's python at the same path, the frameworks
    the commands use (one version on every node), and each process's program on its PATH."""
    cluster, commands = session.cluster, SlurmCommands(session)
    folder = f"{job_folder(cluster, 'check', commands.home())}"
    token = secrets.token_hex(8)
    python = script_absolute(cluster.nodes[0].python, commands.home())
    made = commands.run(["sh", "-c", 'mkdir -p -m 700 "$1" && printf %s "$2" > "$1/token"', "sh", folder, token])
    if not made.ok:
        return NodesCheck([f"cannot write {folder}/token: {made.error()}"], "")
    plan = make_plan(cluster, "check", network=preflight.choose_ports(cluster, {}))
    # A program named by a relative path is found from the job's code folder at the start: not asked here.
    programs = sorted({(p.argv[0], script_absolute(p.env.get("PATH", "$PATH"), commands.home()).replace(
        ":~/", f":{commands.home()}/")) for n in plan.nodes for p in n.processes
        if "/" not in p.argv[0] or p.argv[0].startswith("/")})
    spec = cluster.scheduler
    argv = ["srun", f"--nodes={spec.nodes}", "--ntasks-per-node=1", f"--immediate={wait}", f"--job-name={job_name(cluster)}-check",
            *([f"--partition={spec.partition}"] if spec.partition else []),
            *([f"--account={spec.account}"] if spec.account else []), "--time=1",
            python, "-I", "-c", NODE_CHECK, f"{folder}/token", json.dumps(programs)]
    out = commands.run(argv, timeout=wait + 60)
    if not out.ok:
        if "Unable to allocate resources" in out.stderr or "Immediate" in out.stderr:
            return NodesCheck([], f"nodes not checked: {spec.nodes} nodes were not free within {wait} s")
        return NodesCheck([f"{python} on the compute nodes could not read {folder}/token: {out.error()}"], "")
    seen = []
    for line in out.stdout.splitlines():
        try:
            said = json.loads(line)
        except ValueError:
            continue
        if isinstance(said, dict) and isinstance(said.get("missing"), list):
            seen.append(said)
    shared = sum(s.get("token") == token for s in seen)
    if len(seen) != spec.nodes or shared != spec.nodes:
        return NodesCheck([f"{folder} is not shared with the compute nodes: {shared} of {spec.nodes} read the token "
                           "written here (fabtrain needs the workspace on a shared filesystem)"], "")
    problems = []
    commands_ = [cluster.job.trainer.command] + (
        [cluster.job.pserver.command] if cluster.job.mode == "pserver" else [])
    for s in seen:
        node = terminal.visible(str(s.get("node")))
        for program in s["missing"]:
            problems.append(f"{terminal.visible(str(program))} is not on the PATH of {python} on {node}: the job's "
                            "start would fail there (install it into that environment, or set cluster.python)")
        for framework in frameworks(commands_):
            if not s.get(framework):
                problems.append(f"{framework} is not installed for {python} on {node} (the command uses it)")
    said = [f"python {seen[0].get('python')}"]
    for key in ("python", "torch", "paddle"):
        versions = sorted({str(s.get(key)) for s in seen})
        if len(versions) > 1:
            problems.append(f"{key} differs across the nodes: " + ", ".join(
                f"{terminal.visible(str(s.get('node')))} {terminal.visible(str(s.get(key)))}" for s in seen))
        elif key != "python" and seen[0].get(key):
            said.append(f"{key} {terminal.visible(str(seen[0][key]))}")
    return NodesCheck(problems, f"the workspace is shared: every node read a token written here, with {python} "
                                f"({', '.join(said)}), and found the job's programs")


def check_resources(session: Session) -> list[str]:
    """What the job asks of each node (CPUs, memory, GPUs of a type) against the partition's nodes (sinfo):
    fewer nodes that have it than scheduler.nodes means the job would stay PENDING."""
    cluster, spec = session.cluster, session.cluster.scheduler
    plan = make_plan(cluster, "check", network=preflight.choose_ports(cluster, {}))
    options = dict(o.split("=", 1) if "=" in o else (o, "") for o in sbatch_options(cluster, "", plan))
    cpus = int(options.get("--cpus-per-task", "0") or 0)
    mem = _megabytes(spec.mem_per_node) if spec.mem_per_node else 0
    if not (cpus or mem or spec.gpus_per_node):
        return []
    out = SlurmCommands(session).run(["sinfo", "-h", "-N", "-o", "%N|%c|%m|%G|%P",
                                      *([f"--partition={spec.partition}"] if spec.partition else [])])
    if not out.ok:
        return [f"sinfo: {out.error()}"]
    nodes = {}
    for line in out.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 5 and (spec.partition or fields[4].endswith("*")):
            nodes[fields[0]] = fields
    short = []
    if cpus:
        fit = [n for n, f in nodes.items() if f[1].isdigit() and int(f[1]) >= cpus]
        if len(fit) < spec.nodes:
            short.append(f"{cpus} CPUs (scheduler.cpus_per_rank x its processes)")
    if mem:
        fit = [n for n, f in nodes.items() if f[2].rstrip("+").isdigit() and int(f[2].rstrip("+")) >= mem]
        if len(fit) < spec.nodes:
            short.append(f"{spec.mem_per_node} of memory")
    if spec.gpus_per_node:
        fit = [n for n, f in nodes.items() if _gpus(f[3], spec.gpu_type) >= spec.gpus_per_node]
        if len(fit) < spec.nodes:
            short.append(f"{spec.gpus_per_node} GPUs" + (f" of type {spec.gpu_type}" if spec.gpu_type else ""))
    if not short:
        return []
    return [f"scheduler: the job asks each of {spec.nodes} nodes for {' and '.join(short)}, but fewer nodes of "
            f"partition {spec.partition or '(default)'} have that: the job would stay PENDING"]


def _megabytes(size: str) -> int:
    unit = size[-1] if size[-1] in "KMGT" else "M"
    number = int(size.rstrip("KMGT"))
    return {"K": number // 1024, "M": number, "G": number * 1024, "T": number * 1024 * 1024}[unit]


def _gpus(gres: str, kind: str | None) -> int:
    """GPUs of `kind` (any kind: None) in sinfo's %G: "gpu:fake:2(S:0),gpu:a100:4" -> 2 for fake."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        parts = item.split("(")[0].split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if count.isdigit() and (kind is None or (len(parts) == 3 and parts[1] == kind)):
            total += int(count)
    return total


def describe(submitted: Submitted) -> str:
    if submitted.slurm_job is None:
        return (f"job {submitted.job_id}: recorded; `fab start-trainers` submits it to Slurm with its pservers "
                "(one allocation for both)")
    return f"job {submitted.job_id}: submitted as slurm job {submitted.slurm_job}"
