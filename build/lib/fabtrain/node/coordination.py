"""The agents' shared view of a job: a tiny key-value service of our own.

The first node's agent (job.json ``nodes[0]``) hosts a `Coordinator` on
``watchdog.coordinator`` (host, port); every agent, that one included, keeps
one TCP connection to it through a `Client`. The protocol is JSON lines:

    agent -> coordinator   {"op": "beat", "job_id", "secret", "node", "seq", "ts", "procs": {name: {role, rank, state,
                            exit_code}}, "done", "failure": {"reason"} | null,
                            "final": {"status", "reason", "node"} | null, "trainers_expected"}
    coordinator -> agent   {"op": "status", "job_id", "status": running|failed|finished, "reason", "node",
                            "ts", "ack", "peers": {node: last beat, epoch s}, "lost": [node],
                            "trainers_running", "nodes_seen"}
                           {"op": "error", "error"}   (wrong job; the connection is closed)

A beat goes every ``watchdog.interval`` and at once when something happens;
the coordinator answers each beat and pushes a status line to every agent the
moment the job's status changes, so a failure on one node reaches the others
in milliseconds, not a polling interval. The job's status only moves from
running to failed or finished, never back. An agent that stops beating for
``peer_timeout`` is a lost node, and a lost node fails the job. The
coordinator keeps its state in ``coordinator.json`` so a restarted
coordinator picks up where it was; the agents' beats carry their own view of
a final status too, so nothing is lost either way.

Why not ``torch.distributed.TCPStore``: importing torch costs the agent ~40+ MB
of RSS and a second of CPU on every node, where the agent must stay under
40 MB, and a store still needs polling for the "someone failed" key. This is
a few hundred lines of stdlib: selectors, sockets, json.
"""
from __future__ import annotations

import hmac
import json
import os
import selectors
import socket
import threading
import time
from typing import Callable

FINAL = ("failed", "finished")
LIVE_STATES = ("running", "sleeping", "stopped", "zombie")


def _line(msg: dict) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "node", "addr")

    def __init__(self, sock, addr):
        self.sock, self.addr, self.inbuf, self.outbuf, self.node = sock, addr, b"", b"", None


