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

Spares (`spare: true` in cluster.yaml) are trainer nodes outside the world
at start. When a node leaves and a spare is ready, the board puts the spare
in the lost node's slot (`stand_in`, {spare: lost node}): the world keeps its
size and its order, the spare holding the slot's place in it, so every other
node keeps its rank. A stand-in's processes keep their own names (their logs
and files are the spare's), but get the slot's FABTRAIN_RANK: the slot they
hold, whose data shards they read.
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
    spares: tuple = ()  # the names of the spare nodes, in order: not in trainer_nodes, none in the world at start

    @classmethod
    def from_job(cls, min_nodes: int, nodes: list, trainers: int, ranks_per_trainer: int = 1) -> Layout:
        """From job.json's `nodes` ([{"name", "address", "roles"}]), `trainers` and watchdog's
        `ranks_per_trainer` (torchrun's), strictly."""
        return cls(min_nodes=int(min_nodes), nodes=tuple(n["name"] for n in nodes),
                   trainer_nodes=tuple(n["name"] for n in nodes if "trainer" in n["roles"] and not n.get("spare")),
                   pserver_nodes=frozenset(n["name"] for n in nodes if "pserver" in n["roles"]),
                   trainers=int(trainers), ranks_per_trainer=int(ranks_per_trainer),
                   spares=tuple(n["name"] for n in nodes if n.get("spare")))

    def world(self, out, stand_in=None) -> tuple:
        """The generation's trainer nodes in slot order: the start's, less those in `out`, a slot whose node
        is out held by the spare that stands in for it (`stand_in`: {spare: the node whose slot it holds})."""
        return tuple(held for _, _, held in world_order(self.trainer_nodes, out, stand_in, lambda name: name))

    def world_size(self, out, stand_in=None) -> int:
        """Trainer ranks of that world (every trainer node runs as many)."""
        per_node = self.trainers // max(1, len(self.trainer_nodes)) * self.ranks_per_trainer
        return per_node * len(self.world(out, stand_in))

    def nodes_left(self, out, stand_in=None) -> int:
        return len(self.world(out, stand_in))

    def without_first(self) -> str:
        """Why the job cannot go on without nodes[0], in one line (its agents' fence says it, board.leave too)."""
        first, n = self.nodes[0], len(self.nodes)
        why = "%s is the first node: the agents' coordinator lives there, so the job cannot go on without it" % first
        if n <= 2:
            why += " (%s)" % no_majority(first, n)
        if first in self.pserver_nodes:
            why += "; and it runs parameter servers, whose shard of the model lives only there"
        return why

    def fence_why(self) -> str:
        """What follows a node's fence for the coordinator's loss, in one line (the agents' fence says it)."""
        if self.elects():
            return ("the nodes that reach a majority of the job's %d elect a coordinator of a new term and go on "
                    "without the nodes they lost" % len(self.nodes))
        return self.without_first()

    def elects(self) -> bool:
        """Whether a coordinator may be elected by majority (election.py): three or more nodes, every one a
        trainer node (a pserver's shard lives only on its node; a job with spares does not elect)."""
        return len(self.nodes) >= 3 and not self.pserver_nodes and self.trainer_nodes == self.nodes

    def leave(self, node: str, out: frozenset, stand_in=None, elected: bool = False) -> tuple[frozenset | None, str]:
        """The nodes out once `node` leaves (and `stand_in` holds the slots it gives spares after), or None and
        why the job cannot go on without it. `elected`: asked by a coordinator a majority elected
        (succession.py), which may go on without nodes[0] where `elects`."""
        if node in out:
            return out, ""
        if self.nodes and node == self.nodes[0] and not (elected and self.elects()):
            return None, self.without_first()
        if node in self.pserver_nodes:
            return None, ("%s runs parameter servers: their shard of the model lives only there, so a "
                          "pserver job cannot go on without it" % node)
        after = out | {node}
        left = self.nodes_left(after, stand_in)
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


