"""`job.launcher: mpirun`: one `mpirun` on the first trainer node starts every rank.

The ranks are the plan's trainer processes, as with fabtrain's own launcher:
the same environment, argv, logs, run and exit records, launcher. Only who
starts them changes. Each stays in its node's job.json, marked
`started_by: mpirun-0`, so node ops' start leaves it to mpirun and the
node's agent watches it as any other process (hang rule, job-wide teardown).

`mpirun-0`, a process of the first trainer node started with the trainers,
reads a hostfile of the trainer nodes' addresses (slots = per_node, mapped by
slot: rank r runs on trainer node r // per_node, as the plan has it) and
reaches them with `ssh -F` and a config written from the cluster's SSH
settings and host-key policy. On each node it runs a fixed bootstrap that
finds that node's workspace by its rank and hands over to
fabtrain/node/mpirank.py, which starts the rank's spec through the launcher.
"""
from __future__ import annotations

from dataclasses import replace

from fabtrain.config.cluster import Cluster
from fabtrain.plan.spec import Plan, launch_argv
from fabtrain.plan.runtime import runtime_version
from fabtrain.remote.hostkeys import openssh_config

NAME = "mpirun-0"
HOSTFILE, SSH_CONFIG = "mpi/hostfile", "mpi/ssh_config"  # under the job directory, written by node ops' start
# argv: <runtime version> <job id> <per_node> <workspace of trainer node 0> <... of node 1> ...
BOOTSTRAP = ("import os, sys; a = sys.argv; "
             "ws = os.path.abspath(os.path.expanduser(a[4 + int(os.environ['OMPI_COMM_WORLD_RANK']) // int(a[3])])); "
             "sys.path.insert(0, os.path.join(ws, 'runtime', a[1])); "
             "from fabtrain.node import mpirank; mpirank.main(ws, a[2])")
# Open MPI refuses root unless told; fabtrain runs as whoever the cluster logs in as.
ALLOW_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def hostfile_text(cluster: Cluster) -> str:
    return "".join(f"{n.address} slots={cluster.job.trainer.per_node}\n" for n in cluster.trainer_nodes)


def ssh_config_text(cluster: Cluster) -> str:
    """What mpirun's ssh reads on the first trainer node: the cluster's policy, then each node's login.

    Paths are kept as written: they are the first trainer node's (ssh expands ~ there).
    """
    first = cluster.trainer_nodes[0].ssh
    lines = ["# Written by fabtrain for mpirun: the cluster's SSH settings and host-key policy.", "Host *",
             "    BatchMode yes", f"    ConnectTimeout {max(1, round(first.connect_timeout))}",
             *(f"    {line}" for line in openssh_config(first.known_hosts, first.host_key_policy, here=False))]
    for n in cluster.trainer_nodes:
        ssh = n.ssh
        lines += [f"Host {n.address}",
                  *([f"    User {ssh.user}"] if ssh.user else []), *([f"    Port {ssh.port}"] if ssh.port else []),
                  *([f'    IdentityFile "{ssh.key}"'] if ssh.key else [])]
    return "\n".join(lines) + "\n"


def mpirun_argv(plan: Plan, cluster: Cluster) -> list[str]:
    job_dir = f"$WS/jobs/{plan.job_id}"
    ranks = [p for n in plan.nodes for p in n.processes if p.role == "trainer"]
    workspaces = [plan.node(n.name).workspace for n in cluster.trainer_nodes]
    return ["mpirun", "--hostfile", f"{job_dir}/{HOSTFILE}", "--mca", "plm_rsh_agent", f"ssh -F {job_dir}/{SSH_CONFIG}",
            # Only this node holds the ssh config: no daemon starts others (tree spawn), and each reports
            # to mpirun itself, so all of them notice at once when it ends.
            "--mca", "plm_rsh_no_tree_spawn", "1", "--mca", "routed", "direct",
            # When a rank fails the MPI job cannot go on: its daemons end the other ranks at once, not after
            # Open MPI's default second between SIGTERM and SIGKILL (a plain mpirun takes ~2 s to be gone).
            "--mca", "odls_base_sigkill_timeout", "0",
            "--map-by", "slot", "--bind-to", "none", "-np", str(len(ranks)),
            "python3", "-I", "-S", "-c", BOOTSTRAP, runtime_version(), plan.job_id,
            str(cluster.job.trainer.per_node), *workspaces]


def with_mpirun(plan: Plan, cluster: Cluster) -> Plan:
    """The plan with its ranks left to one mpirun on the first trainer node."""
    first = cluster.trainer_nodes[0].name
    nodes = []
    for n in plan.nodes:
        procs = tuple(replace(p, started_by=NAME) if p.role == "trainer" else p for p in n.processes)
        if n.node == first:
            rank0 = procs[0]
            job_dir = f"$WS/jobs/{plan.job_id}"
            paths = {"log": f"{job_dir}/logs/{NAME}.log", "run": f"{job_dir}/run/{NAME}.json",
                     "exit": f"{job_dir}/run/{NAME}.exit", "metrics": f"{job_dir}/metrics/{NAME}.jsonl"}
            # The job marker and the user's settings, not a rank's place: mpirun gives those.
            env = {k: v for k, v in rank0.env.items() if k.startswith("FABTRAIN_") or k in ("PATH", "PYTHONUNBUFFERED")}
            env |= {"FABTRAIN_ROLE": "mpirun", "FABTRAIN_RANK": "0", "FABTRAIN_METRICS": paths["metrics"],
                    "FABTRAIN_EXIT_FILE": paths["exit"], **dict(cluster.job.env), **ALLOW_ROOT}
            argv = tuple(mpirun_argv(plan, cluster))
            mpirun = replace(rank0, name=NAME, role="mpirun", rank=0, argv=argv, env=env, started_by="",
                             starts_with="trainer", launch=tuple(launch_argv(n.python, plan.job_id, paths["exit"], argv)),
                             **paths)
            procs = (mpirun,) + procs
        nodes.append(replace(n, processes=procs))
    files = {first: {HOSTFILE: hostfile_text(cluster), SSH_CONFIG: ssh_config_text(cluster)}}
    return replace(plan, nodes=tuple(nodes), files=files)
