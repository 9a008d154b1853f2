"""One agent's connection to the coordinator: sends beats, receives status lines.

It talks only to a coordinator that proves it knows the job's secret (see
protocol.py): a program that took the coordinator's port gets a hello (job id,
node, a nonce) and nothing else, and whatever it answers is refused.
"""
from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from fabtrain.contract.events import EventKind

from ..hostnames import for_resolver
from . import protocol
from .pulse import Pulser, pulse_period
from .connections import HELLO_TIMEOUT, hung_timeout, kernel_timeout, unacknowledged, watch_liveness
from .protocol import Channel, LineReader, ProtocolError

REFUSED_EVENT_EVERY = 60.0  # a refused coordinator is retried every interval; said at most this often
HANDSHAKE_WAIT = HELLO_TIMEOUT  # seconds for the coordinator's challenge: as long as it waits for our hello


class Client(threading.Thread):
    """`update(beat)` hands over the latest beat; `on_message` is
    called on this thread for every status line (and for the error line of a
    coordinator that is not this job's). Reconnects by itself, with a short
    backoff, for as long as the agent lives: the coordinator may start later
    than this agent, or restart.

    `secret`, `job_id` and `node` default to the first beat's fields; a beat's
    "secret" is taken out of it and never sent.

    One beat at a time: a beat goes at once when the coordinator has answered
    the one before (or it is `urgent`: a failure, an exit), else as soon as that
    answer comes, and only the newest one goes. A coordinator that falls behind
    (starved of CPU, hundreds of agents) is sent no more than it answers, so it
    never has a backlog of stale beats to work through before the news.

    A connection is given up when it is gone (closed, reset, or closed by the
    kernel when the coordinator's host stops answering TCP for about
    `peer_timeout`: see connections.watch_liveness), and otherwise only after
    `hung_timeout(peer_timeout)` of silence: a coordinator that is slow to
    answer keeps its connection, and a reconnect would only add to its load.
    """

    def __init__(self, host: str, port: int, interval: float, on_message: Callable[[dict], None],
                 secret: str | None = None, job_id: str | None = None, node: str | None = None,
                 on_event: Callable[..., None] | None = None, peer_timeout: float | None = None):
        super().__init__(name="coordinator-client", daemon=True)
        self.host, self.port, self.interval = host, port, interval
        self.peer_timeout = peer_timeout if peer_timeout is not None else max(5 * interval, 5.0)
        self.on_message = on_message
        self.on_event = on_event or (lambda *a, **k: None)
        self.secret, self.job_id, self.node = secret, job_id, node
        self.lock = threading.Lock()
        self.beat: dict | None = None
        self.seq = 0
        self.sent_seq = 0
        self.acked_seq = 0
        self.urgent = False  # the beat waiting to go may not wait for the answer to the one before
        self.answered = True  # the last beat sent on this connection has its answer
        self.connected = False  # to a coordinator that proved the secret
        self.ever_connected = False
        self.last_contact: float | None = None  # monotonic time of the last line from the coordinator
        self.last_contact_epoch: float | None = None
        # The lease (fence.py): monotonic send time of the newest beat the coordinator answered. Not the
        # last line heard: a status pushed later may come after the coordinator last heard from us.
        self.lease: float | None = None
        self.lease_epoch: float | None = None
        self._sent_at: list = []  # (seq, monotonic, epoch) of beats sent and not answered yet
        self.error: str | None = None
        self.refused = 0  # coordinators (or lines of one) refused
        self._refusal_reported = -REFUSED_EVENT_EVERY
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = threading.Event()
        # Pulses (pulse.py) renew the lease while beats are late: from an interval on, when one is due.
        self.pulser = Pulser(for_resolver(host), port, pulse_period(interval), interval, self._lease_age,
                             self._pulse_answered, self._fencing, self._beat_held)
        self._sock: socket.socket | None = None  # the beats' connection while it is open

    def update(self, beat: dict, urgent: bool = False) -> int:
        beat = dict(beat)
        secret = beat.pop("secret", None)
        with self.lock:
            if self.secret is None:
                self.secret = secret
            self.job_id = self.job_id or beat.get("job_id")
            self.node = self.node or beat.get("node")
            self.seq += 1
            self.beat = dict(beat, seq=self.seq)
            self.urgent = self.urgent or urgent
            seq = self.seq
        self._wake()
        return seq

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def stop(self) -> None:
        self._stopping.set()
        self.pulser.stop()
        self._wake()

    def _lease_age(self) -> float | None:
        lease = self.lease
        return None if lease is None else time.monotonic() - lease

    def _beat_held(self) -> bool:
        """The beats' connection is gone, or holds a beat of ours that the coordinator's kernel has not
        acknowledged: the network is what keeps our beats from it (pulse.py: the coordinator answers
        such a pulse; one that its kernel took all our beats is slow, not cut off)."""
        sock = self._sock
        if not self.connected or sock is None:
            return True
        held = unacknowledged(sock)
        return held is None or held > 0  # None: closed meanwhile, gone

    def _fencing(self, lease_age: float) -> bool:
        """The agent's own fence rule (fence.py, agent/policy.py) holds at this lease age."""
        return lease_age >= (hung_timeout(self.peer_timeout) if self.connected else
                             kernel_timeout(self.peer_timeout, self.interval))

    def _pulse_answered(self, mono: float, wall: float) -> None:
        """The coordinator answered a pulse sent at `mono`: the lease runs from then (pulse.py)."""
        with self.lock:
            if self.lease is None or mono > self.lease:
                self.lease, self.lease_epoch = mono, wall

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def run(self) -> None:
        self.pulser.start()
        backoff = 0.1
        while not self._stopping.is_set():
            if self.job_id is None or self.node is None:  # the hello names them: wait for the first beat
                self._wait(self.interval)
                continue
            conn = self._connect()
            if conn is None:
                self._wait(backoff)
                backoff = min(self.interval, backoff * 2)
                continue
            backoff = 0.1
            self._serve(*conn)
            conn[0].close()
            self.connected = False

    def _wait(self, seconds: float) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        sel.select(seconds)
        sel.close()
        self._drain()

    def _refused(self, what: str) -> None:
        self.refused += 1
        self.error = what
        now = time.monotonic()
        if now - self._refusal_reported >= REFUSED_EVENT_EVERY:
            self._refusal_reported = now
            self.on_event(EventKind.COORDINATOR_REFUSED, reason=what)

    def _connect(self) -> tuple[socket.socket, Channel, LineReader] | None:
        """A connection to a coordinator that proved the secret, and our proof sent; or None."""
        where = "%s:%d" % (self.host, self.port)
        timeout = max(0.5, min(2.0, self.interval))
        try:
            sock = socket.create_connection((for_resolver(self.host), self.port), timeout=timeout)
        except OSError as e:
            self.error = "cannot reach the coordinator at %s: %s" % (where, e.strerror or e)
            return None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # The coordinator answers a hello from its own loop, on a node that may be busy: wait
            # as long as it waits for us (a busy agent is slow, not a squatter).
            sock.settimeout(HANDSHAKE_WAIT)
            nonce = protocol.new_nonce()
            sock.sendall(protocol.hello(self.job_id, self.node, nonce))
            reader = LineReader(protocol.MAX_HELLO)
            lines: list[bytes] = []
            while not lines:
                data = sock.recv(4096)
                if not data:
                    raise ProtocolError("it closed the connection after our hello")
                lines = reader.feed(data)
            answer = protocol.read_challenge(self.secret, self.job_id, self.node, nonce, lines[0])
            if "error" in answer:
                self.error = "coordinator at %s: %s" % (where, answer["error"])
                self.on_message({"op": "error", "error": answer["error"]})
                sock.close()
                return None
            channel = Channel(self.secret, self.job_id, self.node, nonce, answer["nonce"], "agent")
            sock.sendall(channel.seal({"op": "auth"}))
        except ProtocolError as e:
            sock.close()
            self._refused("refused the coordinator at %s: %s; it got nothing but a hello "
                          "(another program on job.watchdog.port?)" % (where, e))
            return None
        except OSError as e:
            sock.close()
            self.error = "handshake with the coordinator at %s failed: %s" % (where, e.strerror or e)
            return None
        sock.settimeout(timeout)
        watch_liveness(sock, kernel_timeout(self.peer_timeout, self.interval))
        reader.limit = protocol.MAX_FRAME
        reader.buf = b"\n".join(lines[1:] + [reader.buf]) if len(lines) > 1 else reader.buf
        self.connected, self.ever_connected, self.error = True, True, None
        with self.lock:
            self.sent_seq = 0  # a new connection gets the latest beat at once
            self.answered = True
        return sock, channel, reader

    def _renew(self, ack: int) -> None:
        """The coordinator answered beat `ack`: the lease runs from when that beat was sent."""
        answered = [s for s in self._sent_at if s[0] <= ack]
        if answered:
            _, mono, wall = answered[-1]
            if self.lease is None or mono > self.lease:
                self.lease, self.lease_epoch = mono, wall
            self._sent_at = [s for s in self._sent_at if s[0] > ack]

    def _serve(self, sock: socket.socket, channel: Channel, reader: LineReader) -> None:
        self._sock = sock
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ, "sock")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        silent_since = time.monotonic()
        sent: dict = {}  # the last beat sent on this connection: the next one carries what changed since
        pulsing = False  # the pulser uses this connection's session (the older one until the first answer)
        try:
            while not self._stopping.is_set():
                with self.lock:
                    due = self.seq > self.sent_seq and (self.answered or self.urgent)
                    beat = self.beat if due else None
                    if beat is not None:
                        self.sent_seq, self.urgent, self.answered = self.seq, False, False
                if beat is not None:
                    with self.lock:
                        self._sent_at = self._sent_at[-15:] + [(beat["seq"], time.monotonic(), time.time())]
                    sock.sendall(channel.seal(protocol.beat_changes(beat, sent)))
                    sent = beat
                for key, _ in sel.select(self.interval):
                    if key.data == "wake":
                        self._drain()
                        continue
                    data = sock.recv(65536)
                    if not data:
                        self.error = "the coordinator closed the connection"
                        return
                    for raw in reader.feed(data):
                        msg = channel.open(raw)
                        if not pulsing:  # the coordinator has taken our proof: pulses of this session from now on
                            self.pulser.session(self.node, channel.session, channel.pulse_key)
                            pulsing = True
                        silent_since = time.monotonic()
                        self.last_contact, self.last_contact_epoch = silent_since, time.time()
                        if isinstance(msg.get("ack"), int):
                            self.acked_seq = max(self.acked_seq, msg["ack"])
                            with self.lock:
                                self.answered = self.answered or msg["ack"] >= self.sent_seq
                                self._renew(msg["ack"])
                        self.on_message(msg)
                        if msg.get("op") == "error":
                            self.error = "coordinator: %s" % msg.get("error")
                            return
                # Slow is not gone: the kernel ends a connection whose other side is gone; one that stays
                # open but silent this long is a hung coordinator: reconnect (the agent's policy decides).
                if time.monotonic() - silent_since > hung_timeout(self.peer_timeout):
                    self.error = "no answer from the coordinator for %.0f s on an open connection" % (
                        time.monotonic() - silent_since)
                    return
        except ProtocolError as e:
            self._refused("refused a line from the coordinator at %s:%d: %s; reconnecting" % (self.host, self.port, e))
        except OSError as e:
            self.error = "connection to the coordinator lost: %s" % (e.strerror or e)
        finally:
            self._sock = None
            sel.close()
