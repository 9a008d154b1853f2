"""Issue 13's attacks on the agents' coordinator, each over a real socket.

After each attack the job must survive: a real client's beat still gets an
answer, no peer is lost, the job still runs, the coordinator's thread lives.
The last tests run real agents (`fab start-*` on local nodes): a program that
holds the coordinator's port before the job starts, and a flood against a
running job's agent.
"""
from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

from fabtrain.node.coordination import Client, Coordinator, protocol
from fabtrain.node.coordination.protocol import Channel
from fabtrain.node.coordination.connections import HANDSHAKE_TIMEOUT
from tests.procscan import wait_for
from tests.sshd import free_port
from tests.test_agent import FAKE, local_job  # noqa: F401 - local_job is a fixture

pytestmark = pytest.mark.timeout(120)

SECRET = "0123456789abcdef0123456789abcdef"
BOMB = b"[" * 200_000 + b"\n"  # raised RecursionError in the old coordinator's thread, which died


def beat(node, **kw):
    return {"op": "beat", "job_id": "j1", "node": node, "procs": {}, **kw}


class Job:
    """A coordinator on its own thread, and node a's client beating every 0.1 s as an agent does."""

    def __init__(self, peer_timeout=1.0):
        self.events = []
        self.co = Coordinator("j1", "127.0.0.1", 0, ["a", "b"], 0.1, peer_timeout, secret=SECRET,
                              on_event=lambda kind, **kw: self.events.append((kind, kw)))
        self.co.start()
        assert self.co.wait_listening(5), self.co.bind_error
        self.port = self.co.port
        self.seen = []
        self.client = Client("127.0.0.1", self.port, 0.1, self.seen.append, secret=SECRET, job_id="j1", node="a")
        self.client.start()
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beat, daemon=True)
        self._beater.start()
        assert self.beat_gets_through()

    def _beat(self):
        while not self._stop.wait(0.1):
            self.client.update(beat("a"))

    def beat_gets_through(self, timeout=5.0) -> bool:
        seq = self.client.update(beat("a"))
        return bool(wait_for(lambda: self.client.acked_seq >= seq, timeout=timeout, interval=0.01))

    def kinds(self):
        return [k for k, _ in self.events]

    def assert_survived(self):
        time.sleep(self.co.peer_timeout * 1.5)  # long enough for a dead or stuck thread to lose node a
        assert self.co.is_alive(), "the coordinator's thread died"
        assert self.beat_gets_through(), "a real beat no longer gets an answer"
        assert "peer_lost" not in self.kinds(), self.events
        assert self.co.status["status"] == "running", self.co.status
        assert self.seen[-1]["status"] == "running"

    def raw(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def handshake(self, node="b", secret=SECRET):
        """A connection that said hello and read the challenge: (socket, Channel keyed by `secret`)."""
        s, nonce = self.raw(), protocol.new_nonce()
        s.sendall(protocol.hello("j1", node, nonce))
        answer = json.loads(s.makefile("rb").readline())
        return s, Channel(secret, "j1", node, nonce, answer["nonce"], "agent")

    def close(self):
        self._stop.set()
        self.client.stop()
        self.co.stop()
        self.co.join(3)


@pytest.fixture
def job():
    j = Job()
    yield j
    j.close()


def closed_by_peer(s: socket.socket, timeout=5.0) -> bool:
    """True once the other end closed (EOF or reset); a refused connection is closed at once."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


# -- 1. one line must never take the coordinator down --------------------------------------------


def test_a_line_of_200000_brackets_is_refused_and_the_job_goes_on(job):
    s = job.raw()
    s.sendall(BOMB)
    assert closed_by_peer(s)
    s, _ = job.handshake()  # and after a valid hello, where frames are read
    s.sendall(BOMB)
    assert closed_by_peer(s)
    job.assert_survived()
    assert job.co.refused == 2 and "longer than 1024" in job.co.last_refusal
    assert job.kinds().count("coordinator_refused") == 1  # a flood of refusals is one event a minute


def test_deep_nesting_is_refused_before_parsing_even_with_the_secret(job):
    s = job.raw()
    s.sendall(b"[" * 500 + b"]" * 500 + b"\n")  # fits a hello's 1024 bytes
    assert closed_by_peer(s)
    assert "nested deeper" in job.co.last_refusal
    s, channel = job.handshake()
    s.sendall(channel.seal({"op": "auth"}))
    s.sendall(channel.seal(beat("b", procs={"t": json.loads("[" * 300 + "]" * 300)})))
    assert closed_by_peer(s)
    assert "nested deeper" in job.co.last_refusal
    job.assert_survived()


def test_a_huge_line_is_cut_off_without_being_buffered(job):
    s = job.raw()
    try:
        for _ in range(80):  # 5 MB, no newline
            s.sendall(b"x" * 65536)
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed while we still sent: what should happen
    assert closed_by_peer(s)
    assert "longer than 1024" in job.co.last_refusal
    job.assert_survived()
