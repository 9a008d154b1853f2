"""Going on without a lost node (`job.watchdog.min_nodes`), pure: who may leave, and the smaller world.

The coordinator's board asks `Layout.leave` when a node is lost (its agent
silent: machine, sshd or agent gone) or could not start its part of a
generation: the next generation runs on the nodes that are left, or the job
fails and the answer says why (a pserver node, the coordinator's node, fewer
than min_nodes left). Each agent then starts its part of that generation with
`renumbered`: the job.json environment of a process, its world renumbered
over the trainer nodes that are left, in their order in the cluster file.
Process names, FABTRAIN_RANK and the files they name keep the start's
numbering: they say which slot of the job a process is, not its rank.
"""
from __future__ import annotations

from fabtrain.node.structs import record

from .election import no_majority


@record
class Layout:
    """The job's nodes as the board needs them to decide a leave (from job.json's `nodes` and `trainers`)."""
    min_nodes: int
    nodes: tuple  # every node's name, in order: nodes[0] hosts the coordinator
    trainer_nodes: tuple  # the names of the nodes with the trainer role, in order
    pserver_nodes: frozenset
    trainers: int  # the job's trainer processes at full size
    ranks_per_trainer: int = 1  # ranks one trainer process holds (a torchrun's --nproc-per-node)

    @classmethod
    def from_job(cls, min_nodes: int, nodes: list, trainers: int, ranks_per_trainer: int = 1) -> Layout:
        """From job.json's `nodes` ([{"name", "address", "roles"}]), `trainers` and watchdog's
        `ranks_per_trainer` (torchrun's), strictly."""
        return cls(min_nodes=int(min_nodes), nodes=tuple(n["name"] for n in nodes),
                   trainer_nodes=tuple(n["name"] for n in nodes if "trainer" in n["roles"]),
                   pserver_nodes=frozenset(n["name"] for n in nodes if "pserver" in n["roles"]),
                   trainers=int(trainers), ranks_per_trainer=int(ranks_per_trainer))

    def world_size(self, out) -> int:
        """Trainer ranks once the nodes in `out` are gone (every trainer node runs as many)."""
        per_node = self.trainers // max(1, len(self.trainer_nodes)) * self.ranks_per_trainer
        return per_node * sum(1 for n in self.trainer_nodes if n not in out)

    def nodes_left(self, out) -> int:
        return sum(1 for n in self.trainer_nodes if n not in out)

    def without_first(self) -> str:
        """Why the job cannot go on without nodes[0], in one line (its agents' fence says it, board.leave too)."""
        first, n = self.nodes[0], len(self.nodes)
        why = "%s is the first node: the agents' coordinator lives there, so the job cannot go on without it" % first
        if n <= 2:
            why += " (%s)" % no_majority(first, n)
        if first in self.pserver_nodes:
            why += "; and it runs parameter servers, whose shard of the model lives only there"
        return why

    def elects(self) -> bool:
        """Whether a coordinator may be elected by majority (election.py): three or more nodes, every one a
        trainer node (a pserver's shard lives only on its node)."""
        return len(self.nodes) >= 3 and not self.pserver_nodes and self.trainer_nodes == self.nodes

    def leave(self, node: str, out: frozenset, elected: bool = False) -> tuple[frozenset | None, str]:
        """The nodes out once `node` leaves, or None and why the job cannot go on without it. `elected`: asked
        by a coordinator a majority elected (succession.py), which may go on without nodes[0] where `elects`."""
        if node in out:
            return out, ""
        if self.nodes and node == self.nodes[0] and not (elected and self.elects()):
            return None, self.without_first()
        if node in self.pserver_nodes:
            return None, ("%s runs parameter servers: their shard of the model lives only there, so a "
                          "pserver job cannot go on without it" % node)
        after = out | {node}
        left = self.nodes_left(after)
        if left < self.min_nodes:
            return None, "%d trainer node%s would be left, fewer than min_nodes (%d)" % (
                left, "" if left == 1 else "s", self.min_nodes)
        return frozenset(after), ""


