"""The plan: a pure function from a Cluster to what runs where.

No I/O here. `make_plan` decides, for every node, each process's role, rank,
argv (placeholders filled in), environment and paths; `fab plan` prints it and
`node_ops start` executes it. Paths are written relative to the node's
workspace root ``$WS`` and resolved on the node, where ``~`` means something.
"""
from __future__ import annotations

import os
import re
import secrets
import shlex
import string
import time
from dataclasses import dataclass, field, replace

from fabtrain.config.cluster import Cluster, Node, WatchdogSpec
from fabtrain.config.gpus import visible_devices
from fabtrain.config.launcher import is_torchrun
from fabtrain.plan.mpirun import with_mpirun
from fabtrain.plan.ports import AddressSlots, needed_ports, pserver_layout, port_uses, resolved_ports
from fabtrain.plan.spec import STAND_IN, NodePlan, Plan, ProcessPlan, launch_argv
from fabtrain.contract import progress


def new_job_id(now: float | None = None) -> str:
    """Sortable, unique enough for one cluster: 20261122-014600-3fa9."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Network:
    """What the plan takes from the nodes' network, found there by a probe
    (fabtrain.controller.preflight) and handed in, so the plan stays pure."""
    ports: dict[str, int]  # ports.PORT_SETTINGS key -> the port; `auto` ones chosen
    auto: tuple[str, ...] = ()  # which of them were `auto` in cluster.yaml
    ifaces: dict[str, str] = field(default_factory=dict)  # node name -> the interface carrying its address

    def to_dict(self) -> dict:
        return {"ports": dict(self.ports), "auto": list(self.auto), "ifaces": dict(self.ifaces)}

    @classmethod
    def from_dict(cls, d: dict) -> "Network":
        return cls(ports=dict(d["ports"]), auto=tuple(d.get("auto", ())), ifaces=dict(d.get("ifaces", {})))


def iface_env(cluster: Cluster, node: Node, network: Network | None) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the node's `iface:`, else the interface
    found carrying its address (`<iface of ADDR>` until a probe found it).

    Without them gloo picks the interface the hostname resolves to, which on
    many machines is 127.0.1.1 or a docker bridge the peers cannot reach.
    job.env, applied after, wins over both.
    """
    iface = node.iface or (network.ifaces.get(node.name) if network else None) or f"<iface of {node.address}>"
    return {var: iface for var in IFACE_VARS}


def instrument_env(cluster: Cluster, role: str) -> dict[str, str]:
    """job.watchdog.instrument: false for this role: the launcher's progress hook writes no records."""
    return {} if role in cluster.job.watchdog.instrument else {progress.ENV_INSTRUMENT: "0"}


