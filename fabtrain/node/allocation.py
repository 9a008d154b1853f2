"""A node's part of a job inside a Slurm allocation: one step task per node runs this.

    python -m fabtrain.node.allocation <job folder>     (from a deployed runtime)

The batch script (fabtrain/slurm/script.py) writes the plan of every node to
``<job folder>/plan.json``, with `@slurm-node-K@` where node K's address goes,
and a fresh secret for the agents to ``<job folder>/secret`` (never on a
command line), on the filesystem every node shares. Each task finds its node
index (SLURM_NODEID) and the allocation's hosts (`scontrol show hostnames` of
SLURM_JOB_NODELIST, their NodeAddr from `scontrol show node`), fills in the
addresses, the `auto` ports drawn in the allocation (each task reports its
node's busy ports and node 0's task draws them, ``ports.json``:
fabtrain/node/allocports.py), the interface gloo/NCCL use and the GPUs Slurm
granted: that is
the Slurm adapter (`SlurmStep`) of THE hosted supervisor (node/hosted.py),
which starts the part through node ops' start (the same launcher, spawn and
agent as on SSH nodes), stays until nothing of the job is left on its node
(Slurm ends a step's processes when its task exits), and exits with the
agents' verdict: 0 when the job finished (COMPLETED, pserver mode included),
1 when it failed (FAILED: the allocation is never held until the time limit).

What a SIGTERM means is said in one place, `sigterm_cause`: `fab kill-all`
(marked before scancel), Slurm's time limit (the batch shell's USR1 leaves
``<job folder>/time-limit`` first, and every task then stops its processes,
SIGTERM first so programs can checkpoint), or Slurm's own doing (a
preemption, a requeue, a lost node, a scancel by hand), which ends the job
with that cause. Standard library only.
"""
import json
import os
import platform
import re
import subprocess
import sys

from fabtrain.contract import portdraw, states
from fabtrain.contract.clock import boot_id
from fabtrain.contract.events import OUTCOMES
from fabtrain.contract.jobfolder import JobFolder, SlurmFolder
from fabtrain.contract.opreplies import Marked, MarkKilled
from fabtrain.contract.states import ENDED, KILLERS, killed_marker, read_killer
from fabtrain.node import allocports, atomic, attempts, hosted, launch, ops
from fabtrain.node.elsewhere import running_elsewhere
from fabtrain.node.netcheck import iface_of, resolve
from fabtrain.node.workspace import job_dir

