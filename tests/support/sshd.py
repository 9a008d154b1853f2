"""Real OpenSSH servers on 127.0.0.x for the tests: one sshd per "node".

Each node gets its own host key; the tests get one user key, an
authorized_keys file and a known_hosts file that lists every node's key, so
host-key checking is on (strict) exactly as on a real cluster. All nodes
listen on one port, each on its own loopback address.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

SSHD = "/usr/sbin/sshd"
from tests.support import REPO


def ensure_openssh() -> list[str]:
    """Install openssh-server and rsync where missing (the tests install what they need).
    Returns the packages still missing (apt-get failed: not root, no network)."""
    wanted = (("openssh-server", SSHD), ("rsync", "/usr/bin/rsync"), ("openssh-client", "/usr/bin/ssh"))
    missing = [pkg for pkg, path in wanted if not os.path.exists(path)]
    if missing:
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=False, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        missing = [pkg for pkg, path in wanted if not os.path.exists(path)]
    if not missing:
        os.makedirs("/run/sshd", exist_ok=True)
    return missing


def login_account(name: str, user_key: Path) -> "pwd.struct_passwd":
    """A non-root account (shell /bin/sh) that the sshd nodes let in with the tests' user key; made if
    missing, the key added if it is not there yet."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True)
    # useradd locks the account ("!"), and sshd refuses a locked account even with a key: no password instead.
    subprocess.run(["usermod", "-p", "*", name], check=True)
    user = pwd.getpwnam(name)
    # sshd reads authorized keys as the user: the key goes in the user's own ~/.ssh.
    ssh_dir = Path(user.pw_dir) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    keys = ssh_dir / "authorized_keys"
    pub = Path(f"{user_key}.pub").read_text()
    old = keys.read_text() if keys.exists() else ""
    if pub not in old:
        keys.write_text(old + pub)
    for path in (ssh_dir, keys):
        os.chown(path, user.pw_uid, user.pw_gid)
    return user


BLOCK = 16  # callers use port, port + 1, ... (a pserver per port, the coordinator's): the whole block is free
_handed_out: list[int] = []
PORTS_START, PORTS_END = 10000, 32768  # test ports: under the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range)


def free_port(addresses: list[str], udp: bool = False) -> int:
    """The first of BLOCK ports that nobody holds on any of these addresses, and that no earlier call of this
    test run handed out. Probed without SO_REUSEADDR, as a plain program binds: a port an earlier test's
    connection left in TIME_WAIT is taken, not free, for such a program. `udp`: free for UDP as well (an
    elected job's ballot boxes listen on UDP beside the coordinator's TCP port)."""
    # pytest-xdist's workers each draw from a slice of their own: a port handed out to one worker and not yet
    # bound is free for the other's probe. Every slice lies below the kernel's ephemeral range (32768 up): a
    # port in it can be taken, between this probe and the program's bind, by any outgoing connection (an ssh
    # client's, a store client's), which is how a torchrun test once met EADDRINUSE on master_port + 1.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    span = (PORTS_END - PORTS_START) // workers
    base = PORTS_START + span * (worker % workers)
    first = max(base + os.getpid() % max(1, span // 4), max(_handed_out, default=0) + BLOCK)
    for port in [*range(first, PORTS_END - BLOCK), *range(PORTS_START, min(first, PORTS_END - BLOCK))]:
        if port in _handed_out:
            continue
        try:
            for a in addresses:
                for p in range(port, port + BLOCK):
                    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM) if udp else (socket.SOCK_STREAM,):
                        with socket.socket(socket.AF_INET, kind) as s:
                            s.bind((a, p))
        except OSError:
            continue
        _handed_out.append(port)
        return port
    raise RuntimeError("no free port")


@dataclass
class SshNode:
    name: str
    address: str
    host_key: Path
    config: Path
    process: subprocess.Popen | None = None


class SshdCluster:
    def __init__(self, root: Path, count: int, first: int = 2, addresses: list[str] | None = None,
                 port: int | None = None):
        missing = ensure_openssh()
        if missing:
            raise RuntimeError(f"cannot install {', '.join(missing)} (apt-get needs root and a package source)")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.user_key = root / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.user_key)], check=True)
        self.authorized_keys = root / "authorized_keys"
        shutil.copy(f"{self.user_key}.pub", self.authorized_keys)
        self.known_hosts = root / "known_hosts"
        addresses = addresses or [f"127.0.0.{first + i}" for i in range(count)]
        self.port = port or free_port(addresses)
        self.nodes: list[SshNode] = []
        lines = []
        for i, address in enumerate(addresses):
            node = self._make_node(f"node{i + 1}", address)
            self.nodes.append(node)
            pub = Path(f"{node.host_key}.pub").read_text().split()
            lines.append(f"[{address}]:{self.port} {pub[0]} {pub[1]}\n" if self.port != 22 else
                         f"{address} {pub[0]} {pub[1]}\n")
        self.known_hosts.write_text("".join(lines))
        for node in self.nodes:
            self.start(node)

    def _make_node(self, name: str, address: str) -> SshNode:
        host_key = self.root / f"host_{name}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
        config = self.root / f"sshd_{name}.conf"
        config.write_text(f"""\
ListenAddress {address}:{self.port}
HostKey {host_key}
PidFile {self.root}/sshd_{name}.pid
AuthorizedKeysFile {self.authorized_keys} .ssh/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
LogLevel ERROR
MaxStartups 200:30:400
MaxSessions 200
Subsystem sftp internal-sftp
""")
        return SshNode(name, address, host_key, config)

    def command(self, node: SshNode) -> list[str]:
        """How the node's sshd is started (a subclass may start it elsewhere: tests/support/netns.py)."""
        return [SSHD, "-D", "-e", "-f", str(node.config)]

    def start(self, node: SshNode) -> None:
        node.process = subprocess.Popen(self.command(node),
                                        stdout=subprocess.DEVNULL, stderr=open(self.root / f"sshd_{node.name}.log", "ab"))
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection((node.address, self.port), timeout=0.5):
                    return
            except OSError:
                if node.process.poll() is not None:
                    raise RuntimeError(f"sshd for {node.name} exited: {(self.root / f'sshd_{node.name}.log').read_text()}")
                time.sleep(0.05)
        raise RuntimeError(f"sshd for {node.name} did not start")

    def stop(self, node: SshNode) -> None:
        """Stop the listener (existing sessions are separate processes and live on)."""
        if node.process and node.process.poll() is None:
            node.process.terminate()
            node.process.wait(5)

    def close(self) -> None:
        for node in self.nodes:
            self.stop(node)

    def ssh_settings(self, policy: str = "strict") -> dict:
        return {"user": "root", "port": self.port, "key": str(self.user_key),
                "known_hosts": str(self.known_hosts), "host_key_policy": policy, "connect_timeout": 5}


