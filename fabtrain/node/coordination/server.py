"""The coordinator: a `Board` behind one TCP port, on a thread of the first node's agent.

One selector loop serves every connection. Nothing a connection sends can
stop it: each line is bounded and checked before it is parsed (protocol.py),
a connection that sends something wrong is closed on its own, and an
unexpected error while serving one connection closes that connection only.
How many connections may wait for their handshake, and for how long, is
connections.py's business.
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from fabtrain.contract.events import EventKind

from . import protocol, pulse, tenure
from .board import Board, Event, Outcome
from .restart import RestartPolicy
from .connections import Conn, Connections, descriptors_for, hung_timeout, kernel_timeout, unacknowledged
from .protocol import Channel, ProtocolError

BIND_WAIT = 3.0  # how long a busy port is retried before the coordinator gives up
_WAKE = object()  # the selector key of stop()'s wake-up pipe
_PULSES = object()  # ... of the datagram socket (pulse.py)


class Coordinator(threading.Thread):
    """Hosted by the first node's agent, on its own thread (one selector loop)."""

    def __init__(self, job_id: str, host: str, port: int, nodes: list[str], interval: float,
                 peer_timeout: float, state_path: str | None = None,
                 on_event: Callable[..., None] | None = None, secret: str | None = None,
                 bind_wait: float = BIND_WAIT, restart: RestartPolicy | None = None):
        super().__init__(name="coordinator", daemon=True)
        self.job_id, self.host, self.port = job_id, host, port
        # The job's secret (job.json, mode 0600 on the nodes): it keys every MAC and never travels.
        self.secret = secret
        self.interval, self.peer_timeout = interval, peer_timeout
        self.state_path, self.bind_wait = state_path, bind_wait
        self.on_event = on_event or (lambda *a, **k: None)
        self.lock = threading.Lock()
        self.restart = restart
        self.board = Board(job_id, nodes, peer_timeout, restart)
        self.restored = False
        self.tenure = None  # a job that elects: this coordinator's term and lease (tenure.py); else None
        self._pending_broadcast = False  # its lease's check ended the job: every agent hears it
        self.desk = pulse.Desk(nodes)
        self.bound = False
        self.bind_error: str | None = None
        self.settled = threading.Event()  # set once the port is ours, or given up on
        self._stopping = threading.Event()
        self._sel = selectors.DefaultSelector()
        # stop() writes here so the loop ends now, not at its next timeout: kill-all waits for this agent.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._server: socket.socket | None = None
        self.connections = Connections(self._sel, self.on_event, len(nodes))
        descriptors_for(len(nodes))
        self._load()

    # -- the board, as the agent and the tests see it ---------------------------------------------

    @property
    def nodes(self) -> list[str]:
        return self.board.nodes

    @property
    def peers(self) -> dict:
        return self.board.peers

    @property
    def status(self) -> dict:
        return self.board.status

    @property
    def superseded(self) -> bool:
        return self.board.superseded

    @property
    def refused(self) -> int:
        return self.connections.refused

    @property
    def last_refusal(self) -> str | None:
        return self.connections.last_refusal

    def view(self) -> dict:
        """The job's status with the whole roster (what an agent's copy adds up to)."""
        with self.lock:
            return self.board.view()

    def all_peers_settled(self) -> bool:
        with self.lock:
            return self.board.all_peers_settled()

    def finished_now(self) -> bool:
        with self.lock:
            return self.board.finished_now()

    def wait_listening(self, timeout: float | None = None) -> bool:
        """True once the port is ours; False if binding it failed for bind_wait (see bind_error)."""
        self.settled.wait(timeout)
        return self.bound

    def handle(self, msg: dict) -> tuple[dict, bool]:
        """(reply, broadcast?) for one authenticated message. Also used directly by the tests."""
        outcome = self.take(msg)
        return outcome.reply, outcome.broadcast

    def take(self, msg: dict) -> Outcome:
        """One authenticated message taken in: the Outcome, its reply encoded where the board built it."""
        with self.lock:
            if msg.get("job_id", self.job_id) != self.job_id:
                return Outcome(self.board.wrong_job(str(msg.get("job_id"))[:protocol.MAX_NAME]), False, [])
            if msg.get("op") != "beat":
                return Outcome({"op": "error", "error": "unknown op %r" % str(msg.get("op"))[:40]}, False, [])
            if self.tenure is not None and not tenure.held(self, msg):  # one that stepped down answers nothing
                return Outcome({"op": "error", "error": self.tenure.stepped_down}, False, [])
            outcome = self.board.beat(msg, time.monotonic(), time.time())
            if outcome.changed:
                self._save()
        self._emit(outcome.events)
        return outcome

    def check_peers(self) -> bool:
        """Mark silent agents lost (a lost node fails a running job). True if anything changed."""
        with self.lock:
            events = self.board.check_peers(time.monotonic(), time.time(), self.connections.by_node)
            if events:
                self._save()
        self._emit(events)
        return bool(events)

    def _emit(self, events: list[Event]) -> None:
        for ev in events:
            self.on_event(ev.kind, node=ev.node, reason=ev.reason, **(ev.fields or {}))

    # -- state across restarts ---------------------------------------------------------------------

    def _load(self) -> None:
        if not self.state_path:
            return
        try:
            with open(self.state_path) as f:
                saved = json.load(f)
        except (OSError, ValueError, RecursionError):
            return
        board = Board.restore(saved, self.job_id, self.board.nodes, self.peer_timeout, time.monotonic(),
                              self.restart)
        if board is not None:
            self.board, self.restored = board, True

    def _save(self) -> None:
        if not self.state_path:
            return
        tmp = "%s.tmp.%d" % (self.state_path, os.getpid())
        try:
            with open(tmp, "w") as f:
                json.dump(self.board.saved(time.time()), f)
            os.replace(tmp, self.state_path)
        except OSError:
            pass

    # -- the loop ------------------------------------------------------------------------------------

    def _bind(self) -> bool:
        s = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self.host, self.port))
            s.listen(128)
        except OSError as e:
            s.close()
            self.bind_error = "cannot listen on %s:%d: %s" % (self.host, self.port, e.strerror or e)
            return False
        s.setblocking(False)
        self._server = s
        self.port = s.getsockname()[1]  # the one the kernel chose, for port 0
        self._sel.register(s, selectors.EVENT_READ, None)
        if self.desk.bind(self.host, self.port, s.family):  # beats alone keep leases where it cannot
            self._sel.register(self.desk.sock, selectors.EVENT_READ, _PULSES)
        self.bound, self.bind_error = True, None
        return True

    def _pulse(self, node: str, fencing: bool, held: bool) -> bool:
        """Whether to answer a pulse of `node` (pulse.py): where the network holds its beats or our answers
        back, or it says it fences itself; not where both kernels delivered everything (we are slow)."""
        if not (fencing or held or self._answer_held(node)):
            return False
        with self.lock:
            return self.board.pulse(node, time.monotonic(), fencing)

    def _answer_held(self, node: str) -> bool:
        """`node` has no open connection here, or an answer of ours to it waits to be sent or acknowledged."""
        conn = self.connections.by_node.get(node)
        if conn is None or conn.outbuf:
            return True
        unacked = unacknowledged(conn.sock)
        return unacked is None or unacked > 0

    def run(self) -> None:
        deadline = time.monotonic() + self.bind_wait
        while not self._stopping.is_set() and not self._bind():
            if time.monotonic() >= deadline:
                # Another program holds the port: every agent would refuse it (it cannot prove the
                # secret), so the job has no coordinator. Say so once; the agent decides what follows.
                self.on_event(EventKind.COORDINATOR_ERROR, reason="%s (job.watchdog.port is taken by another program?); "
                              "the job has no coordinator" % self.bind_error)
                self.settled.set()
                return
            self._stopping.wait(0.2)
        self.settled.set()
        if self.restored:
            self.on_event(EventKind.COORDINATOR, reason="coordinator restarted on %s:%d; state restored (%s)"
                          % (self.host, self.port, self.board.status["status"]))
        period = min(0.5, self.interval / 2)
        last_check = time.monotonic()
        while not self._stopping.is_set():
            for key, mask in self._sel.select(timeout=period):
                if key.data is _WAKE:
                    continue  # stop(): the loop's condition sees it
                if key.data is _PULSES:
                    self.desk.answer(self._pulse, self.connections.note_refusal)
                elif key.data is None:
                    self.connections.accept(self._server)
                else:
                    self._serve(key.data, mask)
            if time.monotonic() - last_check >= period:
                last_check = time.monotonic()
                self.connections.expire(last_check, silent=hung_timeout(self.peer_timeout))
                if self.tenure is not None and not tenure.keeps(self):
                    break  # steps down: every connection closed, its agent fences its node (tenure.py)
                if self.check_peers() or self._pending_broadcast:
                    self._pending_broadcast = False
                    self._broadcast()
        self.connections.close_all()
        for sock in (self._server, self.desk.sock):
            if sock:
                self._sel.unregister(sock)
                sock.close()

    def stop(self) -> None:
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _serve(self, conn: Conn, mask: int) -> None:
        # One connection's trouble stays its own: whatever goes wrong while serving it,
        # even a bug, closes that connection and never ends this thread (the job's only coordinator).
        try:
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if mask & selectors.EVENT_WRITE:
                self.connections.flush(conn)
        except ProtocolError as e:
            self.connections.refuse(conn, str(e))
        except Exception as e:  # noqa: BLE001 - see above
            self.connections.refuse(conn, "error while serving it: %s: %s" % (type(e).__name__, e))

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.connections.close(conn)
            return
        broadcast = False
        for line in conn.reader.feed(data):
            if not self.connections.open(conn):
                return
            broadcast |= self._on_line(conn, line)
        if broadcast:
            self._broadcast(skip=conn)

    def _on_line(self, conn: Conn, line: bytes) -> bool:
        """Take one line; True if every agent must hear the job's new status."""
        if conn.channel is None:
            self._on_hello(conn, protocol.read_hello(line))
            return False
        msg = conn.channel.open(line)
        conn.heard = time.monotonic()
        if conn.node is None:
            if msg.get("op") != "auth":
                raise ProtocolError("first frame is %r, not auth" % str(msg.get("op"))[:40])
            self.connections.authenticated(conn, kernel_timeout(self.peer_timeout, self.interval))
            self.desk.session(conn.node, conn.channel.session, conn.channel.pulse_key)
            return False
        if msg.get("node") != conn.node:
            raise ProtocolError("a beat for node %r on %s's connection" % (str(msg.get("node"))[:40], conn.node))
        reply, _, _, broadcast, body = self.take(msg)
        if self.tenure is not None and reply.get("op") != "error":
            reply, body = self.tenure.stamp(reply), None
        self.connections.send(conn, conn.channel.seal(reply, body))
        if reply.get("op") == "error":
            self.connections.refuse(conn, reply["error"])
        return broadcast

    def _on_hello(self, conn: Conn, hello: dict) -> None:
        if hello["job_id"] != self.job_id:
            with self.lock:
                reply = self.board.wrong_job(hello["job_id"])
            self.connections.send(conn, protocol.line(reply))
            self.connections.close(conn)  # not a refusal: an agent of another job looking for its coordinator
            return
        if not self.board.knows(hello["node"]):
            raise ProtocolError("node %r is not one of job %s's nodes" % (hello["node"], self.job_id))
        nonce = protocol.new_nonce()
        self.connections.challenged(conn, hello["node"])
        conn.channel = Channel(self.secret, self.job_id, hello["node"], hello["nonce"], nonce, "coordinator")
        self.connections.send(conn, protocol.challenge(self.secret, self.job_id, hello["node"], hello["nonce"], nonce))

    def _broadcast(self, skip: Conn | None = None) -> None:
        with self.lock:
            msg = self.board.status_line()
        if self.tenure is not None:
            msg = self.tenure.stamp(msg)
        for conn in list(self.connections.by_node.values()):
            if conn is not skip and self.connections.open(conn):
                self.connections.send(conn, conn.channel.seal(msg))
