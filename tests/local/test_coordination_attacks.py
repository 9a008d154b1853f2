"""Attacks on the agents' coordinator, each over a real socket: forged, replayed and flooding peers.

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

from fabtrain.node.coordination import protocol
from fabtrain.node.coordination.client import Client
from fabtrain.node.coordination.server import Coordinator
from fabtrain.node.coordination.protocol import Channel
from fabtrain.node.coordination import connections
from tests.support.procscan import wait_for
from tests.support.sshd import free_port
from tests.support.local_job import FAKE

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


# -- 2. nobody without the secret is heard; nobody is told the secret -----------------------------


def test_a_beat_with_a_wrong_mac_and_a_forged_finished_are_refused(job):
    s = job.raw()  # the old protocol: a beat in the clear, with a secret field
    s.sendall(protocol.line(dict(beat("b", final={"status": "finished", "reason": "forged"}), secret="guess")))
    assert closed_by_peer(s)
    s, wrong = job.handshake(secret="not the job's secret")
    s.sendall(wrong.seal({"op": "auth"}))
    s.sendall(wrong.seal(beat("b", final={"status": "finished", "reason": "forged"})))
    assert closed_by_peer(s)
    assert "bad MAC" in job.co.last_refusal
    s, right = job.handshake()
    s.sendall(right.seal({"op": "auth"}))
    forged = right.seal(beat("b", failure={"reason": "forged"}))
    s.sendall(b"0" * 64 + forged[64:])  # the genuine body under a forged MAC
    assert closed_by_peer(s)
    job.assert_survived()
    assert "b" not in job.co.peers  # none of them counted as a beat from b


def test_a_replayed_beat_is_refused(job):
    # Record a genuine agent's whole conversation through a relay, as an eavesdropper would.
    listener = socket.create_server(("127.0.0.1", 0))
    sent = []

    def relay():
        down, _ = listener.accept()
        up = socket.create_connection(("127.0.0.1", job.port))
        threading.Thread(target=lambda: [down.sendall(d) for d in iter(lambda: up.recv(65536), b"")],
                         daemon=True).start()
        for data in iter(lambda: down.recv(65536), b""):
            sent.append(data)
            up.sendall(data)
    threading.Thread(target=relay, daemon=True).start()
    b = Client("127.0.0.1", listener.getsockname()[1], 0.1, lambda m: None, secret=SECRET, job_id="j1", node="b")
    b.start()
    b.update(beat("b", done=True))
    assert wait_for(lambda: b.acked_seq >= 1, timeout=5)
    b.stop()
    b.join(3)
    recording = b"".join(sent)
    assert recording.count(b"\n") == 3 and SECRET.encode() not in recording  # hello, auth, beat
    seen_b = job.co.peers["b"].ts
    s = job.raw()  # replayed on a new connection: a new challenge, so the old MACs are worthless
    s.sendall(recording)
    assert closed_by_peer(s)
    assert "bad MAC" in job.co.last_refusal
    s, channel = job.handshake()  # and within one connection: the same frame twice
    s.sendall(channel.seal({"op": "auth"}))
    frame = channel.seal(beat("b", done=True))
    s.sendall(frame + frame)
    assert closed_by_peer(s)
    assert "out of order" in job.co.last_refusal
    assert job.co.peers["b"].ts > seen_b  # the genuine first one counted...
    job.assert_survived()


class Squatter:
    """A program that holds the coordinator's port first: it records what each connection says, and answers
    with forged lines (a job status that, were it believed, would end the job)."""

    def __init__(self, port: int, *answers: dict):
        self.server = socket.create_server(("127.0.0.1", port))
        self.answers, self.heard = answers, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.heard.append(conn.recv(65536))
                for answer in self.answers:
                    conn.sendall(protocol.line(answer))
            except OSError:
                pass
            conn.close()

    def close(self):
        self.server.close()


def test_a_squatter_on_the_port_gets_no_secret_and_is_refused():
    port = free_port(["127.0.0.1"])
    squatter = Squatter(port, {"op": "challenge", "v": 1, "job_id": "j1", "nonce": protocol.new_nonce(), "proof": "0" * 64},
                        {"op": "status", "job_id": "j1", "status": "finished", "reason": "forged"})
    heard = squatter.heard
    events, seen = [], []
    co = Coordinator("j1", "127.0.0.1", port, ["a"], 0.1, 1.0, secret=SECRET, bind_wait=0.5,
                     on_event=lambda kind, **kw: events.append((kind, kw["reason"])))
    co.start()
    assert not co.wait_listening(5)
    assert events[0][0] == "coordinator_error" and "Address already in use" in events[0][1]
    client = Client("127.0.0.1", port, 0.1, seen.append, secret=SECRET, job_id="j1", node="a",
                    on_event=lambda kind, **kw: events.append((kind, kw["reason"])))
    client.update(beat("a"))
    client.start()
    try:
        assert wait_for(lambda: len(heard) >= 3, timeout=5)
        assert seen == [] and not client.ever_connected  # the forged finished never reached the agent
        assert "did not prove it knows the job's secret" in client.error
        assert [k for k, _ in events].count("coordinator_refused") == 1
        assert all(SECRET.encode() not in h and b'"op":"hello"' in h and b"beat" not in h for h in heard)
    finally:
        client.stop()
        squatter.close()


# -- 3. a flood of idle connections --------------------------------------------------------------


def test_1100_idle_connections_do_not_use_up_the_coordinators_descriptors(job, monkeypatch):
    monkeypatch.setattr(connections, "HELLO_TIMEOUT", 5.0)  # 30 s in use: the same rule, sooner
    most, done = [0], threading.Event()

    def sample():  # the coordinator's open connections, as the flood goes on
        while not done.wait(0.002):
            most[0] = max(most[0], len(job.co.connections.all))
    threading.Thread(target=sample, daemon=True).start()
    idle = []
    try:
        for _ in range(1100):
            idle.append(job.raw())
        assert wait_for(lambda: job.co.refused >= 1100 - 64 - 1, timeout=5)  # all accepted, the oldest evicted
        assert job.beat_gets_through()  # node a's connection is authenticated: never evicted
        done.set()
        assert most[0] <= 64 + 1, most[0]  # handshakes in all (16 per address) + node a
        time.sleep(5.0 + 0.5)  # the idle ones left are dropped too
        assert len(job.co.connections.pending) == 0
        job.assert_survived()
    finally:
        done.set()
        for s in idle:
            s.close()


def test_an_agent_slow_to_answer_the_challenge_is_let_in_and_a_silent_one_is_not(job, monkeypatch):
    """An agent on a node whose cores are all busy may wait seconds for a time slice between our
    challenge and its proof (one of a 200-node start on 2 cores did): it is let in, with no refusal.
    A connection that says nothing, or that never proves the secret, is still dropped."""
    monkeypatch.setattr(connections, "HELLO_TIMEOUT", 5.0)  # 30 s each in use: the same rules, sooner
    monkeypatch.setattr(connections, "PROOF_TIMEOUT", 8.0)
    idle = job.raw()
    slow, channel = job.handshake("b")
    mute, _ = job.handshake("b")
    time.sleep(5.0 + 1.0)  # the agent waits for the CPU
    assert closed_by_peer(idle, timeout=2.0)
    assert job.co.refused == 1 and job.co.last_refusal.startswith("no hello within 5 s from 127.0.0.1:")
    slow.sendall(channel.seal({"op": "auth"}))
    slow.sendall(channel.seal(beat("b")))
    reply = channel.open(slow.makefile("rb").readline().strip())
    assert reply["status"] == "running", reply
    assert job.co.refused == 1, job.co.last_refusal
    assert closed_by_peer(mute, timeout=5.0)  # its 8 s from the challenge are up
    assert job.co.refused == 2
    assert job.co.last_refusal.startswith("no proof of the secret within 8 s of the challenge from 127.0.0.1:")
    assert job.co.last_refusal.endswith("(claims b)")
    job.assert_survived()
    slow.close()


def test_a_hello_that_arrived_in_time_is_not_refused_because_the_loop_was_late_to_read_it():
    """A starved coordinator accepts, loses the CPU for longer than the deadline, and checks deadlines
    before the select that would read the hello: what the agent sent in time is served, not refused.
    A connection that sent nothing is refused at the same check. Real sockets, the loop's own steps."""
    import selectors
    events = []
    sel = selectors.DefaultSelector()
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    conns = connections.Connections(sel, lambda kind, **kw: events.append((kind, kw)), nodes=2)
    sent, silent = socket.create_connection(server.getsockname()), socket.create_connection(server.getsockname())
    try:
        assert wait_for(lambda: conns.accept(server) or len(conns.pending) == 2, timeout=5)
        sent.sendall(protocol.hello("j1", "b", protocol.new_nonce()))
        by_port = {c.addr[1]: c for c in conns.pending.values()}
        waiting = by_port[sent.getsockname()[1]]
        assert wait_for(lambda: connections._unread(waiting.sock), timeout=5)
        conns.expire(time.monotonic() + connections.HELLO_TIMEOUT + 1, silent=60)  # the loop comes back late
        assert list(conns.pending.values()) == [waiting]
        assert conns.refused == 1 and conns.last_refusal.startswith("no hello within 30 s from 127.0.0.1:")
        assert closed_by_peer(silent, timeout=2.0) and not closed_by_peer(sent, timeout=0.2)
    finally:
        conns.close_all()
        sel.close()
        server.close()
        sent.close()
        silent.close()


