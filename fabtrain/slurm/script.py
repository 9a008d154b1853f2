"""The batch script of a job: what `fab plan` prints, `fab export --slurm` writes and `fab start-*` submits.

Pure: a Cluster (with `scheduler:`) and its Plan in, text out. The script
holds the plan of every node (addresses left as @slurm-node-K@, `auto` ports
as tokens, for the allocation to fill in: its step tasks draw them,
fabtrain/node/allocports.py) but no secret: the batch shell draws the agents'
secret into a 0600 file when the job starts. It runs one step task a
node, `python -m fabtrain.node.allocation <job folder>`, from the deployed
runtime, and passes Slurm's time-limit warning (SIGUSR1 to the batch shell,
`--signal=B:USR1@term_before`) on as the job folder's `time-limit` file.

The job is submitted `--no-requeue` unless `scheduler.requeue` allows more
Slurm attempts; each attempt runs this script again (SLURM_RESTART_COUNT),
and fabtrain/node/attempts.py makes it the next attempt of the same job.
With `continue_after_time_limit` the shell requeues the job itself once the
programs stopped for the time limit (`requeue-cause-<K>` says why to the next
attempt) instead of idling the nodes until Slurm's TIMEOUT.
"""
from __future__ import annotations

import json
import posixpath
import shlex

from fabtrain.contract.jobfolder import BUSY, CAUSE, DRAWN_PORTS, OUTPUT, PLAN, SECRET, TIME_LIMIT
from fabtrain.contract.states import STOP_GRACE
from fabtrain.config.cluster import Cluster
from fabtrain.config.launcher import is_torchrun
from fabtrain.plan.plan import Plan, ProcessPlan
from fabtrain.plan.runtime import runtime_dir
from fabtrain.slurm import allocports

PLAN_END = "FABTRAIN_PLAN"


def job_name(cluster: Cluster) -> str:
    """Slurm's name for every job of this cluster: what `fab kill-all` finds them by."""
    return f"fabtrain-{cluster.name}"


def cluster_workspace(cluster: Cluster, home: str) -> str:
    """cluster.workspace, absolute (sbatch expands no ~): the folder above every node's workspace."""
    return absolute(posixpath.dirname(cluster.nodes[0].workspace), home)


def absolute(path: str, home: str) -> str:
    return home + path[1:] if path == "~" or path.startswith("~/") else path


def job_folder(cluster: Cluster, job_id: str, home: str) -> str:
    """Where the batch shell leaves the plan, the secret, Slurm's output and the time-limit mark."""
    return f"{cluster_workspace(cluster, home)}/slurm/{job_id}"


def ranks_of(cluster: Cluster, proc: ProcessPlan) -> int:
    """How many ranks a process runs: torchrun runs trainer.per_node of them, any other process one."""
    return cluster.job.trainer.per_node if proc.role == "trainer" and is_torchrun(cluster.job.trainer.command) else 1


def template(cluster: Cluster, plan: Plan, roles: tuple[str, ...], grace: float) -> dict:
    """Every node's job.json and agent spec, in the allocation's node order: what allocation.py reads;
    `attempts`: how many Slurm attempts the job may have (scheduler.requeue + 1); `cpus_per_rank`: each
    rank's share of the CPUs Slurm binds a node's step to (a process of several ranks says `ranks`)."""
    spec = cluster.scheduler
    nodes = []
    for n in plan.nodes:
        job = plan.job_json(n.node)
        if spec.cpus_per_rank:
            for proc, planned in zip(job["processes"], n.processes):
                if ranks_of(cluster, planned) > 1:
                    proc["ranks"] = ranks_of(cluster, planned)
        job["watchdog"].get("coordinator", {}).pop("secret", None)
        nodes.append({"job": job, "agent": plan.agent_process(n.node) if plan.watchdog.get("enabled") else None})
    return {"job_id": plan.job_id, "cluster": plan.cluster, "roles": list(roles), "grace": grace,
            "attempts": spec.requeue + 1, "cpus_per_rank": spec.cpus_per_rank, "nodes": nodes}


def sbatch_options(cluster: Cluster, folder: str, plan: Plan | None = None) -> list[str]:
    spec = cluster.scheduler
    # --open-mode=append: each attempt's output follows the last one's (Slurm's "DUE TO PREEMPTION" line too).
    options = [f"--job-name={job_name(cluster)}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
               f"--output={folder}/{OUTPUT % '%j'}", "--open-mode=append",
               "--requeue" if spec.requeue else "--no-requeue"]
    if spec.partition:
        options.append(f"--partition={spec.partition}")
    if spec.account:
        options.append(f"--account={spec.account}")
    if spec.time:
        options.append(f"--time={spec.time}")
    if spec.gpus:
        options.append(f"--gpus-per-node={spec.gpus}")
    if spec.cpus_per_rank:
        # One step task a node runs every process of that node: it gets their ranks' CPUs together.
        ranks = max((sum(ranks_of(cluster, p) for p in n.processes) for n in plan.nodes), default=1) if plan else 1
        options.append(f"--cpus-per-task={spec.cpus_per_rank * ranks}")
    if spec.mem_per_node:
        options.append(f"--mem={spec.mem_per_node}")
    if spec.exclusive:
        options.append("--exclusive")
    if spec.term_before:
        options.append(f"--signal=B:USR1@{spec.term_before}")
    return options + list(spec.sbatch)


