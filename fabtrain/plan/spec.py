"""The plan as data: what runs where, node by node, process by process (`make_plan` in plan.py fills it in).

Its own module so that what builds on a plan (mpirun.py's one mpirun, kubernetes.py's pods) and what
makes one (plan.py) both import it, and neither the other.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fabtrain.contract.jobfolder import DEADLINE, RUN
from fabtrain.contract.launcher import launch_command
from fabtrain.plan.ports import PortUse
from fabtrain.plan.runtime import runtime_dir


def launch_argv(python: str, job_id: str, exit_path: str, argv, subreaper: bool = True,
                deadman: bool = False) -> list[str]:
    """A process's start: the launcher (fabtrain/node/launch.py, written into the job directory) and its argv;
    `deadman`: its launcher ends it once the agent's fence deadline passes unrenewed (a job whose agents fence)."""
    job_dir = f"$WS/jobs/{job_id}"
    return launch_command(python, job_dir, exit_path, argv, subreaper=subreaper,
                          deadline=f"{job_dir}/{RUN}/{DEADLINE}" if deadman else None)


# A spare node's processes' `started_by`: its agent starts them once the node takes a lost node's slot.
STAND_IN = "stand_in"


@dataclass(frozen=True)
class ProcessPlan:
    name: str  # "<role>-<rank>": file names under logs/, run/, metrics/
    role: str
    rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str  # relative to the workspace root
    log: str
    run: str
    exit: str
    metrics: str
    launch: tuple[str, ...] = ()  # the launcher's argv, then `argv`
    started_by: str = ""  # "mpirun-0" (that process), or STAND_IN: what starts this one (node ops' start does not)
    starts_with: str = ""  # the role whose start starts this one too (mpirun: with the trainers)

    def launch_argv(self) -> list[str]:
        return list(self.launch)

    def job_json(self) -> dict:
        spec = asdict(self) | {"argv": list(self.argv), "launch": list(self.launch)}
        return {k: v for k, v in spec.items() if v != "" or k not in ("started_by", "starts_with")}


@dataclass(frozen=True)
class NodePlan:
    node: str
    node_index: int
    host: str
    address: str
    workspace: str  # as written in cluster.yaml; "~" is expanded on the node
    python: str
    processes: tuple[ProcessPlan, ...]
    spare: bool = False  # min_nodes: not in the world at start; takes a lost trainer node's slot (elastic.py)

    def roles(self) -> set[str]:
        return {p.role for p in self.processes}

    def spare_fields(self) -> dict:
        """What job.json's `nodes` says of a spare: that it is one, and its trainers' own endpoints (Paddle's
        collective), which every node's renumbered world puts in the place of the slot it takes."""
        if not self.spare:
            return {}
        own = [p.env["PADDLE_CURRENT_ENDPOINT"] for p in self.processes if "PADDLE_CURRENT_ENDPOINT" in p.env]
        return {"spare": True, **({"endpoints": own} if own else {})}


@dataclass(frozen=True)
class Plan:
    job_id: str
    cluster: str
    mode: str
    sgd: str
    nodes: tuple[NodePlan, ...]
    watchdog: dict = field(default_factory=dict)
    pserver_endpoints: tuple[str, ...] = ()
    master: str = ""
    ports: dict = field(default_factory=dict)  # ports.PORT_SETTINGS key -> port
    auto_ports: tuple[str, ...] = ()  # the ones chosen at start (`auto`)
    listens: tuple[PortUse, ...] = ()  # every port the job listens on, node by node
    files: dict = field(default_factory=dict)  # node -> {path under the job dir: text} node ops writes at start

    def node(self, name: str) -> NodePlan:
        return next(n for n in self.nodes if n.node == name)

    def job_json(self, node: str) -> dict:
        """What `node_ops start` writes to jobs/<job_id>/job.json on that node."""
        n = self.node(node)
        return {
            "job_id": self.job_id,
            "cluster": self.cluster,
            "node": n.node,
            "node_index": n.node_index,
            "workspace": n.workspace,
            "python": n.python,
            "mode": self.mode,
            "sgd": self.sgd,
            "nodes": [{"name": m.node, "address": m.address, "roles": sorted(m.roles()), **m.spare_fields()}
                      for m in self.nodes],
            "watchdog": self.watchdog,
            # Which ports the job holds, so a later start (any cluster on this machine) leaves them alone.
            "ports": {**self.ports, "auto": list(self.auto_ports)},
            "listens": [[u.port, u.count, u.what, u.address] for u in self.listens if u.node == n.node],
            # What the agent must know, so it guesses nothing from PADDLE_* or WORLD_SIZE.
            "trainers": sum(1 for m in self.nodes if not m.spare for p in m.processes if p.role == "trainer"),
            "agent": self.agent_process(node),
            "processes": [p.job_json() for p in n.processes],
        } | ({"files": self.files[node]} if node in self.files else {})

    def agent_process(self, node: str) -> dict:
        """The node agent (watchdog) of this job on that node, in job.json's process shape."""
        n = self.node(node)
        job_dir = f"$WS/jobs/{self.job_id}"
        env = {"FABTRAIN_JOB_ID": self.job_id, "FABTRAIN_NODE": n.node, "FABTRAIN_ROLE": "agent",
               "FABTRAIN_RANK": str(n.node_index), "FABTRAIN_WORKSPACE": "$WS",
               "FABTRAIN_EXIT_FILE": f"{job_dir}/run/agent.exit", "PYTHONUNBUFFERED": "1"}
        argv = [n.python, "-m", "fabtrain.node.agent", job_dir]
        # No subreaper: the agent's keeper must outlive the agent, not be held by its launcher.
        start = launch_argv(n.python, self.job_id, f"{job_dir}/run/agent.exit", argv, subreaper=False)
        return {"name": "agent", "role": "agent", "rank": n.node_index, "argv": argv,
                # The agent runs from fabtrain's own runtime, never from the user's code.
                "launch": start, "env": env, "cwd": runtime_dir(),
                "log": f"{job_dir}/logs/agent.log", "run": f"{job_dir}/run/agent.json",
                "exit": f"{job_dir}/run/agent.exit", "metrics": ""}
