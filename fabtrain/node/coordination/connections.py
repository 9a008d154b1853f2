"""The coordinator's open connections: accepted, capped, timed out, written to, closed.

Knows nothing of the job. Connections that have not proved the job's secret
are few (a cap per address and in all, never below the job's number of
nodes; the oldest gives way, since an agent needs one round trip) and short-lived (HELLO_TIMEOUT,
then PROOF_TIMEOUT), so a flood of idle connections cannot use up the agent's file descriptors. Each node keeps one
authenticated connection, its newest. Every refusal is counted; an event says
so at once and then at most every REFUSED_EVENT_EVERY seconds, so a flood is
one line in events.jsonl, not thousands.
"""
from __future__ import annotations

import collections
import errno
import fcntl
import selectors
import socket
import struct
import termios
import time
from collections.abc import Callable  # not typing: its import is ~5 ms of every agent's start

from fabtrain.contract.events import EventKind

from . import protocol
from .protocol import Channel, LineReader

UNAUTHENTICATED_MAX = 64  # connections still in their handshake, in all (at least: see Connections)
UNAUTHENTICATED_PER_ADDRESS = 16  # ... from one address: a flood from one host evicts its own
# Seconds from accept to a hello that names one of this job's nodes, and then from our challenge to the
# proof of the secret. An agent sends its hello as it connects, but on a node whose every core is busy
# (every agent and trainer of a job starting at once) it may wait many seconds for a time slice at
# either step, so a few seconds would refuse agents of a legitimate start. Slow is not hostile; the
# caps above, not these deadlines, keep a flood from the descriptors.
HELLO_TIMEOUT = 30.0
PROOF_TIMEOUT = 30.0
MAX_OUTBUF = 1 << 20  # a peer that does not read is dropped (it reconnects)
REFUSED_EVENT_EVERY = 60.0
HUNG_FACTOR = 6  # a peer whose connection stays open is lost after this many peer_timeouts of silence


def hung_timeout(peer_timeout: float) -> float:
    """Silence after which a peer (or the coordinator) whose TCP connection is still open is lost."""
    return HUNG_FACTOR * peer_timeout


def kernel_timeout(peer_timeout: float, interval: float) -> float:
    """How long the kernel waits for the other side's kernel: an interval less than peer_timeout, so a
    cut connection is closed by the time the silence on it reaches peer_timeout."""
    return max(2.0, peer_timeout - interval)


def watch_liveness(sock: socket.socket, timeout: float) -> None:
    """Let the kernel close `sock` once the other side's kernel has not answered for `timeout` seconds.

    TCP keepalive probes an idle connection every second, and TCP_USER_TIMEOUT
    bounds how long sent data (a beat, a reply, a probe) may stay unacknowledged.
    Both are answered by the kernel on the other side, not by the process: a
    process that is slow, starved of CPU or stopped keeps its connection, while
    a network cut or a host that is down ends it within `timeout`, and a process
    that died ends it at once (its kernel closes the socket). Where the platform
    lacks an option, the coordinator's silence limits still apply.
    """
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, int(timeout))),
                        ("TCP_USER_TIMEOUT", int(timeout * 1000))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:
            pass


def unacknowledged(sock: socket.socket) -> int | None:
    """Bytes sent on `sock` that the other side's kernel has not acknowledged (TIOCOUTQ): more than 0
    while the network holds or loses them; None where the socket is closed or the platform cannot say."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return None


def descriptors_for(nodes: int) -> int:
    """Raise this process's soft limit on open files to what a coordinator of `nodes` nodes may hold:
    one authenticated connection a node, the handshakes' cap, and the agent's own files. The usual
    soft limit (1,024) is below that from ~480 nodes on; the hard limit is left alone, and where it is
    lower the accept loop's EMFILE handling still evicts the oldest handshake. Returns the limit now."""
    try:
        import resource
    except ImportError:  # not on Linux: the platform's limit
        return -1
    need = 2 * nodes + UNAUTHENTICATED_MAX + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class Conn:
    __slots__ = ("sock", "addr", "reader", "outbuf", "node", "claimed", "channel", "opened", "heard", "deadline")

    def __init__(self, sock: socket.socket, addr, now: float):
        self.sock, self.addr, self.outbuf = sock, addr, b""
        self.reader = LineReader(protocol.MAX_HELLO)
        self.node: str | None = None  # set once it proved the secret
        self.claimed: str | None = None  # the node its hello named
        self.channel: Channel | None = None
        self.opened = self.heard = now
        self.deadline = now + HELLO_TIMEOUT  # to prove the secret; see challenged()

    @property
    def where(self) -> str:
        return "%s:%s" % (self.addr[0], self.addr[1]) if isinstance(self.addr, tuple) else str(self.addr)


