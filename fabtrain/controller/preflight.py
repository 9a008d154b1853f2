"""The network before a job starts: interfaces, free ports, reachability.

Three users, one node op (`netcheck`, fabtrain/node/netcheck.py), one
fan-out each, every node at once:

- `fab check` (`network_check`): every node opens a short-lived listener on
  each port it will hold for the job and connects to every such port of the
  others; a table says what listened, what was reached, through which
  interface, and one line per problem says which node, which port and what
  to do. `auto` ports are picked blind for it (a start picks again).
- the start tasks (`prepare_start`): is every fixed port free on its node
  (bound, or claimed by another fabtrain job there that has not bound it
  yet)? If not, refuse before anything starts. Choose the `auto` ports among
  those free on the nodes concerned; find the interface carrying each
  node's address. The result is the plan's `Network`.
- `fab plan` (`plan_network`): the same probe, refusing nothing.

`fab check --bandwidth` (`bandwidth`) adds a short all-reduce across the
nodes (fabtrain/node/bandwidth.py) on a port chosen the same way.
"""
from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field

from fabtrain.config.cluster import Cluster
from fabtrain.contract.opreplies import Probe
from fabtrain.errors import UserError
from fabtrain.plan.plan import IFACE_VARS, Network
from fabtrain.plan.ports import (AUTO_WINDOW, PORT_SETTINGS, PortUse, choose_auto, clashes, configured_ports, needed_ports,
                                 port_uses)
from fabtrain.remote import rpc
from fabtrain.remote.session import Session
from fabtrain.remote.transport import FAILED, Reply, fan_out

EXCHANGE_DEADLINE = 8.0  # seconds a node waits for the others' listeners and connections


@dataclass
class NetworkCheck:
    """What the network check found: the ports it used, each node's reply, and the verdict."""
    network: Network
    uses: list[PortUse]
    replies: dict[str, Reply]  # the value of each that answered: a contract.opreplies.Netcheck
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# -- the fan-out ---------------------------------------------------------------------------


def _payloads(cluster: Cluster, uses: list[PortUse], serve: bool, job_id: str | None, token: str,
              asked: set[str] | None = None) -> dict[str, dict]:
    """Each node's netcheck request: the ports it holds, and (serve) the others' ports to reach.

    asked: the nodes whose busy ports and other jobs' claims are wanted (all when None). Finding
    them reads /proc/net/tcp and every process's environment on the node, which a node that
    holds none of the job's ports need not do."""
    payloads = {}
    for node in cluster.nodes:
        # a UDP port (the ballot box) is only bound, never connected to: nobody reaches it, it expects nobody
        listen = [{"port": p, "what": u.what, "setting": u.setting, "expect": 0 if u.udp else len(cluster.nodes) - 1,
                   **({"udp": True} if u.udp else {})} for u in uses if u.node == node.name for p in u.ports]
        reach = [{"node": u.node, "address": u.address, "port": p, "what": u.what}
                 for u in uses if u.node != node.name and not u.udp for p in u.ports] if serve else []
        payloads[node.name] = {
            "address": node.address, "peers": sorted({n.address for n in cluster.nodes if n.name != node.name}),
            "listen": listen, "reach": reach, "serve": serve, "token": token, "deadline": EXCHANGE_DEADLINE,
            "job_id": job_id}
        if asked is None or node.name in asked:
            payloads[node.name]["window"] = list(AUTO_WINDOW)
        else:
            payloads[node.name]["claims"] = False
    return payloads


def _fan_out(session: Session, payloads: dict[str, dict], call=rpc.call) -> dict[str, Reply]:
    """call: rpc.call, or an rpc.Channels' call whose processes the next step reuses."""
    nodes = session.cluster.nodes
    # Every node at once, whatever ssh.parallel says: a node's listeners must be
    # up while the others connect to them.
    replies = fan_out([session.transport(n) for n in nodes],
                      lambda t: call(t, "netcheck", payloads[t.node.name], timeout=EXCHANGE_DEADLINE + 60),
                      max(session.cluster.parallel, len(nodes)))
    return {r.node: _as_asked(r, payloads[r.node]) for r in replies}


def _as_asked(reply: Reply, payload: dict) -> Reply:
    """The reply, or that node's failure where its ports are not those it was asked about: the findings
    take each port's node and setting from the node's answer (contract/opreplies.py Netcheck)."""
    if not reply.ok:
        return reply
    listen = [(e.port, e.what, e.setting) for e in reply.value.listen]
    reach = [(t.node, t.address, t.port, t.what) for t in reply.value.reach]
    if listen == [(e["port"], e["what"], e["setting"]) for e in payload["listen"]] and \
            reach == [(t["node"], t["address"], t["port"], t["what"]) for t in payload["reach"]]:
        return reply
    return Reply(reply.node, False, error=f"{reply.node}: malformed netcheck reply: its ports are not the ones "
                                          f"it was asked about", kind=FAILED)


