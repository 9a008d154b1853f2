"""Pulses: small authenticated datagrams beside the beats' connection, that renew a node's lease.

Beats go one at a time over one TCP connection (client.py). On a lossy link
that is fragile: a lost segment is sent again after TCP's retransmission
timeout, which doubles with each loss (0.2, 0.4, 0.8, 1.6 s ...), so at 30 %
loss both ways a beat now and then waits longer than `fence_after`, the
kernel gives the connection up (TCP_USER_TIMEOUT), and a node whose link
still carries most packets fences itself or is lost (bench/partitions.py,
scenario `loss`: 3 of 8 runs failed the job before pulses). A pulse is one
datagram each way, sent again every `pulse_period` while the beats are late,
each on its own: the chance that every one of them is lost within
`fence_after` is what bounds a false failure (at 30 % loss each way and a
quarter-interval period, 16 tries, each getting through 49 % of the time:
0.51 ** 16, about 2e-5), not the backoff of one connection.

    agent -> coordinator   <64 hex: HMAC(pulse key, "agent " + body)> {"node", "s": <agent nonce>, "p": <n>,
                                                                         "h": true?, "f": true?}
    coordinator -> agent   <64 hex: HMAC(pulse key, "coordinator " + body)> {"s", "p"}

A late beat is not always the network's doing: a coordinator starved of CPU
answers late too, and pulses would only add to its load (200 agents on 2
cores, each pulsing four times a second, did lose a node so). So a pulse is
answered only where the network holds something back: the node's beats'
connection is gone (for either side), or a beat of the agent's sits in it
unacknowledged by the coordinator's kernel (the agent says so: "h"), or an
answer of the coordinator's does (its kernel says so: TIOCOUTQ). Otherwise
both kernels delivered everything, the beats are late because the
coordinator is slow, and the pulse is dropped unanswered: the beats alone
keep that node, as on a busy machine they always did. "f" says the agent's
own fence rule holds (below).

The pulse key is taken from the secret and both nonces of the agent's newest
authenticated connection (protocol.Channel), so only this job's agent and
coordinator can make one; the coordinator keeps it after that connection
ends, which is when pulses matter. `p` counts up within a session: a pulse
replayed, forged, or naming no node of the job is refused, and counted like
any refused line; one of an older session is dropped unanswered. A pulse renews what a beat does: the coordinator's
`seen` of the node, and the agent's lease (the send time of the newest pulse
answered, never later than the coordinator's `seen`, so fence.py's bounds
hold unchanged). It carries no news: a node whose beats have not come for
`hung_timeout` is lost though its pulses come (board.py), and the
coordinator stops answering a node that is lost or left, so its lease runs out.
"""
from __future__ import annotations

import hmac
import select
import socket
import threading
import time
from collections.abc import Callable

from . import protocol
from .protocol import ProtocolError

MAX_PULSE = 512  # a pulse is ~130 bytes; anything longer is refused before it is parsed
_MAC_LEN = 64


def pulse_period(interval: float) -> float:
    """Seconds between pulses while the beats are late: a quarter of the beat interval."""
    return max(0.05, interval / 4)


def seal(key: bytes, side: bytes, msg: dict) -> bytes:
    body = protocol.compact(msg).encode()
    return hmac.new(key, side + b" " + body, "sha256").hexdigest().encode() + b" " + body


def body_of(data: bytes) -> dict:
    """A pulse's message, parsed but not yet authenticated (the coordinator needs its node to find the key)."""
    if len(data) > MAX_PULSE:
        raise ProtocolError("datagram of %d bytes (at most %d)" % (len(data), MAX_PULSE))
    _, _, body = data.partition(b" ")
    msg = protocol.parse(body, MAX_PULSE)
    if not isinstance(msg.get("s"), str) or type(msg.get("p")) is not int:
        raise ProtocolError("not a pulse")
    return msg


def verify(key: bytes, side: bytes, data: bytes) -> None:
    """Raise ProtocolError unless `data` was sealed with `key` by `side`."""
    mac, _, body = data.partition(b" ")
    want = hmac.new(key, side + b" " + body, "sha256").hexdigest().encode()
    if len(mac) != _MAC_LEN or not hmac.compare_digest(mac, want):
        raise ProtocolError("bad MAC on a pulse (forged, or from another session)")


class Stale(ProtocolError):
    """A pulse of one of the job's nodes from a session the coordinator does not hold (yet, or any
    more: the agent reconnects, or the coordinator restarted). Dropped without a word: it comes in
    the course of things, and is never answered."""


