"""Nodes with their own network, on one machine: each sshd node in its own network namespace, and
partitions made as the world makes them (see /work/shared/NETWORK.md's facts, and docs/partitions.md).

A node is a namespace `fbtp-<pid>-<node>` with one veth pair: its end (`eth0`, an address in
198.51.100.0/24, a documentation range no real network uses) inside, the other end on a bridge in the
root namespace, where the tests (the controller) run. The nodes reach each other over the bridge, the
controller reaches them through the bridge's own address. Every node's sshd listens on its address,
port 22, inside its namespace; everything `fab` starts there (agents, keepers, trainers) inherits it.

Cuts and heals:

    cluster.cut(node, "link")       the node's veth set down in the root namespace: both ways, for everyone
    cluster.cut(node, "drop")       nft in the node's namespace: every packet in and out dropped, silently
    cluster.cut(node, "drop-out")   ... only what the node sends (one way)
    cluster.cut(node, "drop-in")    ... only what it receives (the other way)
    cluster.cut(node, "loss", 30)   nft numgen: 30 % of the packets it receives and 30 % of those it sends
    cluster.cut(node, "peer", peer="node2")  nft in the node's namespace: every packet to and from node2 dropped
                                    (the node and node2 no longer reach each other; both still reach the rest)
    cluster.cut(node, "tcp-port", port=7180)  TCP to and from port 7180 of other hosts dropped (a
                                    connection that cannot be kept, where datagrams still pass)
    cluster.cut(node, "controller") nft in the root namespace: the controller's packets to the node dropped;
                                    the nodes still reach each other (bridged traffic does not pass it)
    cluster.cap(node, "8mbit")      tbf on the root-side veth: what is sent to the node, capped
    cluster.cap(node, "20mbit", way="out")  tbf on the node's eth0, inside its namespace: what it sends, capped
    cluster.heal(node)              every cut and cap of the node undone

Each namespace has its own /etc/resolv.conf (`ip netns exec` mounts /etc/netns/<ns>/resolv.conf over it, for
sshd and all it starts): a nameserver on the node's own loopback, so a lookup fails at once. The machine's
nameserver is out of a node's reach, and a lookup would wait out every timeout (10 s for a reverse lookup,
which torch.distributed's store makes for each peer that connects).

Clean-up is the fixture's own business, also when a run is interrupted: `close()` (the fixture's
finalizer, and atexit) kills every process inside the namespaces and removes them, the bridge and the
root namespace's nft tables; and every new cluster first sweeps what a run that is gone left behind
(names carry the pid of the run that made them).
"""
from __future__ import annotations

import atexit
import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.sshd import SSHD, SshdCluster, SshNode

PREFIX = "fbtp"  # every namespace, link and nft table this module makes starts with it
SUBNET = "198.51.100"
SSH_PORT = 22
SLOTS = 15  # /28 blocks of SUBNET: each cluster alive on this machine holds one
NETNS_ETC = "/etc/netns"  # per-namespace files `ip netns exec` mounts over /etc's


