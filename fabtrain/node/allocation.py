"""A node's part of a job inside a Slurm allocation: one step task per node runs this.

    python -m fabtrain.node.allocation <job folder>     (from a deployed runtime)

The batch script (fabtrain/slurm/script.py) writes the plan of every node to
``<job folder>/plan.json``, with `@slurm-node-K@` where node K's address goes,
and a fresh secret for the agents to ``<job folder>/secret`` (never on a
command line), on the filesystem every node shares. Each task finds its node
index (SLURM_NODEID) and the allocation's hosts (`scontrol show hostnames` of
SLURM_JOB_NODELIST, their NodeAddr from `scontrol show node`), fills in the
addresses, the interface gloo/NCCL use and the GPUs Slurm granted, and starts
its processes and the agent through node ops' start: the same launcher, spawn
and agent as on SSH nodes. Then it stays until nothing of the job is left on
its node (Slurm ends a step's processes when its task exits), and exits 0 only
if every process of its node exited 0, so the Slurm job ends FAILED on a
failure and never holds its nodes until the time limit.

A SIGTERM (scancel, `fab kill-all`, another node's task failing under
`srun --kill-on-bad-exit`) stops the node's processes as `fab kill-all` does. Before the time limit the batch shell gets SIGUSR1 and
leaves ``<job folder>/time-limit``; every task then stops its processes the
same way, SIGTERM first so programs can checkpoint. Standard library only.
"""
import os
import platform
import re
import signal
import subprocess
import sys
import time

from fabtrain.contract.states import STOP_GRACE
from fabtrain.node import atomic, attempts, launch, ops, procfs
from fabtrain.node.netcheck import iface_of, resolve
from fabtrain.contract.events import OUTCOMES, EventKind
from fabtrain.contract.clock import boot_id
from fabtrain.contract.jobfolder import JobFolder
from fabtrain.node.elsewhere import running_elsewhere
from fabtrain.node.workspace import job_dir

PLAN = "plan.json"
SECRET = "secret"
TIME_LIMIT = "time-limit"  # left by the batch shell when Slurm's --signal warns of the time limit
KILLED = "killed"  # node ops' marker: the job was stopped on purpose
PLACEHOLDER = re.compile(r"@slurm-node-(\d+)@")
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
POLL = 0.2
AGENT_EXIT_WAIT = 10  # seconds an agent that wrote agent_exit may take to be gone