# -- choosing `auto` ports -------------------------------------------------------------------


def _busy(replies: dict[str, Reply]) -> dict[str, set[int]]:
    """Per node, the ports in AUTO_WINDOW a socket holds or a running fabtrain job has claimed."""
    busy = {}
    for name, r in replies.items():
        if r.ok:
            held = set(r.value.busy or [])
            for c in r.value.claimed:
                held.update(range(c.port, c.port + c.count))
            busy[name] = held
    return busy


def choose_ports(cluster: Cluster, replies: dict[str, Reply], rng: random.Random | None = None) -> Network:
    """The job's Network from the probe's replies: its ports (plan/ports.py chooses the `auto` ones among
    those free on the nodes concerned), and the interface found carrying each node's address."""
    ports, auto = choose_auto(cluster, _busy(replies), rng or random.Random(secrets.randbits(64)))
    ifaces = {name: r.value.iface for name, r in replies.items() if r.ok and r.value.iface}
    return Network(ports=ports, auto=auto, ifaces=ifaces)


# -- the verdict -----------------------------------------------------------------------------


def _fix(setting: str) -> str:
    return f"stop it, or set {PORT_SETTINGS[setting]}: auto (or another port)"


def _listen_findings(cluster: Cluster, uses: list[PortUse], replies: dict[str, Reply], starting: bool):
    """(problems, notes, ports that did not open: {(node, port)}) of every port the job holds."""
    problems, notes, closed = [], [], set()
    by_node = {n.name: n for n in cluster.nodes}
    for name, r in replies.items():
        if not r.ok:
            continue
        own_ws = r.value.workspace
        for e in r.value.listen:
            where = f"{name}: port {e.port} ({e.what})"
            claim = next((c for c in r.value.claimed
                          if c.port <= e.port < c.port + c.count and c.address in (None, by_node[name].address)), None)
            if e.state == "ok" and claim is None:
                continue
            closed.add((name, e.port))
            owner = e.owner  # None: /proc does not show who holds it
            holder = owner if e.state == "taken" else claim
            holder_ws = holder.workspace if holder else None
            if e.state in ("taken", "ok") and holder_ws == own_ws and holder_ws:
                # This cluster's own running job: the start refuses it itself ("still running").
                if not starting:
                    job = (owner.job_id if owner else None) or (claim.job_id if claim else None)
                    notes.append(f"{where} is held by this cluster's running job {job} (fab kill-all frees it)")
                continue
            if e.state == "taken":
                who = (f"pid {owner.pid} ({owner.command or '?'})" if owner and owner.pid
                       else "a process /proc does not show (another user's?)")
                job = f", job {owner.job_id} of workspace {owner.workspace}" if owner and owner.job_id else ""
                problems.append(f"{where} is in use by {who}{job}: {_fix(e.setting)}")
            elif e.state == "ok":
                problems.append(f"{where} belongs to job {claim.job_id} of workspace {claim.workspace} "
                                f"({claim.what}), running here: {_fix(e.setting)}")
            else:
                problems.append(f"{where}: cannot listen: {e.error}: set {PORT_SETTINGS[e.setting]} "
                                f"to a port >= 1024, or auto")
    return problems, notes, closed


def _reach_findings(cluster: Cluster, replies: dict[str, Reply], closed: set) -> list[str]:
    problems = []
    for name, r in replies.items():
        if not r.ok:
            continue
        for t in r.value.reach:
            if t.state == "ok" or not replies[t.node].ok or (t.node, t.port) in closed:
                continue  # the node, or its listener there, is reported already
            target = f"{t.node} {t.address}:{t.port} ({t.what})"
            via = f" from {t.local}" if t.local else ""
            why = {
                "refused": f"connection refused while the check listened there: a firewall on {t.node} or on "
                           f"the way rejects it; allow TCP {t.port}{via}",
                "timeout": f"no answer within the check's time: a firewall drops it; allow TCP {t.port}{via}",
                "other": f"another program answered: is {t.address} really {t.node}'s address? (nodes[].address)",
            }.get(t.state, f"{t.error}: check nodes[].address of {t.node}")
            problems.append(f"{name}: cannot reach {target}: {why}")
    return problems


