"""The job's ports, as data: the settings, where each port is listened on, and choosing `auto` ones.

Pure like the rest of the plan: which ports are busy on the nodes is found by
a probe (fabtrain/controller/preflight.py, node op `netcheck`) and handed in.
The plan (plan.py) writes the chosen ports into every node's job.json, and the
controller's state keeps them for `fab status` and the dashboard.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from fabtrain.config.cluster import Cluster, Node
from fabtrain.contract import portdraw
from fabtrain.errors import UserError

BALLOT_BOX = "ballot box (UDP, watchdog port + 1)"  # a job that elects: what each node's agent votes on
AUTO_WINDOW = (20000, 32767)  # where `auto` ports come from: below the kernel's usual ephemeral range

# The port settings of cluster.yaml, by the name job.json and the controller's state use.
PORT_SETTINGS = {"master_port": "job.master_port", "pserver_port": "job.pserver.port",
                 "watchdog_port": "job.watchdog.port"}


class AddressSlots:
    """Hands out 0, 1, 2, ... per address: the slot of the next endpoint on that address."""

    def __init__(self) -> None:
        self._used: dict[str, int] = {}

    def next(self, address: str) -> int:
        slot = self._used.get(address, 0)
        self._used[address] = slot + 1
        return slot


@dataclass(frozen=True)
class PortUse:
    """A port (or `count` consecutive ports) that a process of the job listens on, on one node."""
    node: str
    address: str
    port: int
    count: int
    what: str  # "pserver 0", "master (rank 0)", "watchdog coordinator"
    setting: str  # a PORT_SETTINGS key: what to change when it is taken
    udp: bool = False  # a datagram socket (the ballot box), not a TCP listener: bound, never connected to by a check

    @property
    def ports(self) -> range:
        return range(self.port, self.port + self.count)


def configured_ports(cluster: Cluster) -> dict[str, int | None]:
    """The port settings as cluster.yaml gives them (None: auto)."""
    job = cluster.job
    return {"master_port": job.master_port, "pserver_port": job.pserver.port, "watchdog_port": job.watchdog.port}


def pserver_layout(cluster: Cluster, base: int) -> list[tuple[Node, int, int]]:
    """(node, pserver rank, first port) of every pserver, the ranges starting at `base`.

    Pservers that share an address (one node, or several nodes on one machine)
    take consecutive ranges of ports_num + ports_num_for_sparse, so no two collide.
    """
    job = cluster.job
    if job.mode != "pserver":
        return []
    span = job.pserver.ports_num + job.pserver.ports_num_for_sparse
    taken, pservers = AddressSlots(), []
    for node in cluster.pserver_nodes:
        for _ in range(job.pserver.per_node):
            pservers.append((node, len(pservers), base + taken.next(node.address) * span))
    return pservers


def port_uses(cluster: Cluster, ports: dict[str, int | None], unchecked: bool = False) -> list[PortUse]:
    """Every port the job listens on, node by node, for the given settings.

    Checked: each pserver's range (pserver mode), rank 0's master_port
    (collective mode: its store), the watchdog's coordinator on the first
    node (in a job that elects, on every node, and each node's ballot box,
    UDP, on the next port). `unchecked` adds master_port in pserver mode: the trainers are told
    it (MASTER_PORT) though the reference workload never listens there, so
    only an `auto` one needs choosing. A setting given as None is left out.
    """
    job, uses = cluster.job, []
    span = job.pserver.ports_num + job.pserver.ports_num_for_sparse
    if ports.get("pserver_port") is not None:
        uses += [PortUse(n.name, n.address, port, span, f"pserver {rank}", "pserver_port")
                 for n, rank, port in pserver_layout(cluster, ports["pserver_port"])]
    master = cluster.trainer_nodes[0]
    if ports.get("master_port") is not None and (job.mode == "collective" or unchecked):
        # on_failure restart: generation g's rendezvous is master_port + g (node/coordination/elastic.py)
        generations = 1 + (job.watchdog.max_restarts if job.watchdog.enabled and job.watchdog.on_failure == "restart"
                           else 0)
        uses.append(PortUse(master.name, master.address, ports["master_port"], generations,
                            "master (rank 0)" if generations == 1 else
                            "master (rank 0; generation g listens on master_port + g)", "master_port"))
    first = cluster.nodes[0]
    if ports.get("watchdog_port") is not None and job.watchdog.enabled:
        uses.append(PortUse(first.name, first.address, ports["watchdog_port"], 1, "watchdog coordinator",
                            "watchdog_port"))
        if elects(cluster):  # any node's agent may be elected to host it (docs/partitions.md, "Majority election")
            uses += [PortUse(n.name, n.address, ports["watchdog_port"], 1, "watchdog coordinator (if elected)",
                             "watchdog_port") for n in cluster.nodes[1:]]
            # every agent's ballot box (node/agent/elect.py, ballot_port): UDP, the coordinator's port + 1
            uses += [PortUse(n.name, n.address, ports["watchdog_port"] + 1, 1, BALLOT_BOX, "watchdog_port", udp=True)
                     for n in cluster.nodes]
    return uses


def elects(cluster: Cluster) -> bool:
    """The job elects its coordinator by majority (elastic.Layout.elects): min_nodes under on_failure restart,
    three or more nodes, every one a trainer node, no spare."""
    w, nodes = cluster.job.watchdog, cluster.nodes
    return (w.enabled and w.on_failure == "restart" and w.min_nodes is not None and len(nodes) >= 3
            and all("trainer" in n.roles and "pserver" not in n.roles and not n.spare for n in nodes))


def needed_ports(cluster: Cluster) -> tuple[str, ...]:
    """The port settings the plan writes somewhere: an `auto` one among them must be chosen."""
    job = cluster.job
    return ("master_port",) + (("pserver_port",) if job.mode == "pserver" else ()) + \
        (("watchdog_port",) if job.watchdog.enabled else ())


def resolved_ports(cluster: Cluster, chosen: dict[str, int] | None) -> dict[str, int | None]:
    """The port settings a plan writes: cluster.yaml's, with the `auto` ones a probe `chosen`."""
    ports = {**configured_ports(cluster), **(chosen or {})}
    missing = [k for k in needed_ports(cluster) if ports[k] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} is auto: the plan needs the Network a probe chose")
    return ports


