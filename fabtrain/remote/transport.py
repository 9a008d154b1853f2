"""Running things on nodes: one interface, a local and an SSH implementation.

`LocalTransport` (invoke) serves `host: local` nodes; `SSHTransport` (Fabric
Connection, host keys checked by `hostkeys`) the rest. Both run node_ops.py
the same way, so every task is written once. `fan_out` runs a function over
many nodes in parallel, with a bound, and never lets one node's failure hide
another node's result.
"""
from __future__ import annotations

import base64
import json
import shlex
import socket
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import invoke
import paramiko

from fabtrain.node import bundle
from fabtrain.remote import hostkeys
from fabtrain.config.cluster import Node

# node ops and the node modules they import, as one program text (fabtrain/node/bundle.py)
NODE_OPS_SOURCE = bundle.source()
SENTINEL = "@@fabtrain-reply@@"
_BOOTSTRAP = "import base64,sys,zlib;exec(zlib.decompress(base64.b64decode(sys.argv.pop(1))))"
_NODE_OPS_PACKED = base64.b64encode(zlib.compress(NODE_OPS_SOURCE.encode(), 9)).decode()


class NodeError(Exception):
    """Something went wrong on, or on the way to, one node. One line, says which."""


@dataclass
class Reply:
    node: str
    ok: bool
    value: Any = None
    error: str | None = None


