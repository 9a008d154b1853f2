"""Running things on nodes: one interface, a local and an SSH implementation.

`LocalTransport` serves `host: local` nodes (subprocesses, invoke for shell
commands); `SSHTransport` the rest (a Fabric Connection, host keys checked
by `hostkeys` on every hop). Both offer the same two things: `run` a shell
command, and `open_stream`, a process on the node whose stdin and stdout
the node-ops protocol (fabtrain.remote.rpc) talks over, so every task is
written once. `fan_out` runs a function over many nodes in parallel, with a
bound, and never lets one node's failure hide another node's result.
"""
from __future__ import annotations

import errno
import os
import select
import shlex
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import invoke
import paramiko

from fabtrain.remote import hostkeys
from fabtrain.config.cluster import Node
from fabtrain.contract.states import signal_name

# NodeError.kind: what a report calls the node.
UNREACHABLE = "unreachable"  # no connection: refused, no route, timed out, name not known, host key, login
NO_REPLY = "no-reply"        # connected, but no answer in time: a busy node, not a lost one
FAILED = "failed"            # the node answered with an error, or the command failed there


def down_label(kind: str | None) -> str:
    """What every report (fab status, check, watch, the dashboard) calls a node that did not answer:
    a busy node that was reached but slow is NO REPLY, not a lost one."""
    return {NO_REPLY: "NO REPLY", FAILED: "ERROR"}.get(kind, "UNREACHABLE")


class NodeError(Exception):
    """Something went wrong on, or on the way to, one node. One line, says which; `kind` says how.
    A node op's refusal also carries its code and detail (fabtrain.contract.replies), for a caller to act on."""

    def __init__(self, message: str, kind: str = FAILED, code: str | None = None, detail: Any = None):
        super().__init__(message)
        self.kind = kind
        self.code = code
        self.detail = detail


@dataclass
class Reply:
    node: str
    ok: bool
    value: Any = None
    error: str | None = None
    kind: str | None = None  # NodeError.kind when not ok
    code: str | None = None  # a refusal's code (fabtrain.contract.replies) when not ok
    detail: Any = None  # what the refusal's code comes with


def quote_path(path: str) -> str:
    """Quote a path for the node's shell, keeping a leading ~/ expandable."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


class ProcessStream:
    """A process on this machine (a local node), spoken to over its stdin and stdout.

    Its stderr goes to a temporary file, read only to say why it ended: no
    pipe to drain, so it can never block the process."""

    def __init__(self, argv: list[str]):
        self.stderr = tempfile.TemporaryFile()
        # In the home directory, as over SSH: a relative workspace means the same on every node.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     bufsize=0, cwd=os.path.expanduser("~"))
        os.set_blocking(self.proc.stdin.fileno(), False)

    def send(self, data: bytes, deadline: float | None) -> None:
        """Write it all, or raise TimeoutError (not read in time) or OSError (gone)."""
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while view:
            if select.select([], [fd], [], _left(deadline))[1]:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:  # the pipe filled up again meanwhile
                    pass

    def recv(self, timeout: float | None) -> bytes | None:
        """Some bytes; b"" at the end of the stream; None if nothing came within timeout."""
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return None
        return os.read(fd, 1 << 20)

    def close_input(self) -> None:
        self.proc.stdin.close()

    def ended(self) -> tuple[str, str]:
        """(its last line on stderr, how it exited), once its output has ended."""
        try:
            code = self.proc.wait(2)
        except subprocess.TimeoutExpired:
            code = None
        self.stderr.seek(0)
        return _last_line(self.stderr.read()), _exit_text(code)

    def close(self, wait: float = 2.0) -> None:
        """End its input; give it `wait` seconds to exit, then kill it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