def write_cluster(path: Path, sshd: SshdCluster | None, *, ssh_nodes: list[tuple[str, list[str]]] = (),
                  local_nodes: list[tuple[str, list[str]]] = (), job: dict | None = None,
                  name: str = "test", policy: str = "strict", extra_node_fields: dict | None = None) -> Path:
    """A cluster file over sshd nodes (by name) and local nodes, each with its own workspace."""
    root = path.parent
    nodes = []
    for node_name, roles in local_nodes:
        nodes.append({"name": node_name, "host": "local", "roles": roles, "workspace": str(root / f"ws-{node_name}")})
    by_name = {n.name: n for n in sshd.nodes} if sshd else {}
    for node_name, roles in ssh_nodes:
        nodes.append({"name": node_name, "host": by_name[node_name].address, "roles": roles,
                      "workspace": str(root / f"ws-{node_name}")})
    for n in nodes:
        n.update((extra_node_fields or {}).get(n["name"], {}))
    doc = {
        "cluster": {"name": name, "python": sys.executable,
                    "ssh": sshd.ssh_settings(policy) if sshd else {}},
        "nodes": nodes,
        # The tests' programs (tests/programs, workload/) are this checkout's code.
        "job": {"code": str(REPO), **(job or {})},
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class SilentListener:
    """A TCP listener on `address` that never accepts: a host that does not answer, on this machine.

    full=True: its accept queue is filled first, so the kernel drops every further SYN (as a firewall
    that drops packets, or a machine that is off, would): a connect times out. full=False: the kernel
    still completes connections into the queue, but nothing ever speaks (a hung sshd): no SSH banner.
    """

    def __init__(self, address: str, port: int, full: bool = True):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(0 if full else 64)
        self.address, self.port, self.fillers = address, port, []
        if full:
            for _ in range(8):
                s = socket.socket()
                s.settimeout(0.5)
                try:
                    s.connect((address, port))
                except OSError:           # the queue is full: that SYN was dropped
                    s.close()
                    break
                self.fillers.append(s)
            with socket.socket() as probe:
                probe.settimeout(0.5)
                try:
                    probe.connect((address, port))
                    raise RuntimeError(f"{address}:{port} still answers with its queue full")
                except (socket.timeout, TimeoutError):
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for s in self.fillers:
            s.close()
        self.sock.close()