# The variables that say the size of the trainers' world, on trainers and pservers alike.
WORLD_SIZE_KEYS = ("WORLD_SIZE", "PADDLE_TRAINERS_NUM", "PADDLE_INIT_NUM_GRADIENT_SERVERS")
# MASTER_PORT, and torchrun's own for its --master-port (plan.torchrun_env): the start's + the generation.
MASTER_PORT_KEYS = ("MASTER_PORT", "PET_MASTER_PORT")
# torchrun's --nnodes under min_nodes (plan.torchrun_env): its presence says the process is one torchrun a node.
TORCHRUN_NODES = "PET_NNODES"
# A trainer's rank among all trainers.
RANK_KEYS = ("RANK", "PADDLE_TRAINER_ID", "PADDLE_INIT_TRAINER_ID", "OMPI_COMM_WORLD_RANK")


def renumbered(job: dict, spec: dict, out, generation: int = 0) -> dict:
    """The environment of job.json process `spec` on this node, for `generation`, in the world without
    the nodes in `out`.

    Only the variables the plan set are changed (a variable absent from the
    spec stays absent); LOCAL_RANK and the endpoint of the process itself do
    not change: a node keeps its own processes. MASTER_PORT is the start's
    plus the generation: a generation never meets the rendezvous of another
    (a process of an older one that is still alive anywhere cannot join the
    new world's store); the start checked the whole range free on the master
    node (plan/ports.py).
    """
    env = dict(spec["env"])
    for key in MASTER_PORT_KEYS:
        if generation and key in env and env[key].isdigit():
            env[key] = str(int(env[key]) + generation)
    if not out:
        return env
    trainer_nodes = [n for n in job["nodes"] if "trainer" in n["roles"]]
    kept = [n for n in trainer_nodes if n["name"] not in out]
    per_node = int(job["trainers"]) // max(1, len(trainer_nodes))
    world = per_node * len(kept)

    def put(key: str, value) -> None:
        if key in env:
            env[key] = str(value)

    if TORCHRUN_NODES in env:  # one torchrun a node: its place among the nodes left; it numbers its workers
        if spec["role"] == "trainer" and kept:
            node_rank = [n["name"] for n in kept].index(job["node"])
            for key, value in ((TORCHRUN_NODES, len(kept)), ("OMPI_COMM_WORLD_SIZE", len(kept)),
                               ("PET_NODE_RANK", node_rank), ("NODE_RANK", node_rank),
                               ("OMPI_COMM_WORLD_RANK", node_rank), ("PET_MASTER_ADDR", kept[0]["address"]),
                               ("MASTER_ADDR", kept[0]["address"])):
                put(key, value)
        return env

    for key in WORLD_SIZE_KEYS:
        put(key, world)
    if spec["role"] != "trainer" or not kept:
        return env
    names = [n["name"] for n in kept]
    node_rank = names.index(job["node"])
    local = int(env.get("LOCAL_RANK", int(spec["rank"]) % max(1, per_node)))
    for key in RANK_KEYS:
        put(key, node_rank * per_node + local)
    put("OMPI_COMM_WORLD_SIZE", world)
    put("NODE_RANK", node_rank)
    master = kept[0]["address"]
    put("MASTER_ADDR", master)
    if "PADDLE_MASTER" in env:
        env["PADDLE_MASTER"] = "%s:%s" % (master, env["PADDLE_MASTER"].rsplit(":", 1)[-1])
    if "PADDLE_TRAINER_ENDPOINTS" in env:
        endpoints = env["PADDLE_TRAINER_ENDPOINTS"].split(",")  # per_node a trainer node, in node order
        env["PADDLE_TRAINER_ENDPOINTS"] = ",".join(
            e for i, e in enumerate(endpoints) if trainer_nodes[min(i // max(1, per_node), len(trainer_nodes) - 1)]
            ["name"] not in out)
    return env