def summary(data: dict) -> list[str]:
    """The plan's data as a person reads it: each node's processes and commands (fab plan)."""
    lines = [f"#   node{i} {p['name']}: {shlex.join(p['argv'])}"
             for i, n in enumerate(data["nodes"]) for p in n["job"]["processes"]]
    if "ports" in data:
        lines.append("#   (@slurm-port:S+K@: the port drawn for S in the allocation, plus K; "
                     "@slurm-node-K@: node K's address)")
    return lines


def plan_data(cluster: Cluster, plan: Plan, roles: tuple[str, ...], grace: float,
              moved: dict[str, Plan] | None = None) -> dict:
    """What the batch script holds of the plan: `template`, with tokens where an `auto` port goes and what
    the allocation draws them with (`ports`; slurm/allocports.py). `moved`: for each auto setting, the same
    plan made with that setting's port moved by allocports.SHIFT."""
    data = template(cluster, plan, roles, grace)
    if not plan.auto_ports:
        return data
    if set(moved or {}) != set(plan.auto_ports):
        raise ValueError("a plan with auto ports needs the plan made with each of them moved")
    data = allocports.symbolic(data, {s: template(cluster, p, roles, grace) for s, p in moved.items()},
                               plan.ports)
    data["ports"] = allocports.draw_spec(cluster, plan.auto_ports)
    return data


def render(cluster: Cluster, plan: Plan, roles: tuple[str, ...], home: str, grace: float = STOP_GRACE,
           readable: bool = False, moved: dict[str, Plan] | None = None) -> str:
    """The batch script, exactly as submitted (sbatch reads it on stdin); `readable`: with the plan's data
    (one JSON line of every node's job.json) summarised instead, for a person (fab plan). `moved`: see
    plan_data (a plan with `auto` ports)."""
    spec = cluster.scheduler
    folder = job_folder(cluster, plan.job_id, home)
    first = plan.nodes[0]
    runtime = absolute(runtime_dir().replace("$WS", first.workspace), home)
    python = absolute(first.python, home)
    q = shlex.quote
    plan_json = plan_data(cluster, plan, roles, grace, moved)
    data = json.dumps(plan_json, separators=(",", ":"))
    lines = ["#!/bin/sh",
             *(f"#SBATCH {o}" for o in sbatch_options(cluster, folder, plan)),
             f"# fabtrain job {plan.job_id} of cluster {cluster.name}: {plan.mode} mode on {spec.nodes} nodes;",
             "# every node starts its part through fabtrain's launcher and agent (fabtrain/node/allocation.py).",
             "# Needs `fab deploy` first: the code and runtime on the filesystem the nodes share.",
             "umask 077",
             f"folder={q(folder)}",
             'mkdir -p "$folder" || exit 1',
             f"cat > \"$folder/{PLAN}\" <<'{PLAN_END}'",
             *([f"# (every node's job.json as one JSON line, {len(data)} bytes: what runs is, in short:)",
                *summary(plan_json)] if readable else [data]),
             PLAN_END,
             "# A Slurm attempt after the first (requeued) starts from nothing of the last one's stop.",
             f'rm -f "$folder/{TIME_LIMIT}"',
             "# The agents' secret: drawn here, read by each node from the shared folder, never on a command line.",
             f"[ -s \"$folder/{SECRET}\" ] || od -An -N16 -tx1 /dev/urandom | tr -d ' \\n' > \"$folder/{SECRET}\" || exit 1",
             "# Slurm's warning before the time limit (--signal=B:USR1): every node stops its programs, SIGTERM first.",
             f"trap 'touch \"$folder/{TIME_LIMIT}\"' USR1",
             *(["# `auto` ports: the step's tasks draw them, among those free on every node of this attempt's",
                "# allocation (fabtrain/node/allocports.py): nothing of an earlier attempt's draw counts.",
                f'rm -f "$folder/{DRAWN_PORTS}" "$folder"/{BUSY.replace("%d", "*")}']
               if "ports" in plan_json else []),
             "# A node whose part failed ends the step (--kill-on-bad-exit): a lost or frozen node cannot hold the",
             "# allocation once the agents have torn the job down.",
             f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --chdir={q(runtime)} \\",
             f"    {q(python)} -m fabtrain.node.allocation \"$folder\" &",
             "step=$!",
             "# wait returns early when the trap runs: wait again until the step has ended.",
             'while :; do wait "$step"; code=$?; kill -0 "$step" 2>/dev/null || break; done',
             *(["# Stopped for the time limit: the job goes on as its next Slurm attempt (continue_after_time_limit).",
                f'[ -e "$folder/{TIME_LIMIT}" ] && echo "time limit" > '
                f'"$folder/{CAUSE.replace("%d", "$((${SLURM_RESTART_COUNT:-0} + 2))")}" && '
                'scontrol requeue "$SLURM_JOB_ID" && exit 0']
               if spec.continue_after_time_limit else
               ["# Stopped for the time limit: Slurm ends the job at it, so its state says TIMEOUT, as without fabtrain.",
                f'[ -e "$folder/{TIME_LIMIT}" ] && while :; do sleep 60; done']),
             'exit "$code"',
             ""]
    return "\n".join(lines)
