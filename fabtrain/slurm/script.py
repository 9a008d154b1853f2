"""The batch script of a job: what `fab plan` prints, `fab export --slurm` writes and `fab start-*` submits.

Pure: a Cluster (with `scheduler:`) and its Plan in, text out. The script
holds the plan of every node (addresses left as @slurm-node-K@ for the
allocation to fill in) but no secret: the batch shell draws the agents'
secret into a 0600 file when the job starts. It then runs one step task a
node, `python -m fabtrain.node.allocation <job folder>`, from the deployed
runtime, and passes Slurm's time-limit warning (SIGUSR1 to the batch shell,
`--signal=B:USR1@term_before`) on as the job folder's `time-limit` file.
"""
from __future__ import annotations

import json
import posixpath
import shlex

from fabtrain.contract.states import STOP_GRACE
from fabtrain.config.cluster import Cluster
from fabtrain.plan.plan import Plan
from fabtrain.plan.runtime import runtime_dir

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


def template(plan: Plan, roles: tuple[str, ...], grace: float) -> dict:
    """Every node's job.json and agent spec, in the allocation's node order: what allocation.py reads."""
    nodes = []
    for n in plan.nodes:
        job = plan.job_json(n.node)
        job["watchdog"].get("coordinator", {}).pop("secret", None)
        nodes.append({"job": job, "agent": plan.agent_process(n.node) if plan.watchdog.get("enabled") else None})
    return {"job_id": plan.job_id, "cluster": plan.cluster, "roles": list(roles), "grace": grace, "nodes": nodes}


def sbatch_options(cluster: Cluster, folder: str) -> list[str]:
    spec = cluster.scheduler
    options = [f"--job-name={job_name(cluster)}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
               f"--output={folder}/slurm-%j.out"]
    if spec.partition:
        options.append(f"--partition={spec.partition}")
    if spec.account:
        options.append(f"--account={spec.account}")
    if spec.time:
        options.append(f"--time={spec.time}")
    if spec.gpus_per_node:
        options.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.term_before:
        options.append(f"--signal=B:USR1@{spec.term_before}")
    return options + list(spec.sbatch)


def render(cluster: Cluster, plan: Plan, roles: tuple[str, ...], home: str, grace: float = STOP_GRACE) -> str:
    """The batch script, exactly as submitted (sbatch reads it on stdin)."""
    spec = cluster.scheduler
    folder = job_folder(cluster, plan.job_id, home)
    first = plan.nodes[0]
    runtime = absolute(runtime_dir().replace("$WS", first.workspace), home)
    python = absolute(first.python, home)
    q = shlex.quote
    lines = ["#!/bin/sh",
             *(f"#SBATCH {o}" for o in sbatch_options(cluster, folder)),
             f"# fabtrain job {plan.job_id} of cluster {cluster.name}: {plan.mode} mode on {spec.nodes} nodes;",
             "# every node starts its part through fabtrain's launcher and agent (fabtrain/node/allocation.py).",
             "# Needs `fab deploy` first: the code and runtime on the filesystem the nodes share.",
             "umask 077",
             f"folder={q(folder)}",
             'mkdir -p "$folder" || exit 1',
             f"cat > \"$folder/plan.json\" <<'{PLAN_END}'",
             json.dumps(template(plan, roles, grace), separators=(",", ":")),
             PLAN_END,
             "# The agents' secret: drawn here, read by each node from the shared folder, never on a command line.",
             "[ -s \"$folder/secret\" ] || od -An -N16 -tx1 /dev/urandom | tr -d ' \\n' > \"$folder/secret\" || exit 1",
             "# Slurm's warning before the time limit (--signal=B:USR1): every node stops its programs, SIGTERM first.",
             "trap 'touch \"$folder/time-limit\"' USR1",
             "# A node whose part failed ends the step (--kill-on-bad-exit): a lost or frozen node cannot hold the",
             "# allocation once the agents have torn the job down.",
             f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --chdir={q(runtime)} \\",
             f"    {q(python)} -m fabtrain.node.allocation \"$folder\" &",
             "step=$!",
             "# wait returns early when the trap runs: wait again until the step has ended.",
             'while :; do wait "$step"; code=$?; kill -0 "$step" 2>/dev/null || break; done',
             "# Stopped for the time limit: Slurm ends the job at it, so its state says TIMEOUT, as without fabtrain.",
             '[ -e "$folder/time-limit" ] && while :; do sleep 60; done',
             'exit "$code"',
             ""]
    return "\n".join(lines)