def quote_path(path: str) -> str:
    """Quote a path for the node's shell, keeping a leading ~/ expandable."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def node_ops_command(python: str, op: str, payload: dict) -> str:
    """The one remote command that runs node_ops.py with a payload.

    The script travels base64-encoded on the command line: no stdin handling,
    nothing to deploy first, and only [A-Za-z0-9+/=] reaches the shell.
    """
    packed = base64.b64encode(json.dumps(payload).encode()).decode()
    return f"{quote_path(python)} -c {shlex.quote(_BOOTSTRAP)} {_NODE_OPS_PACKED} {op} {packed}"


def parse_reply(node: str, stdout: str, stderr: str, exited: int) -> Any:
    head, sep, tail = stdout.rpartition(SENTINEL)
    if not sep:
        last = (stderr.strip().splitlines() or stdout.strip().splitlines() or [f"exit code {exited}"])[-1]
        raise NodeError(f"{node}: node-side command failed: {last}")
    reply = json.loads(tail.strip().splitlines()[0])
    if not reply["ok"]:
        raise NodeError(f"{node}: {reply['error']}")
    return reply["result"]


class _Passthrough:
    """out_stream for streamed ops: forwards lines until the reply begins."""

    def __init__(self, sink, lock: threading.Lock):
        self.sink, self.lock, self.buffer, self.done = sink, lock, "", False

    def write(self, data: str) -> None:
        if self.done:
            return
        self.buffer += data
        *lines, self.buffer = self.buffer.split("\n")
        with self.lock:
            for line in lines:
                if line == SENTINEL:
                    self.done = True
                    break
                if line:
                    self.sink.write(line + "\n")
            self.sink.flush()

    def flush(self) -> None:
        pass


_print_lock = threading.Lock()


class Transport:
    """Runs node_ops.py and shell commands on one node."""

    node: Node
    context: invoke.Context

    def call(self, op: str, payload: dict, *, timeout: float | None = None, stream=None) -> Any:
        payload = {"workspace": self.node.workspace, "node": self.node.name, **payload}
        command = node_ops_command(self.node.python, op, payload)
        kwargs: dict[str, Any] = {"hide": True, "warn": True, "in_stream": False, "timeout": timeout}
        if stream is not None:
            kwargs.update(hide="stderr", out_stream=_Passthrough(stream, _print_lock))
        try:
            result = self.context.run(command, **kwargs)
        except invoke.CommandTimedOut:
            raise NodeError(f"{self.node.name}: {op} timed out after {timeout:g} s") from None
        except Exception as e:
            raise NodeError(describe_connect_error(self.node, e)) from None
        return parse_reply(self.node.name, result.stdout, result.stderr, result.exited)

    def run(self, command: str, *, timeout: float | None = None) -> invoke.Result:
        try:
            return self.context.run(command, hide=True, warn=True, in_stream=False, timeout=timeout)
        except invoke.CommandTimedOut:
            raise NodeError(f"{self.node.name}: command timed out after {timeout:g} s") from None
        except Exception as e:
            raise NodeError(describe_connect_error(self.node, e)) from None

    def rsync_destination(self, remote_dir: str) -> tuple[list[str], str]:
        """(extra rsync args, destination) to copy into remote_dir on this node.

        The directory is made if it is missing (here for a local node; by the
        remote side's rsync-path for an SSH node), so no extra round trip.
        """
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalTransport(Transport):
    def __init__(self, node: Node, config: invoke.Config | None = None):
        self.node = node
        self.context = invoke.Context(config=config)

    def rsync_destination(self, remote_dir: str) -> tuple[list[str], str]:
        path = Path(remote_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return [], f"{path}/"


class SSHTransport(Transport):
    def __init__(self, node: Node, config=None):
        import fabric

        self.node = node
        ssh = node.ssh
        config = config or fabric.Config()
        # Keep what fab's own flags put there (--prompt-for-login-password,
        # --prompt-for-passphrase, -i): those are never in cluster.yaml.
        connect_kwargs = dict(config.connect_kwargs)
        if ssh.key:
            connect_kwargs["key_filename"] = [str(Path(ssh.key).expanduser())]
        self.context = fabric.Connection(node.host, user=ssh.user, port=ssh.port, config=config,
                                         connect_timeout=ssh.connect_timeout, connect_kwargs=connect_kwargs)
        # ProxyJump hops from ~/.ssh/config become gateway Connections, each
        # with Fabric's accept-anything policy: check every hop's key too.
        hop = self.context
        while isinstance(hop, fabric.Connection):
            hostkeys.apply_policy(hop.client, ssh.known_hosts, ssh.host_key_policy)
            hop = hop.gateway

    def open(self) -> None:
        try:
            self.context.open()
        except Exception as e:
            raise NodeError(describe_connect_error(self.node, e)) from None

    def ssh_command(self) -> list[str]:
        """The OpenSSH client command with the same settings (for rsync -e)."""
        ssh = self.node.ssh
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(ssh.connect_timeout))}"]
        # The ssh config file Fabric read (OpenSSH would look in the passwd
        # entry's home, not $HOME): aliases, ProxyJump and keys agree.
        ssh_config = Path(self.context.config.get("ssh_config_path") or "~/.ssh/config").expanduser()
        if ssh_config.is_file():
            cmd += ["-F", str(ssh_config)]
        cmd += hostkeys.openssh_options(ssh.known_hosts, ssh.host_key_policy)
        if ssh.port:
            cmd += ["-p", str(ssh.port)]
        if ssh.user:
            cmd += ["-l", ssh.user]
        if ssh.key:
            cmd += ["-i", str(Path(ssh.key).expanduser())]
        return cmd

    def rsync_destination(self, remote_dir: str) -> tuple[list[str], str]:
        remote_dir = remote_dir.rstrip("/")
        # rsync's remote paths are relative to the login's home, so ~/x -> x.
        path = remote_dir[2:] if remote_dir.startswith("~/") else remote_dir
        return ["-e", shlex.join(self.ssh_command()),
                f"--rsync-path=mkdir -p {quote_path(remote_dir)} && rsync"], f"{self.node.host}:{path}/"

    def close(self) -> None:
        self.context.close()


def describe_connect_error(node: Node, e: Exception) -> str:
    ssh = node.ssh
    where = f"{node.name} ({ssh.user + '@' if ssh.user else ''}{node.host}{':' + str(ssh.port) if ssh.port else ''})"
    if isinstance(e, hostkeys.UnknownHostKey):
        return f"{where}: {e}"
    if isinstance(e, paramiko.BadHostKeyException):
        target = f"[{node.host}]:{ssh.port}" if ssh.port and ssh.port != 22 else node.host
        return (f"{where}: HOST KEY CHANGED: known_hosts has {e.expected_key.get_name()} {e.expected_key.fingerprint}, "
                f"the server offered {e.key.fingerprint}; refusing to connect (someone may be intercepting). "
                f"If the server was reinstalled, remove the old key: ssh-keygen -R '{target}' -f {ssh.known_hosts}")
    if isinstance(e, paramiko.AuthenticationException):
        return f"{where}: authentication failed ({e}); check the key, ssh-agent, or use fab --prompt-for-login-password"
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return f"{where}: unreachable: connection refused"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"{where}: unreachable: no answer within connect_timeout {ssh.connect_timeout:g} s"
    if isinstance(e, socket.gaierror):
        return f"{where}: unreachable: cannot resolve host name {node.host!r}"
    if isinstance(e, (OSError, EOFError)):
        return f"{where}: unreachable: {e.strerror if getattr(e, 'strerror', None) else e}"
    if isinstance(e, paramiko.SSHException) and "No authentication methods available" in str(e):
        return (f"{where}: authentication failed: no key, ssh-agent or password to offer; set ssh.key, "
                f"load a key into ssh-agent, or use fab --prompt-for-login-password")
    if isinstance(e, paramiko.SSHException):
        return f"{where}: ssh error: {e}"
    if isinstance(e, invoke.UnexpectedExit):
        return f"{where}: command failed with exit code {e.result.exited}"
    return f"{where}: {type(e).__name__}: {e}"


def make_transport(node: Node, config=None) -> Transport:
    return LocalTransport(node) if node.is_local else SSHTransport(node, config)


def fan_out(items: Iterable[Any], fn: Callable[[Any], Any], parallel: int, name=lambda t: t.node.name) -> list[Reply]:
    """Run fn over items in parallel (at most `parallel` at once), in order.

    A NodeError becomes that node's failed Reply; the others go on. Any other
    exception is a bug and propagates.
    """
    items = list(items)

    def one(item) -> Reply:
        try:
            return Reply(name(item), True, fn(item))
        except NodeError as e:
            return Reply(name(item), False, error=str(e))

    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(items)))) as pool:
        return list(pool.map(one, items))