def _unread(sock: socket.socket) -> bool:
    """Bytes wait on `sock` that the loop has not read yet: what the peer sent in time is judged, not
    refused because our own loop was slow to reach it (a starved coordinator accepts, and its deadline
    check may come before the select that would read the hello)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except OSError:  # nothing yet (EAGAIN), or a connection already gone
        return False


class Connections:
    def __init__(self, sel: selectors.BaseSelector, on_event: Callable[..., None], nodes: int = 0):
        self.sel = sel
        # Every node of the job may be in its handshake at once (all agents start together), and all
        # from one address (`host: local` nodes, nodes behind one NAT): the caps are never below the
        # job's size, or a legitimate start evicts its own agents (200 local nodes did, under load).
        self.per_address = max(UNAUTHENTICATED_PER_ADDRESS, nodes)
        self.in_all = max(UNAUTHENTICATED_MAX, nodes + UNAUTHENTICATED_MAX - UNAUTHENTICATED_PER_ADDRESS)
        self.on_event = on_event
        self.all: dict[socket.socket, Conn] = {}
        self.pending: collections.OrderedDict[socket.socket, Conn] = collections.OrderedDict()  # oldest first
        self.by_node: dict[str, Conn] = {}
        self.refused = 0  # connections closed for what they sent (or did not send)
        self.last_refusal: str | None = None
        self._reported = (0, -REFUSED_EVENT_EVERY)  # (refused, monotonic) at the last event

    def accept(self, server: socket.socket) -> None:
        for _ in range(64):  # drain a burst, but let the others be served too
            try:
                sock, addr = server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self.pending:
                    self.refuse(next(iter(self.pending.values())), "out of file descriptors: the oldest handshake")
                    continue
                self.note_refusal("cannot accept a connection: %s" % (e.strerror or e))
                return
            conn = Conn(sock, addr, time.monotonic())
            self._make_room(conn)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.all[sock] = self.pending[sock] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _make_room(self, conn: Conn) -> None:
        same = [c for c in self.pending.values() if c.addr[0] == conn.addr[0]]
        if len(same) >= self.per_address:
            self.refuse(same[0], "too many connections from %s without the secret" % conn.addr[0])
        if len(self.pending) >= self.in_all:
            self.refuse(next(iter(self.pending.values())), "too many connections without the secret")

    def expire(self, now: float, silent: float) -> None:
        """Drop handshakes past their deadline, and agents silent for `silent` seconds."""
        for conn in list(self.pending.values()):
            if now > conn.deadline and not _unread(conn.sock):
                self.refuse(conn, "no proof of the secret within %g s of the challenge" % PROOF_TIMEOUT
                            if conn.claimed else "no hello within %g s" % HELLO_TIMEOUT)
        for conn in list(self.by_node.values()):
            if now - conn.heard > silent:
                self.close(conn)  # the agent reconnects if it lives; the board decides if it is lost

    def challenged(self, conn: Conn, node: str) -> None:
        """`conn`'s hello named `node` of this job and got our challenge: it has PROOF_TIMEOUT to answer."""
        conn.claimed = node
        conn.deadline = time.monotonic() + PROOF_TIMEOUT

    def authenticated(self, conn: Conn, peer_timeout: float) -> None:
        """`conn` proved the secret for the node its hello named: the kernel watches it from now on."""
        self.pending.pop(conn.sock, None)
        watch_liveness(conn.sock, peer_timeout)
        conn.node = conn.claimed
        conn.reader.limit = protocol.MAX_FRAME
        older = self.by_node.get(conn.node)
        self.by_node[conn.node] = conn
        if older is not None:
            self.close(older)  # one connection per node: an agent that reconnected leaves its old one behind

    def open(self, conn: Conn) -> bool:
        return conn.sock in self.all

    def send(self, conn: Conn, data: bytes) -> None:
        conn.outbuf += data
        self.flush(conn)

    def flush(self, conn: Conn) -> None:
        if conn.sock not in self.all:
            return
        try:
            while conn.outbuf:
                n = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[n:]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close(conn)
            return
        if len(conn.outbuf) > MAX_OUTBUF:
            self.close(conn)
            return
        self.sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0), conn)

    def refuse(self, conn: Conn, reason: str) -> None:
        self.note_refusal("%s from %s%s" % (reason, conn.where, " (claims %s)" % conn.claimed if conn.claimed else ""))
        self.close(conn)

    def note_refusal(self, what: str) -> None:
        self.refused += 1
        self.last_refusal = what
        count, at = self._reported
        now = time.monotonic()
        if now - at >= REFUSED_EVENT_EVERY:
            self._reported = (self.refused, now)
            self.on_event(EventKind.COORDINATOR_REFUSED, reason="refused %d connection(s) since the last report; the last: %s"
                          % (self.refused - count, what))

    def close(self, conn: Conn) -> None:
        if self.all.pop(conn.sock, None) is None:
            return
        self.pending.pop(conn.sock, None)
        if conn.node is not None and self.by_node.get(conn.node) is conn:
            del self.by_node[conn.node]
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close_all(self) -> None:
        for conn in list(self.all.values()):
            self.close(conn)