class Coordinator(threading.Thread):
    """Hosted by the first node's agent, on its own thread (one selector loop)."""

    def __init__(self, job_id: str, host: str, port: int, nodes: list[str], interval: float,
                 peer_timeout: float, state_path: str | None = None,
                 on_event: Callable[..., None] | None = None, secret: str | None = None):
        super().__init__(name="coordinator", daemon=True)
        self.job_id, self.host, self.port = job_id, host, port
        # The job's secret (job.json, mode 0600 on the nodes): without it, anyone
        # who can reach the port could fail the job or declare it finished.
        self.secret = secret
        self.nodes = list(nodes)
        self.interval, self.peer_timeout = interval, peer_timeout
        self.state_path = state_path
        self.on_event = on_event or (lambda *a, **k: None)
        self.lock = threading.Lock()
        self.status = {"status": "running", "reason": None, "node": None, "ts": None}
        self.peers: dict[str, dict] = {}  # node -> {seen (monotonic), ts (epoch), done, lost, procs, expected}
        self.bound = False
        self.bind_error: str | None = None
        self.superseded = False  # a newer job asked for this port while ours is over
        self.restored = False
        self._stopping = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._server: socket.socket | None = None
        self._conns: dict[socket.socket, _Conn] = {}
        self._load()

    # -- state -------------------------------------------------------------------------

    def _load(self) -> None:
        if not self.state_path:
            return
        try:
            with open(self.state_path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return
        if saved.get("job_id") != self.job_id:
            return
        self.restored = True
        self.status = saved.get("status") or self.status
        now = time.monotonic()
        for name, p in (saved.get("peers") or {}).items():
            # A restarted coordinator gives every known peer a fresh peer_timeout.
            self.peers[name] = {"seen": now, "ts": p.get("ts"), "done": p.get("done", False),
                                "lost": p.get("lost", False), "procs": p.get("procs", {}),
                                "expected": p.get("expected")}

    def _save(self) -> None:
        if not self.state_path:
            return
        data = {"job_id": self.job_id, "status": self.status, "saved": time.time(),
                "peers": {n: {k: v for k, v in p.items() if k != "seen"} for n, p in self.peers.items()}}
        tmp = "%s.tmp.%d" % (self.state_path, os.getpid())
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.state_path)
        except OSError:
            pass

    def _set_status(self, status: str, reason: str, node: str | None) -> bool:
        if self.status["status"] in FINAL:
            return False
        self.status = {"status": status, "reason": reason, "node": node, "ts": time.time()}
        self._save()
        return True

    def view(self) -> dict:
        """The status line as every agent gets it."""
        trainers_running = 0
        for p in self.peers.values():
            for proc in p["procs"].values():
                if proc.get("role") == "trainer" and proc.get("state") in LIVE_STATES:
                    trainers_running += 1
        return {"op": "status", "job_id": self.job_id, **self.status,
                "peers": {n: p["ts"] for n, p in self.peers.items()},
                "done": sorted(n for n, p in self.peers.items() if p["done"]),
                "lost": sorted(n for n, p in self.peers.items() if p["lost"]),
                "nodes_seen": len(self.peers), "trainers_running": trainers_running}

    def finished_now(self) -> bool:
        """Every trainer of the job has exited with code 0."""
        trainers = {}
        expected = None
        for p in self.peers.values():
            if p.get("expected"):
                expected = max(expected or 0, p["expected"])
            for name, proc in p["procs"].items():
                if proc.get("role") == "trainer":
                    trainers[name] = proc
        if not trainers or any(t.get("state") != "exited" or t.get("exit_code") != 0 for t in trainers.values()):
            return False
        all_nodes = set(self.nodes) <= set(self.peers)
        return all_nodes or (expected is not None and len(trainers) >= expected)

    def all_peers_settled(self) -> bool:
        """Every agent that ever spoke is done or lost: nobody needs the coordinator any more."""
        return all(p["done"] or p["lost"] for p in self.peers.values())

    # -- messages ------------------------------------------------------------------------

    def handle(self, msg: dict) -> tuple[dict | None, bool]:
        """(reply, broadcast?) for one message. Also used directly by the tests."""
        if self.secret and not hmac.compare_digest(str(msg.get("secret") or "").encode(), self.secret.encode()):
            return {"op": "error", "error": "wrong or missing job secret"}, False
        if msg.get("job_id") != self.job_id:
            if self.status["status"] in FINAL:
                self.superseded = True
            return {"op": "error", "error": "this is the coordinator of job %s, not %s"
                    % (self.job_id, msg.get("job_id"))}, False
        if msg.get("op") != "beat":
            return {"op": "error", "error": "unknown op %r" % msg.get("op")}, False
        node = msg.get("node")
        if not isinstance(node, str):
            return {"op": "error", "error": "beat without a node"}, False
        changed = False
        with self.lock:
            peer = self.peers.get(node)
            if peer is None:
                peer = self.peers[node] = {"seen": 0.0, "ts": None, "done": False, "lost": False,
                                           "procs": {}, "expected": None}
                changed = True
            if peer["lost"]:
                peer["lost"] = False  # it came back; the job's status stays what it is
                self.on_event("peer_back", node=node, reason="agent on %s beats again" % node)
                changed = True
            peer["seen"], peer["ts"] = time.monotonic(), time.time()
            if peer["done"] != bool(msg.get("done")):
                changed = True
            peer["done"] = bool(msg.get("done"))
            # Process states change all the time; they travel with each reply, not in broadcasts.
            peer["procs"] = msg.get("procs") or {}
            peer["expected"] = msg.get("trainers_expected")
            failure, final = msg.get("failure"), msg.get("final")
            if failure:
                changed |= self._set_status("failed", failure.get("reason") or "failed", node)
            elif final and final.get("status") in FINAL:
                changed |= self._set_status(final["status"], final.get("reason") or "", final.get("node") or node)
            if self.status["status"] == "running" and self.finished_now():
                changed |= self._set_status("finished", "every trainer exited with code 0", None)
            if changed:
                self._save()
            reply = dict(self.view(), ack=msg.get("seq"))
        return reply, changed

    def check_peers(self) -> bool:
        """Mark silent agents lost (a lost node fails a running job). True if anything changed."""
        changed = False
        now = time.monotonic()
        with self.lock:
            for name, p in self.peers.items():
                if p["done"] or p["lost"] or now - p["seen"] < self.peer_timeout:
                    continue
                p["lost"] = True
                changed = True
                reason = "no heartbeat from the agent on %s for %.0f s (peer_timeout %.0f s)" % (
                    name, now - p["seen"], self.peer_timeout)
                self.on_event("peer_lost", node=name, reason=reason)
                self._set_status("failed", "node %s lost: %s" % (name, reason), name)
            if changed:
                self._save()
        return changed

    # -- the loop --------------------------------------------------------------------------

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
        self._sel.register(s, selectors.EVENT_READ, None)
        self.bound, self.bind_error = True, None
        return True

    def run(self) -> None:
        while not self._stopping.is_set() and not self._bind():
            self._stopping.wait(min(1.0, self.interval))
        if self.restored:
            self.on_event("coordinator", reason="coordinator restarted on %s:%d; state restored (%s)"
                          % (self.host, self.port, self.status["status"]))
        last_check = time.monotonic()
        while not self._stopping.is_set():
            for key, mask in self._sel.select(timeout=min(0.5, self.interval / 2)):
                if key.data is None:
                    self._accept()
                elif mask & selectors.EVENT_READ:
                    self._read(key.data)
                elif mask & selectors.EVENT_WRITE:
                    self._flush(key.data)
            if time.monotonic() - last_check >= min(0.5, self.interval / 2):
                last_check = time.monotonic()
                if self.check_peers():
                    self._broadcast()
        for conn in list(self._conns.values()):
            self._close(conn)
        if self._server:
            self._sel.unregister(self._server)
            self._server.close()

    def stop(self) -> None:
        self._stopping.set()

    def _accept(self) -> None:
        try:
            sock, addr = self._server.accept()
        except OSError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, addr)
        self._conns[sock] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbuf += data
        if len(conn.inbuf) > (1 << 20):
            self._close(conn)
            return
        broadcast = False
        while b"\n" in conn.inbuf:
            line, conn.inbuf = conn.inbuf.split(b"\n", 1)
            try:
                msg = json.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError
            except ValueError:
                self._send(conn, {"op": "error", "error": "not a JSON object"})
                continue
            reply, changed = self.handle(msg)
            conn.node = msg.get("node") if isinstance(msg.get("node"), str) else conn.node
            if reply:
                self._send(conn, reply)
                if reply.get("op") == "error":
                    self._flush(conn)
                    self._close(conn)
                    return
            broadcast |= changed
        if broadcast:
            self._broadcast(skip=conn)

    def _broadcast(self, skip: _Conn | None = None) -> None:
        with self.lock:
            msg = self.view()
        for conn in list(self._conns.values()):
            if conn is not skip and conn.node is not None:
                self._send(conn, msg)

    def _send(self, conn: _Conn, msg: dict) -> None:
        conn.outbuf += _line(msg)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.sock not in self._conns:
            return
        try:
            while conn.outbuf:
                n = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[n:]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(conn)
            return
        if len(conn.outbuf) > (1 << 20):  # a peer that does not read: drop it, it will reconnect
            self._close(conn)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        try:
            self._sel.modify(conn.sock, want, conn)
        except (KeyError, ValueError):
            pass

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