def _node_findings(cluster: Cluster, replies: dict[str, Reply], starting: bool) -> tuple[list[str], list[str]]:
    problems, notes = [], []
    env = dict(cluster.job.env)
    for node in cluster.nodes:
        r = replies[node.name]
        if not r.ok:
            if not starting:  # a start reports it itself, node by node
                problems.append(f"{r.error} (its network is not checked)")
            continue
        v = r.value
        if not v.address_ip:
            problems.append(f"{node.name}: its address {node.address} does not resolve there: set nodes[].address")
            continue
        if not v.address_local:
            notes.append(f"{node.name}: {node.address} is not an address of that machine (NAT?): listeners take "
                         f"every address; gloo/NCCL use {v.iface or '?'}, the way to the other nodes")
        if not (node.iface or v.iface or all(var in env for var in IFACE_VARS)):
            problems.append(f"{node.name}: no interface carries {node.address} there: set nodes[].iface")
        for peer, route in v.routes.items():
            if not route.local:
                problems.append(f"{node.name}: no route to {peer} (another node's address): check its network")
    return problems, notes


def assess(cluster: Cluster, network: Network, replies: dict[str, Reply], starting: bool = False,
           hosts: set[str] | None = None) -> NetworkCheck:
    """The verdict on a netcheck fan-out; `hosts`: judge only the ports these nodes hold."""
    uses = port_uses(cluster, network.ports)
    if hosts is not None:
        # The others' ports are not judged: the same reply, with no ports of its own.
        replies = {n: r if n in hosts or not r.ok else Reply(n, True, r.value.replaced(listen=[]))
                   for n, r in replies.items()}
    problems, notes = _node_findings(cluster, replies, starting)
    listen_problems, listen_notes, closed = _listen_findings(cluster, uses, replies, starting)
    problems += clashes(uses) + listen_problems
    if not starting:
        problems += _reach_findings(cluster, replies, closed)
    return NetworkCheck(network, uses, replies, problems, notes + listen_notes)


# -- the three users ---------------------------------------------------------------------------


def network_check(session: Session) -> NetworkCheck:
    """`fab check`'s network section: one fan-out.

    `auto` ports are picked blind for it (a start picks again, among the free
    ones): the fan-out's reply says what is busy, and only when a blind pick
    turns out taken (rare, in a window of 12,768) does a second one run.
    """
    cluster, token = session.cluster, secrets.token_hex(8)
    network = choose_ports(cluster, {})

    def exchange(network: Network) -> dict[str, Reply]:
        return _fan_out(session, _payloads(cluster, port_uses(cluster, network.ports), True, None, token))

    replies = exchange(network)
    if _auto_collides(network, replies):
        network = choose_ports(cluster, replies)
        replies = exchange(network)
    found = {n: r.value.iface for n, r in replies.items() if r.ok and r.value.iface}
    return assess(cluster, Network(ports=network.ports, auto=network.auto, ifaces=found), replies)


def _auto_collides(network: Network, replies: dict[str, Reply]) -> bool:
    """Whether an `auto` port picked blind was taken, or claimed by another job, on its node."""
    busy = _busy(replies)
    return any(e.setting in network.auto and (e.state != "ok" or e.port in busy.get(name, set()))
               for name, r in replies.items() if r.ok for e in r.value.listen)


def probe(session: Session, job_id: str | None, hosts: set[str] | None = None,
          call=rpc.call) -> tuple[Network, NetworkCheck]:
    """One fan-out, nothing listened on for long: the Network of a job about to start, and what was found
    (about the ports that `hosts` hold; all when None)."""
    cluster = session.cluster
    configured = configured_ports(cluster)
    # The nodes that hold a port of the job, fixed or auto (any value stands in for an auto one here):
    # only their busy ports and claims decide the auto ports and refuse a start.
    holders = {u.node for u in port_uses(cluster, dict.fromkeys(needed_ports(cluster), AUTO_WINDOW[0]), unchecked=True)}
    replies = _fan_out(session, _payloads(cluster, port_uses(cluster, configured), False, job_id,
                                          secrets.token_hex(8), holders), call)
    network = choose_ports(cluster, replies)
    return network, assess(cluster, network, replies, starting=True, hosts=hosts)


