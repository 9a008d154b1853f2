"""Pulses (fabtrain/node/coordination/pulse.py): datagrams beside the beats' connection that renew a
node's lease while its beats are late. The board's side is pure (told `now`); the desk and the
agent's pulser talk over a real UDP socket on 127.0.0.1."""
from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest

from fabtrain.node.coordination import pulse
from fabtrain.node.coordination.board import Board
from fabtrain.node.coordination.connections import Conn, hung_timeout
from fabtrain.node.coordination.client import Client
from fabtrain.node.coordination.server import Coordinator
from fabtrain.node.coordination.protocol import Channel, ProtocolError
from tests.support.procscan import wait_for

SECRET = "0123456789abcdef0123456789abcdef"
A_NONCE, C_NONCE = "a" * 32, "c" * 32


def beat(node, seq=1):
    return {"op": "beat", "job_id": "j1", "node": node, "seq": seq, "procs": {}}


def channels(node="n1", secret=SECRET, a_nonce=A_NONCE):
    return (Channel(secret, "j1", node, a_nonce, C_NONCE, "agent"),
            Channel(secret, "j1", node, a_nonce, C_NONCE, "coordinator"))


# -- the board: a pulse is a sign of life, not news -------------------------------------------------


def test_pulses_keep_a_node_whose_connection_is_gone_but_not_past_hung_timeout_without_a_beat():
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    b.beat(beat("n0"), now=0, wall=100)
    b.beat(beat("n1"), now=0, wall=100)
    for t in range(1, 30):  # n1's connection is gone (not in `connected`); only its pulses come
        assert b.pulse("n1", now=t)
        b.beat(beat("n0", seq=t + 1), now=t, wall=100 + t)
        assert b.check_peers(now=t + 0.5, wall=100 + t, connected={"n0"}) == []
    events = b.check_peers(now=hung_timeout(5), wall=130, connected={"n0"})
    assert [e.kind for e in events] == ["peer_lost"] and events[0].node == "n1"
    assert "no beat from the agent on n1 for 30 s, though its pulses come" in events[0].reason
    assert b.status["status"] == "failed" and "n1" in b.status["reason"]
    assert not b.pulse("n1", now=31)  # lost: its pulses go unanswered, so its lease runs out and it fences


def test_without_pulses_a_node_whose_connection_is_gone_is_lost_after_peer_timeout():
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    b.beat(beat("n1"), now=0, wall=100)
    assert b.check_peers(now=4.9, wall=105) == []
    assert [e.node for e in b.check_peers(now=5.0, wall=105)] == ["n1"]


def test_a_pulse_that_says_its_agent_fences_itself_loses_the_node_at_the_next_check():
    """One way: what n1 sends gets here, what we send does not. Its pulses still come, and say that its
    lease is past fence_after with its connection gone: it is lost now, not when its agent has ended."""
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    b.beat(beat("n0"), now=0, wall=100)
    b.beat(beat("n1"), now=0, wall=100)
    assert b.pulse("n1", now=2.0)
    assert b.check_peers(now=2.1, wall=102, connected={"n0"}) == []
    assert not b.pulse("n1", now=4.1, fencing=True)  # not answered: nothing renews its lease
    events = b.check_peers(now=4.2, wall=104, connected={"n0"})
    assert [(e.kind, e.node) for e in events] == [("peer_lost", "n1")]
    assert "says it has had no answer from the coordinator" in events[0].reason and b.status["status"] == "failed"


def test_a_pulse_from_a_node_the_board_never_heard_is_not_answered():
    assert not Board("j1", ["n0", "n1"], peer_timeout=5).pulse("n1", now=0)


# -- the desk: only this session's pulses, each once -----------------------------------------------


def test_the_desk_answers_a_pulse_of_the_nodes_session_once_and_the_answer_is_sealed_for_the_agent():
    agent, coordinator = channels()
    desk = pulse.Desk(["n0", "n1"])
    desk.session("n1", coordinator.session, coordinator.pulse_key)
    data = pulse.seal(agent.pulse_key, b"agent", {"node": "n1", "s": A_NONCE, "p": 1})
    node, fencing, held, reply = desk.take(data)
    assert node == "n1" and not fencing and not held
    pulse.verify(agent.pulse_key, b"coordinator", reply)
    assert pulse.body_of(reply) == {"s": A_NONCE, "p": 1}
    with pytest.raises(ProtocolError, match="replayed"):
        desk.take(data)
    with pytest.raises(ProtocolError, match="bad MAC"):  # the agent's own pulse, reflected as an answer
        pulse.verify(agent.pulse_key, b"coordinator", data)