def world_order(trainer_nodes, out, stand_in, name) -> list:
    """Of `trainer_nodes` (the start's world, in slot order), those of a generation without the nodes in
    `out`, where a spare of `stand_in` ({spare: slot's node}) holds the slot of a node that is out: as
    (slot index, node, the node's or the spare's name). `name(node)`: a node's name."""
    holder = {slot: spare for spare, slot in (stand_in or {}).items()}
    return [(i, n, name(n) if name(n) not in out else holder[name(n)]) for i, n in enumerate(trainer_nodes)
            if name(n) not in out or name(n) in holder]


def renumbered(job: dict, spec: dict, out, generation: int = 0, stand_in=None) -> dict:
    """The environment of job.json process `spec` on this node, for `generation`, in the world without
    the nodes in `out`, a spare of `stand_in` ({spare: node}) in the slot of a node that left.

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
    by_name = {n["name"]: n for n in job["nodes"]}
    trainer_nodes = [n for n in job["nodes"] if "trainer" in n["roles"] and not n.get("spare")]
    # (slot index, the slot's node at start, the node that holds it now: itself or a spare)
    world = [(i, n, by_name[held]) for i, n, held in world_order(trainer_nodes, out, stand_in, lambda n: n["name"])]
    kept = [held for _, _, held in world]
    per_node = int(job["trainers"]) // max(1, len(trainer_nodes))

    def put(key: str, value) -> None:
        if key in env:
            env[key] = str(value)

    names = [n["name"] for n in kept]
    here = names.index(job["node"]) if job["node"] in names else None  # None: not in this world (an idle spare)
    if TORCHRUN_NODES in env:  # one torchrun a node: its place among the nodes left; it numbers its workers
        if spec["role"] == "trainer" and here is not None:
            for key, value in ((TORCHRUN_NODES, len(kept)), ("OMPI_COMM_WORLD_SIZE", len(kept)),
                               ("PET_NODE_RANK", here), ("NODE_RANK", here), ("OMPI_COMM_WORLD_RANK", here),
                               ("PET_MASTER_ADDR", kept[0]["address"]), ("MASTER_ADDR", kept[0]["address"])):
                put(key, value)
            if job["node"] in (stand_in or {}):  # the slot's number: its torchrun's, one a node
                put("FABTRAIN_RANK", world[here][0])
        return env

    for key in WORLD_SIZE_KEYS:
        put(key, per_node * len(kept))
    if spec["role"] != "trainer" or here is None:
        return env
    local = int(env.get("LOCAL_RANK", int(spec["rank"]) % max(1, per_node)))
    for key in RANK_KEYS:
        put(key, here * per_node + local)
    put("OMPI_COMM_WORLD_SIZE", per_node * len(kept))
    put("NODE_RANK", here)
    if job["node"] in (stand_in or {}):  # a spare in a lost node's slot: that slot's trainer (its data shards)
        put("FABTRAIN_RANK", world[here][0] * per_node + local)
    master = kept[0]["address"]
    put("MASTER_ADDR", master)
    if "PADDLE_MASTER" in env:
        env["PADDLE_MASTER"] = "%s:%s" % (master, env["PADDLE_MASTER"].rsplit(":", 1)[-1])
    if "PADDLE_TRAINER_ENDPOINTS" in env:
        start = env["PADDLE_TRAINER_ENDPOINTS"].split(",")  # per_node a trainer node, in slot order
        env["PADDLE_TRAINER_ENDPOINTS"] = ",".join(
            e for i, node, held in world
            for e in (start[i * per_node:(i + 1) * per_node] if held is node else held.get("endpoints", ())))
    return env


def sits_out(node: str, spare: bool, status: dict) -> bool:
    """Whether `node` starts nothing in the generation of the coordinator's `status`: it left the job (`out`),
    or it is a spare (`spare`) that holds no lost node's slot (`stand_in`)."""
    return node in (status.get("out") or ()) or (spare and node not in (status.get("stand_in") or {}))


def taking(node: str, status: dict) -> str:
    """How `node` comes into the generation of `status` it waited out: `back in`, or a spare's `(spare) in n2's
    place in`."""
    slot = (status.get("stand_in") or {}).get(node)
    return "(spare) in %s's place in" % slot if slot else "back in"