def prepare_start(session: Session, job_id: str, roles: tuple[str, ...], call=rpc.call) -> Network:
    """Before a start: refuse (one line naming node and port) when a fixed port that this
    step's nodes will hold is taken; choose the `auto` ports; find each node's interface.

    Only this step's nodes: the watchdog's port on a first node that runs only
    trainers is bound by start-trainers, and checked there by its agent (the
    coordinator refuses a port someone holds, in one line)."""
    hosts = {n.name for n in session.cluster.nodes if set(n.roles) & set(roles)}
    network, found = probe(session, job_id, hosts, call)
    if found.problems:
        more = f" (and {len(found.problems) - 1} more)" if len(found.problems) > 1 else ""
        raise UserError(f"{found.problems[0]}{more}; nothing was started (fab check shows every port)")
    return network


def plan_network(session: Session) -> tuple[Network, list[str]]:
    """For `fab plan`: the Network a start would use now, and what could not be found."""
    network, found = probe(session, None)
    notes = [r.error for r in found.replies.values() if not r.ok]
    return network, notes + found.notes + found.problems


# -- fab check --bandwidth ------------------------------------------------------------------


@dataclass
class Bandwidth:
    """A short all-reduce across the nodes: what the bus carried, and the slowest link."""
    nodes: list[str]
    rendezvous: str = ""  # rank 0's address:port, where the ranks met
    backend: str = ""
    bytes: int = 0
    seconds: float = 0.0  # one all-reduce, the slowest rank's
    bus_gbps: float = 0.0  # nccl-tests' bus bandwidth: algorithm bandwidth x 2(n-1)/n
    slowest: tuple[str, float] | None = None  # (node, Gb/s of its link to the next node)
    promised_mbps: int | None = None  # the slowest interface's /sys/class/net/<if>/speed
    problems: list[str] = field(default_factory=list)


def _free_port(busy: set[int], avoid: set[int]) -> int:
    lo, hi = AUTO_WINDOW
    rng = random.Random(secrets.randbits(64))
    for port in [rng.randint(lo, hi) for _ in range(200)] + list(range(lo, hi + 1)):
        if port not in busy and port not in avoid:
            return port
    raise UserError(f"no free port in {lo}-{hi} on the first node for the bandwidth test")


def bandwidth(session: Session, check: NetworkCheck, probes: dict[str, Probe], size_mb: float = 16,
              iterations: int = 5, timeout: float = 30) -> Bandwidth:
    """One rank per node, all at once (fabtrain/node/bandwidth.py); NCCL when every node has a GPU.
    probes: fab check's, of the nodes that answered it."""
    cluster = session.cluster
    up = [n for n in cluster.nodes if check.replies.get(n.name) and check.replies[n.name].ok]
    result = Bandwidth([n.name for n in up])
    for n in up:
        if n.name not in probes or not probes[n.name].torch:
            result.problems.append(f"{n.name}: torch is not installed for {n.python}: the bandwidth test needs it")
    if len(up) < len(cluster.nodes) or result.problems or not up:
        result.problems.append("bandwidth: not measured (every node must take part)")
        return result
    backend = "nccl" if all(probes[n.name].gpus for n in up) else "gloo"
    port = _free_port(_busy(check.replies).get(up[0].name, set()), {p for u in check.uses for p in u.ports})
    env = dict(cluster.job.env)
    result.rendezvous = f"{up[0].address}:{port}"

    def one(t):
        rank = [n.name for n in up].index(t.node.name)
        iface = t.node.iface or check.network.ifaces.get(t.node.name)
        pins = {var: env.get(var) or iface for var in IFACE_VARS if env.get(var) or iface}
        return rpc.call(t, "bandwidth", {"rank": rank, "world_size": len(up), "master": up[0].address, "port": port,
                                    "backend": backend, "env": pins, "size_mb": size_mb, "iterations": iterations,
                                    "timeout": timeout}, timeout=timeout * 3 + 60)

    replies = fan_out([session.transport(n) for n in up], one, len(up))  # every rank at once
    failed = [r for r in replies if not r.ok]
    if failed:
        result.problems += [f"bandwidth: {r.error}" for r in failed]
        return result
    v, n = replies[0].value, len(up)
    result.backend, result.bytes = v.backend, v.bytes
    result.seconds = max(v.allreduce_s)
    algbw = v.bytes / result.seconds
    result.bus_gbps = algbw * (2 * (n - 1) / n if n > 1 else 1) * 8 / 1e9
    if v.link_s:
        # link_s[r] is rank r receiving from rank r-1: the slowest one names its sender.
        r = max(range(len(v.link_s)), key=lambda i: v.link_s[i])  # one a rank: contract/opreplies.py Bandwidth
        result.slowest = (up[(r - 1) % n].name, v.bytes * 8 / v.link_s[r] / 1e9)
    speeds = [check.replies[x.name].value.speed for x in up]
    result.promised_mbps = min(speeds) if all(speeds) else None
    return result