class SSHStream:
    """A command on an SSH node (one session channel of the node's connection)."""

    def __init__(self, chan: paramiko.Channel):
        self.chan = chan

    def send(self, data: bytes, deadline: float | None) -> None:
        sent = 0
        while sent < len(data):
            self.chan.settimeout(_left(deadline))
            try:
                n = self.chan.send(data[sent:sent + (1 << 16)])
            except socket.timeout:  # the node's side did not take it in time (its window stayed full)
                raise TimeoutError from None
            if n == 0:
                raise OSError("the channel is closed")
            sent += n

    def recv(self, timeout: float | None) -> bytes | None:
        self.chan.settimeout(timeout)
        try:
            return self.chan.recv(1 << 20)
        except socket.timeout:
            return None

    def close_input(self) -> None:
        self.chan.shutdown_write()

    def ended(self) -> tuple[str, str]:
        err = b""
        while self.chan.recv_stderr_ready():
            err += self.chan.recv_stderr(1 << 16)
        # The exit status follows the end of output; a dropped connection never sends it.
        code = self.chan.exit_status if self.chan.status_event.wait(2) else None
        return _last_line(err), _exit_text(code)

    def close(self, wait: float = 2.0) -> None:
        try:
            self.chan.shutdown_write()
        except Exception:  # already closed, or the connection is gone: nothing to tell it
            pass
        self.chan.close()


def _last_line(data: bytes) -> str:
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _exit_text(code: int | None) -> str:
    if code is None or code == -1:
        return "no exit status"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exit code {code}"


class Transport:
    """Connects to one node: runs shell commands and opens streams (rpc.py speaks node ops over them)."""

    node: Node
    context: invoke.Context

    def open_stream(self, argv: list[str], timeout: float | None = None):
        """Start argv on the node; a ProcessStream or SSHStream to talk to it."""
        raise NotImplementedError

    def run(self, command: str, *, timeout: float | None = None) -> invoke.Result:
        try:
            return self.context.run(command, hide=True, warn=True, in_stream=False, timeout=timeout)
        except invoke.CommandTimedOut:
            raise NodeError(f"{self.node.name}: connected, no reply within {timeout:g} s (command)", NO_REPLY) from None
        except Exception as e:
            raise NodeError(describe_connect_error(self.node, e), UNREACHABLE) from None

    def close(self) -> None:
        pass