def make_plan(cluster: Cluster, job_id: str, resume_from: str | None = None, secret: str | None = None,
              network: Network | None = None) -> Plan:
    """The plan of job `job_id`; `network` (ports chosen for `auto`, interfaces found) comes from a probe."""
    job = cluster.job
    trainer_nodes = cluster.trainer_nodes
    per_node = job.trainer.per_node
    world_size = cluster.trainer_count
    master = trainer_nodes[0]  # trainer 0 is the first trainer of the first node (PaddleX)
    ports = resolved_ports(cluster, network.ports if network else None)
    master_port = ports["master_port"]

    pservers = pserver_layout(cluster, ports["pserver_port"])  # (node, pserver rank, port)
    pserver_ips = ",".join(n.address for n, _, _ in pservers)
    pserver_endpoints = tuple(f"{n.address}:{port}" for n, _, port in pservers)

    torchrun = job.mode == "collective" and is_torchrun(job.trainer.command)
    common = {
        "num_gradient_servers": world_size,
        "pservers": pserver_ips,
        "ports_num": job.pserver.ports_num,
        "ports_num_for_sparse": job.pserver.ports_num_for_sparse,
        "world_size": world_size,
        "master_addr": master.address,
        "master_port": master_port,
        "nnodes": len(trainer_nodes),
        "nproc_per_node": per_node,
    }
    # One endpoint per trainer; trainers that share an address differ in port.
    endpoint_slot = AddressSlots()
    # A spare's (`spare: true`) come after the world's: its own, for the slot it may take (elastic.py).
    endpoint_list = [f"{n.address}:{master_port + 1 + endpoint_slot.next(n.address)}"
                     for n in trainer_nodes + cluster.spare_nodes for _ in range(per_node)]

    # by identity: Node.__eq__ is slow at 1,000. A spare is numbered after the world, as a node beyond it.
    trainer_rank = {id(n): i for i, n in enumerate(trainer_nodes + cluster.spare_nodes)}
    node_plans = []
    for index, node in enumerate(cluster.nodes):
        pin = iface_env(cluster, node, network)
        procs = _pserver_processes(cluster, node, index, pservers, pserver_endpoints, common, pin, job_id,
                                   resume_from)

        if (node_rank := trainer_rank.get(id(node))) is not None:
            if torchrun:
                values = common | {"rank": node_rank, "trainer_id": node_rank * per_node, "node_rank": node_rank,
                                   "port": master_port, "data_dir": _data_dir(cluster)}
                # One torchrun a node: its place among the nodes; torchrun gives its workers their own RANK.
                env = pin | mpi_env(node_rank, len(trainer_nodes), 0, 1) | {
                    "NODE_RANK": str(node_rank), "MASTER_ADDR": master.address, "MASTER_PORT": str(master_port)}
                if job.watchdog.min_nodes is not None:  # each generation's place among the nodes (elastic.py)
                    env |= torchrun_env(len(trainer_nodes), node_rank, master.address, master_port)
                if job.trainer.use_gpu:  # its workers' LOCAL_RANK as a device index: the PCI order, as in _trainer_env
                    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
                command = _with_torchrun_flags(job.trainer.command, elastic=job.watchdog.min_nodes is not None)
                procs.append(_process(cluster, node, "trainer", node_rank, command, values, env, job_id, resume_from))
            else:
                for local in range(per_node):
                    rank = node_rank * per_node + local
                    values = common | {"rank": rank, "trainer_id": rank, "node_rank": node_rank,
                                       "port": pservers[0][2] if pservers else master_port,
                                       "data_dir": _data_dir(cluster)}
                    env = pin | _trainer_env(cluster, node, values, local, pserver_endpoints, endpoint_list)
                    procs.append(_process(cluster, node, "trainer", rank, job.trainer.command, values, env, job_id, resume_from))
        if node.spare:  # its agent starts them when it takes a lost node's slot; node ops' start does not
            procs = [replace(p, started_by=STAND_IN) for p in procs]
        node_plans.append(NodePlan(node=node.name, node_index=index, host=node.host, address=node.address,
                                   workspace=node.workspace, python=node.python, processes=tuple(procs),
                                   spare=node.spare))

    return _launched(cluster, Plan(
        job_id=job_id, cluster=cluster.name, mode=job.mode, sgd=job.sgd, nodes=tuple(node_plans),
        watchdog=_watchdog(cluster, secret, ports["watchdog_port"]), pserver_endpoints=pserver_endpoints,
        master=f"{master.address}:{master_port}",
        ports={k: ports[k] for k in needed_ports(cluster)},  # only those this mode uses
        auto_ports=network.auto if network else (), listens=tuple(port_uses(cluster, ports))))


def _pserver_processes(cluster: Cluster, node, index: int, pservers: list, pserver_endpoints: tuple, common: dict,
                       pin: dict, job_id: str, resume_from: str | None) -> list[ProcessPlan]:
    """The parameter servers of the plan (`pservers`: (node, pserver rank, port)) that run on `node`, the
    `index`th node of the cluster; `common`: the values every process's command may use; `pin`: the
    node's interface pinning."""
    job = cluster.job
    procs: list[ProcessPlan] = []
    for pnode, prank, port in pservers:
        if pnode is not node:
            continue
        values = common | {"port": port, "rank": prank, "trainer_id": "", "node_rank": index,
                           "data_dir": _data_dir(cluster)}
        env = pin | _paddle_v2_env(cluster, values) | mpi_env(prank, len(pservers), prank % job.pserver.per_node,
                                                                job.pserver.per_node) | {
            "TRAINING_ROLE": "PSERVER",
            "PADDLE_PORT": str(port),
            "POD_IP": node.address,
            "PADDLE_TRAINERS_NUM": str(common["world_size"]),
            "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(pserver_endpoints),
        }
        procs.append(_process(cluster, node, "pserver", prank, job.pserver.command, values, env, job_id, resume_from))
    return procs


def _launched(cluster: Cluster, plan: Plan) -> Plan:
    """The plan as job.launcher starts it: fabtrain on every node, or one mpirun (fabtrain/plan/mpirun.py)."""
    if cluster.job.launcher != "mpirun":
        return plan
    return with_mpirun(plan, cluster)