PLACEHOLDER = re.compile(r"@slurm-node-(\d+)@")
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def scontrol(*args, timeout=60):
    out = subprocess.run(["scontrol"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=timeout)
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


def node_part(template, index, hosts, secret, environ, cpus=None, ports=None):
    """(job.json, agent spec) of node `index` of the allocation, from the plan of every node. `cpus`: the CPUs
    Slurm bound this task to (its affinity mask, by default); `ports`: the `auto` ports drawn in the
    allocation (allocports.py), for the plan's port tokens."""
    addresses = [a for _, a in hosts]
    if len(template["nodes"]) != len(hosts):
        raise RuntimeError("the plan has %d nodes, the allocation %d" % (len(template["nodes"]), len(hosts)))
    part = portdraw.fill(fill(template["nodes"][index], addresses), ports or {})
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
    The reply names, for each, the Slurm job its job ran as (a script submitted by hand too). `by`: who stops it
    (contract/states.py KILLERS: `fab kill-all`, the dashboard's Kill button)."""
    by = payload.get("by") if payload.get("by") in KILLERS else KILLERS[0]
    return MarkKilled(nodes=[mark_killed(ws, by) for ws in payload.get("workspaces") or [payload["workspace"]]]).wire()


def mark_killed(workspace, by=KILLERS[0]):
    ws = os.path.abspath(os.path.expanduser(workspace))
    jd = job_dir(ws)
    if not jd or not os.path.isdir(jd):
        return Marked()
    job = atomic.read_json(JobFolder(jd).job_json, {})
    slurm = job.get("slurm") if isinstance(job, dict) and isinstance(job.get("slurm"), dict) else {}
    slurm_job = slurm.get("job_id") if isinstance(slurm.get("job_id"), str) else None
    decided = any(ev.get("kind") in OUTCOMES for ev in JobFolder(jd).read_events())
    ended = decided or not (ops.live_job_processes(jd) or running_elsewhere(jd))
    if not ended and read_killer(JobFolder(jd).killed) is None:  # a stop already marked keeps its word
        atomic.write(JobFolder(jd).killed, killed_marker(by))
    return Marked(marked=None if ended else os.path.basename(jd), slurm_job=slurm_job)


def job_over(jd, node):
    """The agents already decided how the job ends here (failed, finished, kept): a stop now is only its cleanup."""
    return hosted.outcome(jd, node) is not None


# What squeue and scontrol say of a job whose processes Slurm is signalling, by the moment they are asked.
ENDING = ("CANCELLED", "COMPLETING", "COMPLETED", "FAILED")


def slurm_job_state(slurm_job):
    """(state, reason, preempted) of the allocation's job as slurmctld has it now; ("", "", False) if it cannot
    say. While the job's processes are being signalled its state reads COMPLETING, whatever ended it:
    `squeue --json` also says whether (preempt_time) it was preempted; scontrol is the fallback."""
    try:
        out = subprocess.run(["squeue", "--json", "-j", slurm_job], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             universal_newlines=True, timeout=10)
        jobs = json.loads(out.stdout).get("jobs") if out.returncode == 0 else None
        if jobs and isinstance(jobs[0], dict):
            job = jobs[0]
            state, preempted = job.get("job_state", ""), job.get("preempt_time")
            if isinstance(state, list):  # Slurm 23.02 on: the base state and its flags
                state = next((str(f) for f in state if f != "COMPLETING"), "COMPLETING")
            if isinstance(preempted, dict):  # 23.02 on: {"set", "number"}
                preempted = preempted.get("set") and preempted.get("number")
            return str(state), str(job.get("state_reason", "")), bool(preempted)
    except (OSError, ValueError, AttributeError, subprocess.SubprocessError):
        pass
    try:
        fields = dict(f.split("=", 1) for f in scontrol("show", "job", "-o", slurm_job, timeout=10).split() if "=" in f)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return "", "", False
    return fields.get("JobState", ""), fields.get("Reason", ""), fields.get("PreemptTime", "None") not in ("None", "")


def slurm_cause(state, reason, preempted=False):
    """What Slurm did to the job, in words, from its state, reason and preemption at the SIGTERM."""
    if preempted or state == "PREEMPTED" or "preempt" in reason.lower():
        return "preempted by Slurm"
    if state.startswith("REQUEUE") or state == "PENDING":
        return "requeued by Slurm"
    if state == "NODE_FAIL" or reason in ("NodeDown", "NodeFail"):
        return "a node of the allocation failed (Slurm: NODE_FAIL)"
    if state == "TIMEOUT" or reason == "TimeLimit":
        return "Slurm's time limit"
    if state == "RUNNING":  # the job goes on: its step ended (srun --kill-on-bad-exit, another node's part failed)
        return "ended with the job's Slurm step (another node's part ended first)"
    if state in ENDING:  # the batch shell waits for the step: the job ends early for no reason Slurm names
        return "cancelled in Slurm (scancel)"
    return "ended by Slurm (%s)" % (state or "its state could not be read")


def sigterm_cause(folder, jd, node, slurm_job):
    """THE place that says what a SIGTERM to a step task means (a hosted.Stop), in this order:
    - the job's `killed` marker: the user's stop (`fab kill-all` marks before scancel). It comes first: it
      is only written while the job runs (mark_killed), and scancel's SIGTERM reaches every process of
      the step in turn, so the agents may have ended the job on the marker (their programs signalled
      first) before this task reads it;
    - the agents already ended the job: another node's task ended first (srun --kill-on-bad-exit);
    - the time-limit file: Slurm's time limit (the batch shell's warning came first);
    - otherwise Slurm's own doing, read from slurmctld (scontrol show job): a preemption, a requeue, a
      node failure, a scancel by hand. It ends the job with that cause (the `disrupted` marker, ENDED): never
      the user's stop, never a program's failure."""
    who = read_killer(JobFolder(jd).killed)
    if who:
        return hosted.Stop(who, by=who)
    if job_over(jd, node):
        return hosted.Stop("the job's Slurm step ended after the job did")
    if os.path.exists(SlurmFolder(folder).time_limit):
        return time_limit_stop()
    return hosted.Stop(slurm_cause(*slurm_job_state(slurm_job)), disruption=ENDED)


def time_limit_stop():
    return hosted.Stop("Slurm's time limit is near (scheduler.term_before)", by=states.TIME_LIMIT, mark=True)


class SlurmStep(hosted.Host):
    """A step task of the allocation (srun, one a node): what Slurm gives the node's part."""
    NAME = "slurm step"

    def __init__(self, folder, environ):
        self.folder, self.environ = folder, environ
        self.node = None

    def part(self):
        template = atomic.read_json(SlurmFolder(self.folder).plan)
        if not isinstance(template, dict):
            raise SystemExit("fabtrain: no plan in %s" % self.folder)
        try:
            with open(SlurmFolder(self.folder).secret) as f:
                secret = f.read().strip()
        except OSError:
            secret = None
        index = int(self.environ["SLURM_NODEID"])
        job, agent = node_part(template, index, allocation_hosts(self.environ["SLURM_JOB_NODELIST"]), secret,
                               self.environ, ports=allocports.report_and_draw(self.folder, self.environ, template))
        self.node = job["node"]
        print("fabtrain job %s: %s is %s (Slurm node %s)" % (job["job_id"], job["node"], platform.node(),
                                                              job["slurm"]["node"]), flush=True)
        if not start_attempt(self.folder, os.path.abspath(os.path.expanduser(job["workspace"])), job, template,
                             self.environ):
            raise SystemExit(1)
        return job, agent, template["roles"]

    def sigterm(self, jd):
        return sigterm_cause(self.folder, jd, self.node, self.environ.get("SLURM_JOB_ID", ""))

    def warned(self, jd):
        return time_limit_stop() if os.path.exists(SlurmFolder(self.folder).time_limit) else None


def start_attempt(folder, ws, job, template, environ):
    """A requeued job's next Slurm attempt (attempts.py); False: no attempt is left, the job failed here."""
    attempt, allowed = attempts.attempt_of(environ), int(template.get("attempts", 1))
    said, refused = attempts.begin(job_dir(ws, job["job_id"]), job["node"], attempt, allowed,
                                   attempts.cause(folder, environ.get("SLURM_JOB_ID"), attempt))
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
    return hosted.run(SlurmStep(argv[0], os.environ))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