def scontrol(*args):
    out = subprocess.run(["scontrol"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError("scontrol %s: %s" % (" ".join(args), out.stderr.strip() or out.returncode))
    return out.stdout


def allocation_hosts(nodelist):
    """[(Slurm node name, address)] in the allocation's order (SLURM_NODEID's): NodeAddr, else the name."""
    names = scontrol("show", "hostnames", nodelist).split()
    addresses = {}
    try:
        for line in scontrol("show", "node", "-o", ",".join(names)).splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if fields.get("NodeName"):
                addresses[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    except RuntimeError:
        pass  # a node query refused (a locked-down cluster): the names are the addresses
    return [(n, addresses.get(n, n)) for n in names]


def fill(value, addresses):
    """Every @slurm-node-K@ in a plan value replaced by node K's address."""
    if isinstance(value, str):
        return PLACEHOLDER.sub(lambda m: addresses[int(m.group(1))], value)
    if isinstance(value, list):
        return [fill(v, addresses) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, addresses) for k, v in value.items()}
    return value


def place(env, iface, granted):
    """One process's environment on this node: the interface found, the GPUs Slurm granted."""
    for var in IFACE_VARS:
        if env.get(var, "").startswith("<iface of "):
            if iface:
                env[var] = iface
            else:
                del env[var]  # unknown here: gloo/NCCL choose themselves
    if granted and env.get("CUDA_VISIBLE_DEVICES", "").isdigit():
        # The plan numbers a node's GPUs 0..gpus_per_node-1; Slurm says which ones this job holds.
        env["CUDA_VISIBLE_DEVICES"] = granted[int(env["CUDA_VISIBLE_DEVICES"]) % len(granted)]
    return env


def bind_cpus(processes, cpus, per_rank):
    """Each process of the node its own `per_rank` of the CPUs Slurm bound the step to for each of its ranks
    (`ranks`: torchrun's), as FABTRAIN_CPUS, which the launcher applies, in the node's process order; a process
    beyond the mask keeps the whole of it."""
    at = 0
    for proc in processes:
        want = per_rank * int(proc.get("ranks", 1))
        share = cpus[at:at + want]
        at += want
        if len(share) == want:
            proc["env"][launch.CPUS_ENV] = ",".join(str(c) for c in share)


def node_part(template, index, hosts, secret, environ, cpus=None):
    """(job.json, agent spec) of node `index` of the allocation, from the plan of every node. `cpus`: the CPUs
    Slurm bound this task to (its affinity mask, by default)."""
    addresses = [a for _, a in hosts]
    if len(template["nodes"]) != len(hosts):
        raise RuntimeError("the plan has %d nodes, the allocation %d" % (len(template["nodes"]), len(hosts)))
    part = fill(template["nodes"][index], addresses)
    job, agent = part["job"], part.get("agent")
    if secret:
        job["watchdog"].setdefault("coordinator", {})["secret"] = secret
    own = addresses[index]
    try:
        iface = iface_of(resolve(own))
    except OSError:
        iface = None
    granted = [g for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    for proc in job["processes"]:
        place(proc["env"], iface, granted)
    if template.get("cpus_per_rank"):
        bind_cpus(job["processes"], sorted(os.sched_getaffinity(0)) if cpus is None else cpus,
                  int(template["cpus_per_rank"]))
    job["slurm"] = {"job_id": environ.get("SLURM_JOB_ID"), "node": environ.get("SLURMD_NODENAME") or hosts[index][0],
                    "nodes": [n for n, _ in hosts]}
    # Which machine runs it: a reader elsewhere (fab on the login node) cannot ask /proc about these pids.
    job["machine"] = {"boot_id": boot_id(), "hostname": platform.node()}
    return job, agent


def op_mark_killed(payload):
    """`fab kill-all` on a Slurm job, before scancel: the agents read the marker and call it a kill, not a failure.
    Only a job that still runs is marked: one that ended (finished, failed, stopped for the time limit) keeps
    what happened. `workspaces`: every stand-in's (they share the login node's filesystem: one call marks all).
    The reply names, for each, the Slurm job its job ran as (a script submitted by hand too)."""
    return {"nodes": [mark_killed(ws) for ws in payload.get("workspaces") or [payload["workspace"]]]}


def mark_killed(workspace):
    ws = os.path.abspath(os.path.expanduser(workspace))
    jd = job_dir(ws)
    if not jd or not os.path.isdir(jd):
        return {"marked": None}
    job = atomic.read_json(os.path.join(jd, "job.json"), {})
    slurm = job.get("slurm") if isinstance(job, dict) and isinstance(job.get("slurm"), dict) else {}
    ended = job_over(jd) or not (ops.live_job_processes(jd) or running_elsewhere(jd))
    if not ended:
        open(os.path.join(jd, KILLED), "a").close()
    return {"marked": None if ended else os.path.basename(jd), "slurm_job": slurm.get("job_id")}


class Stop:
    """What ended the node's part early: a SIGTERM, or the time limit's warning."""

    def __init__(self):
        self.signal = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _on_signal(self, signum, frame):
        self.signal = signum


def job_over(jd):
    """The agents already decided how the job ends (failed, finished, kept): a stop now is only its cleanup."""
    return any(ev.get("kind") in OUTCOMES for ev in JobFolder(jd).read_events())


def agent_said_exit(jd, node):
    """This node's agent wrote agent_exit: nothing of the job is left for it to watch."""
    return any(ev.get("kind") == EventKind.AGENT_EXIT and ev.get("node") == node
               for ev in JobFolder(jd).read_events())


def stop_node(ws, node, grace, reason, mark=True):
    """node ops' kill of this node's workspace: SIGTERM, grace, SIGKILL, the `killed` events."""
    result = ops.op_kill({"workspace": ws, "grace": grace, "node": node, "reason": reason, "mark": mark})
    print("stopped (%s): %d processes, %d left" % (reason, len(result["killed"]), len(result["left"])), flush=True)


def wait_for_end(folder, ws, jd, node, grace, stop):
    """Until nothing of the job is left on this node; stops it on a SIGTERM or the time limit's warning."""
    stopped, settled_at, exiting_since = False, None, None
    while True:
        if not stopped and (stop.signal or os.path.exists(os.path.join(folder, TIME_LIMIT))):
            stopped = True
            over = job_over(jd)
            if stop.signal and over:  # another node's task ended first (srun --kill-on-bad-exit)
                reason = "the job's Slurm step ended after the job did"
            elif stop.signal:
                reason = "fab kill-all" if os.path.exists(os.path.join(jd, KILLED)) else \
                    "Slurm ended the allocation (scancel, preemption or a lost node)"
            else:
                reason = "Slurm's time limit is near (scheduler.term_before)"
            # Only the time limit's stop is marked here (kill-all marked before scancel): a step ended by Slurm
            # or by another node's failure is not the user's stop, and must not read as one.
            stop_node(ws, node, grace, reason, mark=not stop.signal)
        live = ops.live_job_processes(jd)
        if live == ["agent"] and agent_said_exit(jd, node):
            exiting_since = exiting_since or time.time()
            if time.time() - exiting_since > AGENT_EXIT_WAIT:  # it said it is done: it must not hold the nodes
                stop_node(ws, node, grace, "the agent had not exited %d s after agent_exit" % AGENT_EXIT_WAIT, False)
        if not live:
            left = procfs.marked(ws, skip=procfs.ancestors())
            settled_at = settled_at or time.time()
            if not left:
                return
            if time.time() - settled_at > grace + 2:  # outlived every launcher: nothing will end it now
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        time.sleep(POLL)


def node_exit_code(jd, job):
    """0 if every process of this node exited 0, else 1 (the Slurm job then ends FAILED)."""
    for proc in job["processes"]:
        if launch.read_exit(JobFolder(jd).exit_record(proc["name"])) != 0:
            return 1
    return 0


def start_attempt(folder, ws, job, template):
    """A requeued job's next Slurm attempt (attempts.py); False: no attempt is left, the job failed here."""
    attempt, allowed = attempts.attempt_of(os.environ), int(template.get("attempts", 1))
    said, refused = attempts.begin(job_dir(ws, job["job_id"]), job["node"], attempt, allowed,
                                   attempts.cause(folder, os.environ.get("SLURM_JOB_ID"), attempt))
    if said:
        attempts.record(folder, attempt, allowed, said)
    if refused:
        print("fabtrain: %s: no attempt left (%s): scheduler.requeue allows %d attempts in all"
              % (job["node"], said, allowed), file=sys.stderr, flush=True)
        return False
    if said:
        print("fabtrain: %s: %s" % (job["node"], said), flush=True)
        attempts.restarts_before(job, attempt)
    return True


def main(argv):
    if len(argv) != 1:
        print("usage: python -m fabtrain.node.allocation <job folder>", file=sys.stderr)
        return 2
    folder = argv[0]
    stop = Stop()
    template = atomic.read_json(os.path.join(folder, PLAN))
    if not isinstance(template, dict):
        print("fabtrain: no plan in %s" % folder, file=sys.stderr)
        return 2
    try:
        with open(os.path.join(folder, SECRET)) as f:
            secret = f.read().strip()
    except OSError:
        secret = None
    index = int(os.environ["SLURM_NODEID"])
    job, agent = node_part(template, index, allocation_hosts(os.environ["SLURM_JOB_NODELIST"]), secret, os.environ)
    ws = os.path.abspath(os.path.expanduser(job["workspace"]))
    print("fabtrain job %s: %s is %s (Slurm node %s)" % (job["job_id"], job["node"], platform.node(),
                                                          job["slurm"]["node"]), flush=True)
    if not start_attempt(folder, ws, job, template):
        return 1
    try:
        started = ops.op_start({"job": job, "roles": template["roles"], "agent": agent})
    except ops.UserFacing as e:
        print("fabtrain: %s: %s" % (job["node"], e), file=sys.stderr)
        return 1
    for failed in started["failed"]:
        print("fabtrain: %s did not start: %s" % (failed["name"], " | ".join(failed["log"])), file=sys.stderr)
    for warning in started["warnings"]:
        print("fabtrain: %s" % warning, file=sys.stderr)
    jd = started["job_dir"]
    wait_for_end(folder, ws, jd, job["node"], float(template.get("grace", STOP_GRACE)), stop)
    return 143 if stop.signal else node_exit_code(jd, job)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