def _watchdog(cluster: Cluster, secret: str | None, port: int | None) -> dict:
    w = cluster.job.watchdog
    watchdog = {
        "enabled": w.enabled, "interval": w.interval, "hang_timeout": w.hang_timeout, "grace": w.grace,
        "startup_timeout": w.startup_timeout, "on_failure": w.on_failure,
        "max_restarts": w.max_restarts, "restart_backoff": w.restart_backoff,
        "restart_on_exit_codes": list(w.restart_on_exit_codes) if w.restart_on_exit_codes is not None else None,
        "min_nodes": w.min_nodes,
        "straggler": {"share": w.straggler_share, "window": w.straggler_window},
        # The agents' shared view of the job lives with the first node's agent.
        "coordinator": {"host": cluster.nodes[0].address, "port": port},
    }
    if w.notify is not None:
        watchdog["notify"] = {"webhook": w.notify.webhook, "command": list(w.notify.command), "on": list(w.notify.on)}
    if w.no_checkpoint is not None:  # the coordinator's agent's rule (node/agent/checkpoints.py)
        watchdog["no_checkpoint"] = w.no_checkpoint
    if w.on_bad_checkpoint != WatchdogSpec.on_bad_checkpoint:  # the restart policy's (coordination/restart.py)
        watchdog["on_bad_checkpoint"] = w.on_bad_checkpoint
    if w.min_nodes is not None:  # the board's rejoin bound (coordination/fence.py), only where it applies
        watchdog["max_rejoins"] = w.max_rejoins
    if w.min_nodes is not None and is_torchrun(cluster.job.trainer.command):  # ranks a trainer process holds:
        watchdog["ranks_per_trainer"] = cluster.job.trainer.per_node  # a smaller world's size (elastic.py)
    if secret:
        watchdog["coordinator"]["secret"] = secret
    return watchdog


def _data_dir(cluster: Cluster) -> str:
    # Shared storage: the same path on every node. Otherwise copy-data put the
    # node's shards under <workspace>/data.
    return cluster.job.data.dir if cluster.job.data.shared else "$WS/data"


def _paddle_v2_env(cluster: Cluster, v: dict) -> dict[str, str]:
    job = cluster.job
    env = {
        "PADDLE_INIT_PORT": str(v["port"]),
        "PADDLE_INIT_PORTS_NUM": str(job.pserver.ports_num),
        "PADDLE_INIT_PORTS_NUM_FOR_SPARSE": str(job.pserver.ports_num_for_sparse),
        "PADDLE_INIT_NUM_GRADIENT_SERVERS": str(v["num_gradient_servers"]),
        "PADDLE_INIT_PSERVERS": v["pservers"],
        "PADDLE_INIT_USE_GPU": "1" if job.trainer.use_gpu else "0",
        "PADDLE_INIT_TRAINER_COUNT": str(job.trainer.trainer_count),
    }
    if v["trainer_id"] != "":
        env["PADDLE_INIT_TRAINER_ID"] = str(v["trainer_id"])
    return env