class Desk:
    """The coordinator's side: each node's newest session, and the answer to a pulse."""

    def __init__(self, nodes):
        self.nodes = frozenset(nodes)
        self.sessions: dict[str, list] = {}  # node -> [agent nonce, pulse key, last pulse number taken]
        self.sock: socket.socket | None = None

    def bind(self, host: str, port: int, family: int) -> bool:
        """Take the coordinator's port number for pulses (UDP). False where another program holds it:
        the agents' pulses then go unanswered, and beats alone keep the leases."""
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            return False
        sock.setblocking(False)
        self.sock = sock
        return True

    def answer(self, live: Callable[[str, bool, bool], bool], refused: Callable[[str], None]) -> None:
        """Answer the pulses waiting on the socket: each that `live(node, fencing, held)` says to (a node
        still in the job, whose beats the network holds back); `refused` is told of every datagram that is
        not a pulse of a session we know."""
        for _ in range(256):  # a burst is drained, but connections are served between bursts
            try:
                data, addr = self.sock.recvfrom(MAX_PULSE + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error of an earlier reply: that agent is unreachable for now
                continue
            try:
                node, fencing, held, reply = self.take(data)
            except Stale:
                continue
            except ProtocolError as e:
                refused("%s from %s:%s" % (e, addr[0], addr[1]))
                continue
            if live(node, fencing, held):
                try:
                    self.sock.sendto(reply, addr)
                except OSError:
                    pass

    def session(self, node: str, agent_nonce: str, key: bytes) -> None:
        """`node` authenticated a new connection: its pulses from now on are of this session."""
        self.sessions[node] = [agent_nonce, key, 0]

    def take(self, data: bytes) -> tuple[str, bool, bool, bytes]:
        """(node, whether it says it fences itself, whether it says the network holds its beat, the reply to
        send back) for one datagram, or ProtocolError."""
        msg = body_of(data)
        node = msg.get("node")
        known = self.sessions.get(node) if isinstance(node, str) else None
        if known is None or msg["s"] != known[0]:
            if node in self.nodes:
                raise Stale(node)
            raise ProtocolError("a pulse for %r, not a node of this job" % str(node)[:40])
        verify(known[1], b"agent", data)
        if msg["p"] <= known[2]:
            raise ProtocolError("pulse %d of %s replayed or reordered (last %d)" % (msg["p"], node, known[2]))
        known[2] = msg["p"]
        return node, msg.get("f") is True, msg.get("h") is True, seal(known[1], b"coordinator", {"s": msg["s"], "p": msg["p"]})


class Pulser(threading.Thread):
    """The agent's side: while the lease is older than `late` (the beats are not being answered), a
    pulse every `period`; each answer calls `renewed(monotonic, epoch)` with the pulse's send time.
    `fencing(lease age)`: the agent's own fence rule holds; `held()`: the network holds our beat back."""

    def __init__(self, host: str, port: int, period: float, late: float,
                 lease_age: Callable[[], float | None], renewed: Callable[[float, float], None],
                 fencing: Callable[[float], bool] = lambda age: False, held: Callable[[], bool] = lambda: True):
        super().__init__(name="coordinator-pulses", daemon=True)
        self.where, self.period, self.late = (host, port), period, late
        self.lease_age, self.renewed, self.fencing, self.held = lease_age, renewed, fencing, held
        self.lock = threading.Lock()
        self.current: tuple | None = None  # (node, agent nonce, key) of the newest session
        self.number = 0
        self.due = 0.0  # monotonic: the next pulse, once the lease is late
        self.sent: dict[int, tuple[float, float]] = {}  # pulse number -> (monotonic, epoch) sent, unanswered
        self.stopping = threading.Event()
        self.answered = 0  # pulses answered (health and tests)

    def session(self, node: str, agent_nonce: str, key: bytes) -> None:
        with self.lock:
            self.current, self.number, self.sent = (node, agent_nonce, key), 0, {}

    def stop(self) -> None:
        self.stopping.set()

    def _socket(self) -> socket.socket | None:
        """A datagram socket connected to the coordinator (only its answers come in), once its name resolves."""
        while not self.stopping.is_set():
            try:
                family, _, _, _, address = socket.getaddrinfo(*self.where, type=socket.SOCK_DGRAM)[0]
                sock = socket.socket(family, socket.SOCK_DGRAM)
            except OSError:  # no address for it yet: the client's connection says why; beats alone meanwhile
                self.stopping.wait(1.0)
                continue
            try:
                sock.connect(address)
                return sock
            except OSError:
                sock.close()
                self.stopping.wait(1.0)
        return None

    def run(self) -> None:
        sock = self._socket()
        if sock is None:
            return
        with sock:
            while not self.stopping.is_set():
                ready, _, _ = select.select([sock], [], [], self._pulse_if_due(sock))
                if ready:
                    self._receive(sock)

    def _pulse_if_due(self, sock: socket.socket) -> float:
        """Send a pulse if one is due; the seconds until one may be. While the beats are on time this
        thread wakes about once a lease (not every period), so a healthy job pays next to nothing."""
        age = self.lease_age()
        now = time.monotonic()
        with self.lock:
            if self.current is None or age is None:
                return self.period
            if age < self.late:
                return max(0.01, self.late - age)
            if now < self.due:
                return self.due - now
            self.due = now + self.period
            node, nonce, key = self.current
            self.number += 1
            self.sent[self.number] = (now, time.time())
            if len(self.sent) > 64:  # unanswered ones this old no longer renew anything worth having
                del self.sent[min(self.sent)]
            msg = {"node": node, "s": nonce, "p": self.number}
            if self.fencing(age):  # what we send gets there and nothing comes back: say so, and be lost at once
                msg["f"] = True
            if self.held():
                msg["h"] = True
            data = seal(key, b"agent", msg)
        try:
            sock.send(data)
        except OSError:
            pass  # unreachable now (an ICMP error of an earlier pulse): the next one tries again
        return self.period

    def _receive(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(MAX_PULSE + 1)
        except OSError:
            return
        with self.lock:
            if self.current is None:
                return
            _, nonce, key = self.current
            try:
                msg = body_of(data)
                verify(key, b"coordinator", data)
            except ProtocolError:
                return  # not our coordinator's, or an old session's: nothing renews
            sent = self.sent.get(msg["p"]) if msg["s"] == nonce else None
            if sent is None:
                return
            self.sent = {n: at for n, at in self.sent.items() if n > msg["p"]}
            self.answered += 1
        self.renewed(*sent)