def auto_uses(cluster: Cluster, setting: str) -> list[PortUse]:
    """Where `setting`'s port is listened on, its port 0 standing for whatever port is drawn: each use's
    `port` is its offset from the port drawn."""
    return port_uses(cluster, {setting: 0}, unchecked=True)


def choose_auto(cluster: Cluster, busy: dict[str, set[int]], rng: random.Random) -> tuple[dict[str, int], tuple]:
    """The job's ports (fixed ones as given, each `auto` one free on every node concerned) and which were auto.

    busy: per node, the ports a socket holds or a running fabtrain job has
    claimed. The draw itself is contract/portdraw.py's, the one a Slurm
    allocation draws with.
    """
    configured = configured_ports(cluster)
    # Only the ports this mode uses: a collective job has no pserver_port to show or record.
    ports = {k: configured[k] for k in needed_ports(cluster)}
    auto = [k for k in ports if ports[k] is None]
    held: dict[str, set[int]] = {}
    for u in port_uses(cluster, configured, unchecked=True):
        held.setdefault(u.node, set()).update(u.ports)
    wanted = [(k, [(u.node, u.port, u.count) for u in auto_uses(cluster, k)]) for k in auto]
    try:
        ports.update(portdraw.draw(wanted, held, busy, AUTO_WINDOW, rng))
    except LookupError as e:
        lo, hi = AUTO_WINDOW
        raise UserError(f"{cluster.path}: {PORT_SETTINGS[e.args[0]]}: auto: no free port in "
                        f"{lo}-{hi} on the nodes concerned; give a port") from None
    return ports, tuple(auto)


def clashes(uses: list[PortUse]) -> list[str]:
    """Two of the job's own ports that are one port on one node (master_port = watchdog.port)."""
    seen: dict[tuple[str, int, bool], PortUse] = {}
    out = []
    for u in uses:
        for p in u.ports:
            other = seen.setdefault((u.node, p, u.udp), u)  # a UDP port and a TCP port of one number are two
            if other is not u and other.setting != u.setting:
                out.append(f"{u.node}: port {p} is both {other.what} ({PORT_SETTINGS[other.setting]}) and "
                           f"{u.what} ({PORT_SETTINGS[u.setting]}): change one, or set it to auto")
    return out