def mpi_env(rank: int, size: int, local_rank: int, local_size: int) -> dict[str, str]:
    """What `mpirun` gives each rank, so a program written for it (PaddlePaddle's guide's
    train.py reads OMPI_COMM_WORLD_RANK) finds its place under any launcher."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size)}


def _trainer_env(cluster, node, v, local_rank, pserver_endpoints, endpoints) -> dict[str, str]:
    job = cluster.job
    rank, world = v["rank"], v["world_size"]
    env = {
        # torch.distributed (init_process_group from env)
        "MASTER_ADDR": v["master_addr"], "MASTER_PORT": str(v["master_port"]),
        "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(job.trainer.per_node),
        "NODE_RANK": str(v["node_rank"]),
    } | mpi_env(rank, world, local_rank, job.trainer.per_node)
    if job.mode == "pserver":
        env |= _paddle_v2_env(cluster, v) | {
            "TRAINING_ROLE": "TRAINER",
            "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world),
            "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(pserver_endpoints),
            "POD_IP": node.address,
        }
    else:
        env |= {
            # paddle.distributed.init_parallel_env()
            "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints[:world]),  # the world's: not a spare's
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
            "PADDLE_MASTER": f"{v['master_addr']}:{v['master_port']}",
        }
        if not job.trainer.use_gpu:
            env["PADDLE_DISTRI_BACKEND"] = "gloo"
    devices = visible_devices(node, local_rank, job.trainer.gpus_per_rank) if job.trainer.use_gpu else None
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if job.trainer.use_gpu:
        # CUDA numbers GPUs fastest first by default; leases, NVML, nvidia-smi and Slurm's GRES use the PCI order.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def _process(cluster: Cluster, node: Node, role: str, rank: int, command: str, values: dict,
             role_env: dict[str, str], job_id: str, resume_from: str | None = None) -> ProcessPlan:
    name = f"{role}-{rank}"
    job_dir = f"$WS/jobs/{job_id}"
    paths = {
        "log": f"{job_dir}/logs/{name}.log",
        "run": f"{job_dir}/run/{name}.json",
        "exit": f"{job_dir}/run/{name}.exit",
        "metrics": f"{job_dir}/metrics/{name}.jsonl",
    }
    env = {
        "FABTRAIN_JOB_ID": job_id,
        "FABTRAIN_NODE": node.name,
        "FABTRAIN_ROLE": role,
        "FABTRAIN_RANK": str(rank),
        "FABTRAIN_METRICS": paths["metrics"],
        "FABTRAIN_WORKSPACE": "$WS",
        "FABTRAIN_EXIT_FILE": paths["exit"],
        "FABTRAIN_DATA_DIR": values["data_dir"],
        # A new job starts fresh; `start-pserver --resume-from=JOB` points at that job's checkpoints.
        "FABTRAIN_CHECKPOINT_DIR": f"$WS/jobs/{resume_from or job_id}/checkpoints",
        "FABTRAIN_SGD": cluster.job.sgd,  # job.sgd: the reference workload's --sgd
        # Python ignores stdbuf: without this a trainer's log lags by 8 KiB.
        "PYTHONUNBUFFERED": "1", **instrument_env(cluster, role),
        **role_env,
        **dict(cluster.job.env),
    }
    if os.path.isabs(node.python) or node.python.startswith("~/"):
        # `python` in a command means the cluster's interpreter (its venv's bin first).
        env["PATH"] = f"{os.path.dirname(node.python)}:$PATH"
    argv = tuple(fill_placeholders(command, values))
    return ProcessPlan(name=name, role=role, rank=rank, argv=argv, env=env, cwd=f"$WS/jobs/{job_id}/code", **paths,
                       launch=tuple(launch_argv(node.python, job_id, paths["exit"], argv, deadman=fences(cluster))))


def fences(cluster: Cluster) -> bool:
    """Whether the job's agents fence their nodes for a generation that goes on without them (min_nodes, on_failure
    restart, more than one node): then every job process's launcher is its node's dead-man (node/deadman.py)."""
    w = cluster.job.watchdog
    return w.min_nodes is not None and w.on_failure == "restart" and len(cluster.nodes) > 1


def fill_placeholders(command: str, values: dict) -> list[str]:
    """Split the command into argv and fill {placeholders} token by token.

    Filling after splitting means a value can never add or split arguments:
    the program gets exactly the argv the user wrote, whatever the value holds.
    """
    formatter = string.Formatter()
    return [formatter.vformat(token, (), {k: str(v) for k, v in values.items()}) for token in shlex.split(command)]


# torchrun's flags a generation's world decides: under min_nodes they travel as torchrun's own PET_ variables
# (its argparse defaults), which coordination/elastic.py renumbers for each generation, never on its argv.
TORCHRUN_WORLD_FLAGS = (("--nnodes", "nnodes"), ("--node-rank", "node_rank"), ("--master-addr", "master_addr"),
                        ("--master-port", "master_port"))


def torchrun_env(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """What torchrun reads for the flags of TORCHRUN_WORLD_FLAGS when its argv does not give them."""
    return {"PET_NNODES": str(nnodes), "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": master_addr,
            "PET_MASTER_PORT": str(master_port)}


def _with_torchrun_flags(command: str, elastic: bool = False) -> str:
    """Add torchrun's multi-node flags where the command does not give them (`elastic`: only
    --nproc-per-node; the others come from torchrun_env)."""
    argv = shlex.split(command)
    at = 1 if os.path.basename(argv[0]) == "torchrun" else 3
    given = {a.split("=")[0].replace("_", "-") for a in argv}
    extra = [f"{flag}={{{key}}}" for flag, key in (*TORCHRUN_WORLD_FLAGS[:2], ("--nproc-per-node", "nproc_per_node"),
                                                    *TORCHRUN_WORLD_FLAGS[2:])
             if flag not in given and not (elastic and (flag, key) in TORCHRUN_WORLD_FLAGS)]
    return shlex.join(argv[:at] + extra + argv[at:]) if extra else command


def render_shell(process: ProcessPlan) -> str:
    """The process's start as one shell line: what `fab plan` prints.

    `node_ops start` does the same with execve (no shell in between); the line
    is the copy-paste-able equivalent, to be run after ``WS=<workspace>``.
    """
    return render_start(process.env, process.launch_argv(), process.cwd, process.log)


def render_start(env: dict, launch: list[str], cwd: str, log: str) -> str:
    """`cd CWD && env ENV LAUNCH >> LOG 2>&1 < /dev/null &`: any process spec's start as one shell line."""
    words = " ".join(f"{k}={shell_word(v)}" for k, v in env.items())
    cmd = " ".join(shell_word(a) for a in launch)
    return f"cd {shell_word(cwd)} && env {words} {cmd} >> {shell_word(log)} 2>&1 < /dev/null &"


def shell_word(value: str) -> str:
    """Quote for sh, leaving $WS and $PATH (expanded on the node) to the shell."""
    out = []
    for i, part in enumerate(re.split(r"(\$WS|\$PATH)", value)):
        if i % 2:
            out.append(f'"{part}"')
        elif part:
            out.append(shlex.quote(part))
    return "".join(out) or "''"