@pytest.mark.parametrize("forgery", ["wrong secret", "another node's key", "edited", "not a node", "huge", "not json"])
def test_the_desk_refuses_a_forged_or_hostile_datagram(forgery):
    agent, coordinator = channels()
    desk = pulse.Desk(["n0", "n1"])
    desk.session("n1", coordinator.session, coordinator.pulse_key)
    msg = {"node": "n1", "s": A_NONCE, "p": 1}
    data = {"wrong secret": lambda: pulse.seal(channels(secret="x" * 32)[0].pulse_key, b"agent", msg),
            "another node's key": lambda: pulse.seal(channels("n0")[0].pulse_key, b"agent", msg),
            "edited": lambda: pulse.seal(agent.pulse_key, b"agent", msg).replace(b'"p":1', b'"p":9'),
            "not a node": lambda: pulse.seal(agent.pulse_key, b"agent", dict(msg, node="intruder")),
            "huge": lambda: b"0" * 64 + b" " + b"[" * 600,
            "not json": lambda: b"0" * 64 + b" \xff\xfe"}[forgery]()
    with pytest.raises(ProtocolError) as e:
        desk.take(data)
    assert not isinstance(e.value, pulse.Stale)


def test_a_pulse_of_an_older_session_is_stale_and_dropped_without_a_refusal():
    old_agent, _ = channels(a_nonce="b" * 32)
    _, coordinator = channels()
    desk = pulse.Desk(["n1"])
    desk.session("n1", coordinator.session, coordinator.pulse_key)
    with pytest.raises(pulse.Stale):
        desk.take(pulse.seal(old_agent.pulse_key, b"agent", {"node": "n1", "s": "b" * 32, "p": 5}))


def test_a_pulse_says_when_the_network_holds_the_agents_beat_back():
    agent, coordinator = channels()
    desk = pulse.Desk(["n1"])
    desk.session("n1", coordinator.session, coordinator.pulse_key)
    _, fencing, held, _ = desk.take(pulse.seal(agent.pulse_key, b"agent", {"node": "n1", "s": A_NONCE, "p": 1,
                                                                            "h": True, "f": True}))
    assert held and fencing


def tcp_pair():
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    return ours, theirs


def test_the_coordinator_answers_a_pulse_only_where_the_network_holds_beats_or_answers_back():
    """Both kernels delivered everything on n1's open connection: its beats are late because the coordinator
    is slow, and a pulse is dropped (a starved coordinator is not given more to do). Its own beat held back
    (the agent says so), our answer held back (our kernel says so: the agent's side reads nothing here, so
    what we send piles up unacknowledged), or no connection: answered."""
    co = Coordinator("j1", "127.0.0.1", 0, ["n1"], interval=1, peer_timeout=5)
    co.board.beat(beat("n1"), now=time.monotonic(), wall=time.time())
    ours, theirs = tcp_pair()
    try:
        conn = Conn(ours, ("127.0.0.1", 1), time.monotonic())
        conn.node = "n1"
        co.connections.by_node["n1"] = conn
        seen = co.board.peers["n1"].seen
        assert not co._pulse("n1", fencing=False, held=False) and co.board.peers["n1"].seen == seen
        assert co._pulse("n1", fencing=False, held=True) and co.board.peers["n1"].seen > seen
        ours.setblocking(False)
        try:
            while True:  # the agent's kernel takes what its window holds; the rest stays in our queue
                ours.send(b"x" * 65536)
        except BlockingIOError:
            pass
        assert co._pulse("n1", fencing=False, held=False)
        del co.connections.by_node["n1"]
        assert co._pulse("n1", fencing=False, held=False)
        assert not co._pulse("n1", fencing=True, held=True)  # it fences itself: heard, never answered
        assert co.board.peers["n1"].fencing
    finally:
        ours.close()
        theirs.close()