class LocalTransport(Transport):
    def __init__(self, node: Node, config: invoke.Config | None = None):
        self.node = node
        self.context = invoke.Context(config=config)

    def open_stream(self, argv: list[str], timeout: float | None = None) -> ProcessStream:
        argv = [os.path.expanduser(argv[0]), *argv[1:]]
        try:
            return ProcessStream(argv)
        except OSError as e:
            raise NodeError(f"{self.node.name}: cannot run {argv[0]}: {e.strerror or e}") from None


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
            raise NodeError(describe_connect_error(self.node, e), UNREACHABLE) from None

    def open_stream(self, argv: list[str], timeout: float | None = None) -> SSHStream:
        self.open()  # NodeError with the usual one-line reason if unreachable
        # The node's login shell runs it: only the interpreter's path may need its ~ expanded.
        command = " ".join([quote_path(argv[0]), *map(shlex.quote, argv[1:])])
        try:
            chan = self.context.client.get_transport().open_session(timeout=timeout)
        except paramiko.SSHException as e:
            if "Timeout" in str(e):  # logged in, but sshd did not open a session in time
                raise NodeError(f"{self.node.name}: connected, no reply within {timeout:g} s (opening a session)",
                                NO_REPLY) from None
            raise NodeError(describe_connect_error(self.node, e), UNREACHABLE) from None
        except Exception as e:
            raise NodeError(describe_connect_error(self.node, e), UNREACHABLE) from None
        try:
            chan.exec_command(command)
        except Exception as e:
            chan.close()
            raise NodeError(describe_connect_error(self.node, e), UNREACHABLE) from None
        return SSHStream(chan)

    def ssh_config_files(self) -> list[str]:
        """The ssh config files Fabric read for this connection, as OpenSSH would take them.

        `fab -S FILE` (kept by Fabric as its runtime path, not in ssh_config_path)
        or the ssh_config_path setting: that file only. Otherwise the user's
        then the system's, unless load_ssh_configs is off. Paths from $HOME,
        as Fabric has them (OpenSSH would look in the passwd entry's home).
        """
        config = self.context.config
        runtime = getattr(config, "_runtime_ssh_path", None) or config.get("ssh_config_path")
        if runtime:
            return [os.path.expanduser(runtime)]
        if not config.get("load_ssh_configs", True):
            return []
        paths = (getattr(config, "_user_ssh_path", "~/.ssh/config"), getattr(config, "_system_ssh_path", "/etc/ssh/ssh_config"))
        return [p for p in map(os.path.expanduser, paths) if os.path.isfile(p)]

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
        # paramiko gathers refused and no-route failures of every address the name resolved to
        reasons = list(dict.fromkeys(_socket_failure(err, ssh.connect_timeout) for err in e.errors.values()))
        return f"{where}: unreachable: {'; '.join(reasons) if reasons else 'connection refused'}"
    if isinstance(e, socket.gaierror):
        return f"{where}: unreachable: cannot resolve host name {node.host!r} ({_resolve_failure(e)})"
    if isinstance(e, (OSError, EOFError)) and _socket_failure(e, ssh.connect_timeout, None):
        return f"{where}: unreachable: {_socket_failure(e, ssh.connect_timeout)}"
    if isinstance(e, (OSError, EOFError)):
        return f"{where}: unreachable: {e.strerror if getattr(e, 'strerror', None) else e}"
    if isinstance(e, paramiko.SSHException) and ("protocol banner" in str(e) or str(e) == "No existing session"):
        # paramiko's words when the TCP connection was made but the SSH handshake never finished
        # (it stops waiting for it after connect_timeout and then has no session to log in on)
        return (f"{where}: unreachable: the connection was accepted but the SSH handshake did not finish within "
                f"connect_timeout {ssh.connect_timeout:g} s (a hung or overloaded sshd, or no SSH server on that port)")
    if isinstance(e, paramiko.SSHException) and "No authentication methods available" in str(e):
        return (f"{where}: authentication failed: no key, ssh-agent or password to offer; set ssh.key, "
                f"load a key into ssh-agent, or use fab --prompt-for-login-password")
    if isinstance(e, paramiko.SSHException):
        return f"{where}: ssh error: {e}"
    if isinstance(e, invoke.UnexpectedExit):
        return f"{where}: command failed with exit code {e.result.exited}"
    return f"{where}: cannot connect: {e or 'no detail from the SSH library'}"  # in words, never a class name


_CONNECT_ERRNOS = {
    errno.ECONNREFUSED: "connection refused",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network is unreachable",
    errno.ECONNRESET: "connection reset by the node",
}


def _socket_failure(e: BaseException, connect_timeout: float, default: str | None = "") -> str | None:
    """What one failed connect really was: refused, no answer (timed out), no route, ..."""
    if isinstance(e, (socket.timeout, TimeoutError)) or getattr(e, "errno", None) == errno.ETIMEDOUT:
        return f"no answer within connect_timeout {connect_timeout:g} s"
    code = getattr(e, "errno", None)
    if code in _CONNECT_ERRNOS:
        return _CONNECT_ERRNOS[code]
    if default == "":
        return (getattr(e, "strerror", None) or str(e) or type(e).__name__).lower()
    return default


def _resolve_failure(e: socket.gaierror) -> str:
    if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
        return "name not known"
    if e.errno == socket.EAI_AGAIN:
        return "temporary failure in name resolution: is DNS reachable?"
    return e.strerror or str(e)


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
            return Reply(name(item), False, error=str(e), kind=e.kind, code=e.code, detail=e.detail)

    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(items)))) as pool:
        return list(pool.map(one, items))