# -- the same against real agents ------------------------------------------------------------------


def secret_of(job, node):
    return json.loads((job.jd(node) / "job.json").read_text())["watchdog"]["coordinator"]["secret"]


def test_a_squatter_on_the_port_fails_the_start_and_the_agents_refuse_it(local_job):
    """nodes[0] (n0) hosts the coordinator and runs the trainer; n1's pserver and agent start first."""
    port = free_port(["127.0.0.1"])
    squatter = Squatter(port, {"op": "status", "job_id": "x", "status": "failed", "reason": "forged"})
    heard = squatter.heard
    pserver_port = free_port(["127.0.0.1"])
    job = local_job([("n0", ["trainer"]), ("n1", ["pserver"])], pserver={"port": pserver_port, "command": FAKE},
                    trainer={"command": FAKE}, watchdog={"interval": 0.5, "hang_timeout": 30, "grace": 1, "port": port})
    try:
        job.fab("deploy", "start-pserver", check=True)
        assert wait_for(lambda: "coordinator_refused" in [e["kind"] for e in job.events("n1")], timeout=15)
        coordinator = lambda: (job.health("n1") or {}).get("coordinator") or {}  # noqa: E731
        assert wait_for(lambda: "refused the coordinator at" in (coordinator().get("error") or ""), timeout=5)
        assert not coordinator()["connected"]
        out = job.fab("start-trainers", check=False)
        assert out.returncode != 0
        line = next(x for x in out.stdout.splitlines() if x.startswith("n0: FAILED"))
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line, out.stdout
        assert "nothing of job" in line and "Traceback" not in out.stdout + out.stderr
        assert not (job.jd("n0") / "run" / "trainer-0.json").exists()  # the start failed before the trainer
        assert wait_for(lambda: (job.jd("n0") / "run" / "agent.exit").exists(), timeout=5)
        assert (job.jd("n0") / "run" / "agent.exit").read_text().strip() == "1"
        assert "coordinator_error" in [e["kind"] for e in job.events("n0")]
        time.sleep(1)
        assert not {"job_failed", "teardown"} & {e["kind"] for e in job.events("n1")}, job.events("n1")
        assert heard and all(secret_of(job, "n1").encode() not in h and b"beat" not in h for h in heard)
    finally:
        squatter.close()