def test_the_agent_says_its_beat_is_held_back_while_its_connection_is_gone_or_holds_an_unacknowledged_beat():
    client = Client("127.0.0.1", 1, interval=1, on_message=lambda m: None)
    assert client._beat_held()  # never connected
    ours, theirs = tcp_pair()
    try:
        client._sock, client.connected = ours, True
        ours.sendall(b"a beat\n")
        assert wait_for(lambda: not client._beat_held(), timeout=5)  # the coordinator's kernel took it
        ours.setblocking(False)
        try:
            while True:  # what the coordinator's side cannot take stays unacknowledged in our queue
                ours.send(b"x" * 65536)
        except BlockingIOError:
            pass
        assert client._beat_held()
        client.connected = False
        assert client._beat_held()
    finally:
        ours.close()
        theirs.close()


# -- over a real socket: the agent's pulser and the desk ------------------------------------------


class DeskThread(threading.Thread):
    def __init__(self, desk, live):
        super().__init__(daemon=True)
        self.desk, self.live, self.refusals, self.stopping = desk, live, [], threading.Event()

    def run(self):
        with selectors.DefaultSelector() as sel:  # as the coordinator's loop does
            sel.register(self.desk.sock, selectors.EVENT_READ)
            while not self.stopping.is_set():
                if sel.select(0.05):
                    self.desk.answer(self.live, self.refusals.append)


@pytest.fixture
def coordinator_desk():
    agent, coordinator = channels()
    desk = pulse.Desk(["n1"])
    assert desk.bind("127.0.0.1", 0, socket.AF_INET)
    desk.session("n1", coordinator.session, coordinator.pulse_key)
    answering = {"n1": True}
    thread = DeskThread(desk, lambda node, fencing, held: answering[node] and not fencing)
    thread.start()
    yield desk, agent, answering, thread
    thread.stopping.set()
    thread.join(2)
    desk.sock.close()


def test_the_pulser_renews_the_lease_only_while_beats_are_late_and_only_while_the_coordinator_answers(coordinator_desk):
    desk, agent, answering, thread = coordinator_desk
    lease = {"age": 0.0, "renewed": []}
    pulser = pulse.Pulser("127.0.0.1", desk.sock.getsockname()[1], 0.05, 1.0, lambda: lease["age"],
                          lambda mono, wall: lease["renewed"].append(mono), lambda age: age >= 4.0)
    pulser.session("n1", A_NONCE, agent.pulse_key)
    pulser.start()
    try:
        time.sleep(0.3)
        assert lease["renewed"] == [] and pulser.number == 0  # beats are on time: no pulse at all
        lease["age"] = 2.0  # the beats are late
        assert wait_for(lambda: len(lease["renewed"]) >= 3, timeout=5)
        assert lease["renewed"] == sorted(lease["renewed"]) and lease["renewed"][-1] <= time.monotonic()
        lease["age"] = 4.5  # the agent's own fence rule holds: its pulses say so, and are not answered
        time.sleep(0.2)
        count, sent = len(lease["renewed"]), pulser.number
        time.sleep(0.5)
        assert len(lease["renewed"]) == count and pulser.number > sent
        lease["age"], answering["n1"] = 2.0, False  # the node was lost: its pulses go on, unanswered
        time.sleep(0.2)
        count, sent = len(lease["renewed"]), pulser.number
        time.sleep(0.5)
        assert len(lease["renewed"]) == count and pulser.number > sent
        assert thread.refusals == []
    finally:
        pulser.stop()
        pulser.join(2)


def test_an_answer_not_sealed_by_the_coordinator_renews_nothing(coordinator_desk):
    desk, agent, _, thread = coordinator_desk
    renewed = []
    fake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a program that answers in the coordinator's place
    fake.bind(("127.0.0.1", 0))
    fake.settimeout(0.1)
    pulser = pulse.Pulser("127.0.0.1", fake.getsockname()[1], 0.05, 0.0, lambda: 5.0, lambda m, w: renewed.append(m))
    pulser.session("n1", A_NONCE, agent.pulse_key)
    pulser.start()
    try:
        answered = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                data, addr = fake.recvfrom(1024)
            except socket.timeout:
                continue
            body = pulse.body_of(data)
            fake.sendto(data, addr)  # its own pulse reflected
            fake.sendto(pulse.seal(b"guess", b"coordinator", {"s": body["s"], "p": body["p"]}), addr)
            answered += 1
        assert answered >= 5 and renewed == []
    finally:
        pulser.stop()
        pulser.join(2)
        fake.close()