class Client(threading.Thread):
    """One agent's connection to the coordinator: sends beats, receives status lines.

    `update(beat)` hands over the latest beat (sent at once); `on_message` is
    called on this thread for every status line. Reconnects by itself, with a
    short backoff, for as long as the agent lives: the coordinator may start
    later than this agent, or restart.
    """

    def __init__(self, host: str, port: int, interval: float, on_message: Callable[[dict], None]):
        super().__init__(name="coordinator-client", daemon=True)
        self.host, self.port, self.interval = host, port, interval
        self.on_message = on_message
        self.lock = threading.Lock()
        self.beat: dict | None = None
        self.seq = 0
        self.sent_seq = 0
        self.acked_seq = 0
        self.connected = False
        self.ever_connected = False
        self.last_contact: float | None = None  # monotonic time of the last line from the coordinator
        self.last_contact_epoch: float | None = None
        self.error: str | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = threading.Event()

    def update(self, beat: dict) -> int:
        with self.lock:
            self.seq += 1
            self.beat = dict(beat, seq=self.seq)
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
        self._wake()

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def run(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            sock = self._connect()
            if sock is None:
                self._wait(backoff)
                backoff = min(self.interval, backoff * 2)
                continue
            backoff = 0.1
            self._serve(sock)
            sock.close()
            self.connected = False

    def _wait(self, seconds: float) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        sel.select(seconds)
        sel.close()
        self._drain()

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=max(0.5, min(2.0, self.interval)))
        except OSError as e:
            self.error = "cannot reach the coordinator at %s:%d: %s" % (self.host, self.port, e.strerror or e)
            return None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(0.5, min(2.0, self.interval)))
        self.connected, self.ever_connected, self.error = True, True, None
        with self.lock:
            self.sent_seq = 0  # a new connection gets the latest beat at once
        return sock

    def _serve(self, sock: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ, "sock")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        buf = b""
        silent_since = time.monotonic()
        try:
            while not self._stopping.is_set():
                with self.lock:
                    beat = self.beat if self.seq > self.sent_seq else None
                    if beat is not None:
                        self.sent_seq = self.seq
                if beat is not None:
                    sock.sendall(_line(beat))
                for key, _ in sel.select(self.interval):
                    if key.data == "wake":
                        self._drain()
                        continue
                    data = sock.recv(65536)
                    if not data:
                        self.error = "the coordinator closed the connection"
                        return
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            continue
                        silent_since = time.monotonic()
                        self.last_contact, self.last_contact_epoch = silent_since, time.time()
                        if msg.get("op") == "error":
                            self.error = "coordinator: %s" % msg.get("error")
                            self.on_message(msg)
                            return
                        if isinstance(msg.get("ack"), int):
                            self.acked_seq = max(self.acked_seq, msg["ack"])
                        self.on_message(msg)
                # A coordinator that answers nothing for a while is as good as gone: reconnect.
                if time.monotonic() - silent_since > max(3 * self.interval, 3.0):
                    self.error = "no answer from the coordinator for %.0f s" % (time.monotonic() - silent_since)
                    return
        except OSError as e:
            self.error = "connection to the coordinator lost: %s" % (e.strerror or e)
        finally:
            sel.close()