FLOOD = r"""
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
addr = ("127.0.0.1", int(sys.argv[1]))
for line in (b"[" * 200000 + b"\n", b"x" * (5 << 20),
             b'{"op":"beat","job_id":"%s","node":"n1","secret":"guess","final":{"status":"finished"}}\n' % sys.argv[2].encode()):
    s = socket.create_connection(addr)
    try:
        s.sendall(line)
    except OSError:
        pass
    s.close()
idle = [socket.create_connection(addr) for _ in range(1100)]
print("flooded", flush=True)
time.sleep(4)
"""


def test_a_running_job_survives_a_bomb_a_huge_line_a_forged_finished_and_1100_idle_connections(local_job):
    port = free_port(["127.0.0.1"])
    pserver_port = free_port(["127.0.0.1"])
    job = local_job([("n0", ["pserver"]), ("n1", ["trainer"])], pserver={"port": pserver_port, "command": FAKE},
                    trainer={"command": f"{FAKE} --period 0.1"},
                    watchdog={"interval": 0.5, "hang_timeout": 30, "grace": 1, "port": port})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # where 1,100 crashed the agent
    try:
        job.fab("deploy", "start-pserver", "start-trainers", check=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert wait_for(lambda: (job.health("n1") or {}).get("peers", {}).keys() >= {"n0", "n1"}, timeout=15)
    agent = job.health("n0")["agent"]["pid"]
    flood = subprocess.run([sys.executable, "-c", FLOOD, str(port), job.job_id], capture_output=True, text=True,
                           timeout=60)
    assert "flooded" in flood.stdout, flood.stderr
    time.sleep(5.5)  # peer_timeout (5 s): a dead coordinator would have lost every node by now
    for node in ("n0", "n1"):
        kinds = [e["kind"] for e in job.events(node)]
        assert not {"peer_lost", "job_failed", "teardown", "agent_error", "finished"} & set(kinds), (node, kinds)
        h = job.health(node)
        assert time.time() - h["ts"] < 3 and h["job"]["status"] == "running"
        assert h["coordinator"]["connected"] and time.time() - h["coordinator"]["last_contact"] < 3
    assert job.health("n0")["agent"]["pid"] == agent  # the same agent: it did not crash and restart
    assert "coordinator_refused" in [e["kind"] for e in job.events("n0")]
    assert job.health("n1")["processes"][0]["state"] in ("running", "sleeping")


def test_a_large_jobs_agents_all_in_their_handshake_from_one_address_are_not_evicted():
    """200 `host: local` nodes start together: all their handshakes come from 127.0.0.1 at once. The
    caps are never below the job's size (16 a host evicted agents of a 200-node start under load),
    and a flood beyond it from that address is still capped."""
    nodes = ["n%03d" % i for i in range(300)]
    co = Coordinator("j1", "127.0.0.1", 0, nodes, 0.1, 5.0, secret=SECRET)
    co.start()
    conns = []
    try:
        assert co.wait_listening(5), co.bind_error
        for _ in range(len(nodes)):
            conns.append(socket.create_connection(("127.0.0.1", co.port), timeout=5))
        assert wait_for(lambda: len(co.connections.pending) == len(nodes), timeout=5), len(co.connections.pending)
        assert co.refused == 0, co.last_refusal
        for _ in range(40):  # beyond the job's size: the oldest from this address give way
            conns.append(socket.create_connection(("127.0.0.1", co.port), timeout=5))
        # (the coordinator's thread counts a refusal before it adds the newcomer: both are waited for)
        assert wait_for(lambda: co.refused == 40 and len(co.connections.pending) == len(nodes), timeout=5), (
            co.refused, len(co.connections.pending))
        assert "from 127.0.0.1 without the secret" in co.last_refusal
    finally:
        for s in conns:
            s.close()
        co.stop()
        co.join(3)


RAISE_LIMIT = """
import resource, sys
from fabtrain.node.coordination.server import Coordinator
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
co = Coordinator("j1", "127.0.0.1", 0, ["n%d" % i for i in range(int(sys.argv[1]))], 1.0, 5.0, secret="s" * 32)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def test_a_coordinator_of_1000_nodes_raises_its_open_file_limit_for_their_connections():
    """1,000 authenticated connections and the handshakes' cap do not fit the usual soft limit of 1,024
    descriptors: the coordinator raises it (up to the hard limit), a small job's leaves it alone."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = {n: int(subprocess.run([sys.executable, "-c", RAISE_LIMIT, str(n)], capture_output=True, text=True,
                                 check=True).stdout) for n in (3, 1000)}
    assert out[3] == 1024
    room = 1000 + (1000 + 48)  # one authenticated connection a node, and the handshakes' cap (at this size)
    assert out[1000] >= (room if hard == resource.RLIM_INFINITY else min(hard, room)), (out, hard)