def _take_slot(first: int) -> tuple[int, int]:
    """(a block of SUBNET no other live cluster holds, its lock's descriptor, held while the cluster lives):
    two test runs at once (make test runs two test files at a time) never share addresses. A process that
    dies lets its lock go with it."""
    for i in range(SLOTS):
        slot = (first + i) % SLOTS
        fd = os.open(f"/run/{PREFIX}-slot-{slot}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return slot, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"all {SLOTS} address blocks of {SUBNET}.0/24 are held by other test runs")


def available() -> str | None:
    """None if this machine can make such nodes, else why not."""
    for tool in ("ip", "nft", "tc"):
        if not shutil.which(tool):
            return f"{tool} is not installed (iproute2, nftables)"
    probe = subprocess.run(["unshare", "--net", "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces and veth pairs need root: {probe.stderr.strip()}"
    return None


def _run(*argv: str, check: bool = True, ns: str | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    if ns is not None:
        argv = ("ip", "netns", "exec", ns, *argv)
    out = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pids_in(ns: str) -> list[int]:
    """Every process inside namespace `ns` (`ip netns pids`)."""
    out = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _remove_namespace(ns: str) -> None:
    for _ in range(20):
        pids = pids_in(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _run("ip", "netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
    try:
        os.rmdir(NETNS_ETC)  # only if no other namespace has files there
    except OSError:
        pass


def sweep(only_pid: int | None = None) -> list[str]:
    """Remove what this module made: of `only_pid`'s run, or of every run whose process is gone."""
    def stale(name: str) -> bool:
        m = re.match(rf"{PREFIX}[-_]?[a-z]*[-_]?(\d+)", name)
        if not m:
            return False
        pid = int(m.group(1))
        return pid == only_pid if only_pid is not None else not _alive(pid)

    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(PREFIX + "-") and stale(ns):
            _remove_namespace(ns)
            removed.append(ns)
    for ns in os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else ():
        if ns.startswith(PREFIX + "-") and stale(ns):
            _remove_namespace(ns)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+: ([^:@]+)", line)
        if m and m.group(1).startswith(PREFIX) and stale(m.group(1)):
            _run("ip", "link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    for line in _run("nft", "list", "tables", check=False).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2].startswith(PREFIX) and stale(parts[2]):
            _run("nft", "delete", "table", parts[1], parts[2], check=False)
            removed.append(parts[2])
    return removed


class NetnsCluster(SshdCluster):
    """`count` sshd nodes, node1..nodeN, each in its own network namespace on one bridge."""

    def __init__(self, root: Path, count: int = 3):
        sweep()
        self.pid = os.getpid()
        self.slot, self._slot_lock = _take_slot(self.pid)
        base = 16 * self.slot
        self.bridge = f"{PREFIX}b{self.pid}"
        self.gateway = f"{SUBNET}.{base + 1}"
        self.names = [f"node{i + 1}" for i in range(count)]
        self.ns = {n: f"{PREFIX}-{self.pid}-{n}" for n in self.names}
        self.veth = {n: f"{PREFIX}{self.pid}n{i + 1}" for i, n in enumerate(self.names)}
        self.address = {n: f"{SUBNET}.{base + 2 + i}" for i, n in enumerate(self.names)}
        self.cuts: dict[str, set] = {n: set() for n in self.names}
        self.closed = False
        atexit.register(self.close)
        try:
            self._make_network()
            super().__init__(root, count, addresses=[self.address[n] for n in self.names], port=SSH_PORT)
        except BaseException:
            self.close()
            raise

    def _make_network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/28", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for n in self.names:
            ns, veth = self.ns[n], self.veth[n]
            _run("ip", "netns", "add", ns)
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "resolv.conf"), "w") as f:
                f.write("nameserver 127.0.0.1\n")
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            _run("ip", "link", "set", veth + "p", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "link", "set", "lo", "up", ns=ns)
            _run("ip", "link", "set", veth + "p", "name", "eth0", ns=ns)
            _run("ip", "addr", "add", f"{self.address[n]}/28", "dev", "eth0", ns=ns)
            _run("ip", "link", "set", "eth0", "up", ns=ns)
            _run("ip", "route", "add", "default", "via", self.gateway, ns=ns)

    def command(self, node: SshNode) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node.name], SSHD, "-D", "-e", "-f", str(node.config)]

    # -- cuts --------------------------------------------------------------------------------

    def _table(self, node: str) -> str:
        return f"{PREFIX}_{self.pid}_{node}"

    def cut(self, node: str, how: str, percent: int = 30, port: int = 0, peer: str = "") -> float:
        """Cut `node` off as `how` says (the module's docstring); returns when (time.time())."""
        ns, table = self.ns[node], self._table(node)
        if how == "peer":  # `node` and `peer` no longer reach each other; every other packet passes
            _run("nft", "-f", "-", ns=ns, input="table inet %s {\nchain in { type filter hook input priority 0; "
                 "ip saddr %s drop; }\nchain out { type filter hook output priority 0; ip daddr %s drop; }\n}\n"
                 % (table, self.address[peer], self.address[peer]))
        elif how == "tcp-port":  # TCP to and from `port` elsewhere dropped; every other packet passes
            _run("nft", "-f", "-", ns=ns, input="table inet %s {\nchain in { type filter hook input priority 0; "
                 "iifname \"eth0\" tcp sport %d drop; }\nchain out { type filter hook output priority 0; "
                 "oifname \"eth0\" tcp dport %d drop; }\n}\n" % (table, port, port))
        elif how == "link":
            _run("ip", "link", "set", self.veth[node], "down")
        elif how in ("drop", "drop-in", "drop-out", "loss"):
            verdict = "drop" if how != "loss" else f"numgen random mod 100 < {int(percent)} drop"
            rules = []
            if how in ("drop", "drop-in", "loss"):
                rules.append(f"chain in {{ type filter hook input priority 0; iifname \"eth0\" {verdict}; }}")
            if how in ("drop", "drop-out", "loss"):
                rules.append(f"chain out {{ type filter hook output priority 0; oifname \"eth0\" {verdict}; }}")
            _run("nft", "-f", "-", ns=ns, input="table inet %s {\n%s\n}\n" % (table, "\n".join(rules)))
        elif how == "controller":
            _run("nft", "-f", "-", input="table inet %s {\nchain out { type filter hook output priority 0; ip daddr %s "
                                          "drop; }\n}\n" % (table, self.address[node]))
        else:
            raise ValueError(f"unknown cut {how!r}")
        self.cuts[node].add(how)
        return time.time()

    def cap(self, node: str, rate: str = "8mbit", way: str = "in") -> None:
        """What is sent to `node` (way "in": tbf on the root side of its veth), or what it sends (way "out": tbf
        on its eth0 inside its namespace), limited to `rate`."""
        tbf = ("root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")
        if way == "out":
            _run("tc", "qdisc", "replace", "dev", "eth0", *tbf, ns=self.ns[node])
            self.cuts[node].add("cap-out")
        else:
            _run("tc", "qdisc", "replace", "dev", self.veth[node], *tbf)
            self.cuts[node].add("cap")

    def heal(self, node: str) -> float:
        """Undo every cut and cap of `node`; returns when (time.time())."""
        ns, table = self.ns[node], self._table(node)
        cuts = self.cuts[node]
        if "link" in cuts:
            _run("ip", "link", "set", self.veth[node], "up")
        if cuts & {"drop", "drop-in", "drop-out", "loss", "tcp-port", "peer"}:
            _run("nft", "delete", "table", "inet", table, ns=ns, check=False)
        if "controller" in cuts:
            _run("nft", "delete", "table", "inet", table, check=False)
        if "cap" in cuts:
            _run("tc", "qdisc", "del", "dev", self.veth[node], "root", check=False)
        if "cap-out" in cuts:
            _run("tc", "qdisc", "del", "dev", "eth0", "root", check=False, ns=ns)
        cuts.clear()
        return time.time()

    def pids(self, node: str) -> list[int]:
        """Every process inside the node's namespace but its sshd listener."""
        listener = next((n.process.pid for n in self.nodes if n.name == node and n.process), None)
        return [p for p in pids_in(self.ns[node]) if p != listener]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for node in getattr(self, "nodes", []):
            try:
                self.stop(node)
            except Exception:  # noqa: BLE001 - clean-up goes on whatever one node did
                pass
        for n in self.names:
            _remove_namespace(self.ns[n])
        sweep(only_pid=self.pid)
        _run("ip", "link", "del", self.bridge, check=False)
        os.close(self._slot_lock)  # the block is free for another cluster only once nothing of ours is on it


def write_corpus(path: Path) -> Path:
    """A text corpus of about 6 MB that does not compress away: split over three nodes, each shard is about
    2 MB, some 16 s over a 1 mbit link (time enough to cut it half-way)."""
    words = [f"w{i}" for i in range(500)]
    with path.open("w") as f:
        for i in range(120_000):
            f.write(" ".join(words[(i * 7 + k * 13) % 500] for k in range(8)) + "\n")
    return path


def write_project_with_a_blob(folder: Path) -> bytes:
    """A project folder (train.py) with a 2 MB file of random bytes, incompressible: some 16 s over a 1 mbit
    link. Returns the blob, to check what arrives."""
    folder.mkdir(parents=True)
    (folder / "train.py").write_text("print('hello')\n")
    blob = os.urandom(2_000_000)
    (folder / "weights.bin").write_bytes(blob)
    return blob


def cut_mid_file(net: NetnsCluster, argv: list[str], env: dict, folder: Path, temp_prefix: str):
    """Run `argv` (a fab task whose rsync writes to node3), set node3's link down once a file under `folder`
    named `temp_prefix`* (rsync's temp name) holds 100 kB: (the finished process, its output, seconds from
    the cut to its end)."""
    from tests.support import REPO
    from tests.support.procscan import wait_for

    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def writing():
            return folder.is_dir() and any(p.name.startswith(temp_prefix) and p.stat().st_size > 100_000
                                           for p in folder.rglob(temp_prefix + "*"))
        if not wait_for(writing, timeout=60):
            raise AssertionError(f"no {temp_prefix}* file of 100 kB under {folder} within 60 s (exit {proc.poll()})")
        cut = net.cut("node3", "link")
        out, _ = proc.communicate(timeout=60)
        return proc, out, time.time() - cut
    finally:
        if proc.poll() is None:
            proc.kill()


# -- module fixtures: import them into a test module (`from tests.support.netns import net, root`) ----------------


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """Three nodes (tests/support/partition_job.py's NODES), each its own network, for a whole test module."""
    from tests.conftest import require
    from tests.support.partition_job import NODES

    why = available()
    require(why is None, "network namespaces", why or "")
    cluster = NetnsCluster(tmp_path_factory.mktemp("netns"), len(NODES))
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The workspaces every job of the module uses: deployed by the module's first job only."""
    return tmp_path_factory.mktemp("jobs")
