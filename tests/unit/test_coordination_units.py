"""The coordinator's pure parts, with no socket and no clock: the board (who beat when, the
job's status) and the protocol (bounds checked before parsing, the handshake, sealed frames)."""
from __future__ import annotations

import json

import pytest

from fabtrain.node.coordination import protocol, roster
from fabtrain.node.coordination.board import Board, Event
from fabtrain.node.coordination.protocol import Channel, LineReader, ProtocolError
from fabtrain.node.coordination.restart import RestartPolicy

SECRET = "0123456789abcdef0123456789abcdef"


def beat(node, procs=None, **kw):
    return {"op": "beat", "job_id": "j1", "node": node, "seq": 1, "procs": procs or {}, **kw}


def trainer(name, state="running", code=None):
    return {name: {"role": "trainer", "rank": int(name[-1]), "state": state, "exit_code": code}}


# -- the board ------------------------------------------------------------------------------------


def test_the_first_failure_wins_and_the_status_never_goes_back():
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    out = b.beat(beat("n0", trainer("trainer-0")), now=0, wall=100)
    assert out.changed and out.reply["status"] == "running" and out.reply["ack"] == 1  # a new peer is news
    out = b.beat(beat("n1", failure={"reason": "trainer-1 on n1 exited with code 3"}), now=1, wall=101)
    assert out.changed and b.status == {"status": "failed", "reason": "trainer-1 on n1 exited with code 3",
                                        "node": "n1", "ts": 101, "generation": 0, "restarts_left": 0, "backoff": None}
    out = b.beat(beat("n0", failure={"reason": "second"}, final={"status": "finished"}), now=2, wall=102)
    assert not out.changed and b.status["reason"] == "trainer-1 on n1 exited with code 3"


def test_finished_needs_every_trainer_accounted_for():
    b = Board("j1", ["n0", "n1", "n2"], peer_timeout=5)
    b.beat(beat("n0", {"pserver-0": {"role": "pserver", "rank": 0, "state": "running"}}), 0, 0)
    b.beat(beat("n1", trainer("trainer-0", "exited", 0)), 0, 0)
    assert b.status["status"] == "running"  # n2 has not spoken: its trainer may still run
    assert b.beat(beat("n2", trainer("trainer-1", "exited", 0)), 0, 0).changed
    assert b.status["status"] == "finished" and b.every_node_spoke()
    b = Board("j1", ["n0", "n1", "n2"], peer_timeout=5)  # WORLD_SIZE known: a silent node is not needed
    b.beat(beat("n1", trainer("trainer-0", "exited", 0), trainers_expected=2), 0, 0)
    b.beat(beat("n2", trainer("trainer-1", "exited", 0), trainers_expected=2), 0, 0)
    assert b.status["status"] == "finished"
    b = Board("j1", ["n1"], peer_timeout=5)
    b.beat(beat("n1", trainer("trainer-0", "exited", 1)), 0, 0)
    assert b.status["status"] == "running"  # exit 1 is not a finish (the agent reports the failure itself)


def test_a_silent_peer_is_lost_fails_the_job_and_may_come_back():
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    b.beat(beat("n0"), now=0, wall=0)
    b.beat(beat("n1", done=True), now=0, wall=0)
    assert b.check_peers(now=4.9, wall=0) == []
    events = b.check_peers(now=5.0, wall=7)
    assert [e.kind for e in events] == ["peer_lost"] and events[0].node == "n0"  # n1 is done: it may go quiet
    assert b.status["status"] == "failed" and b.status["reason"].startswith("node n0 lost: no heartbeat")
    assert b.view()["lost"] == ["n0"] and b.all_peers_settled()
    assert b.check_peers(now=20, wall=0) == []  # lost once
    out = b.beat(beat("n0"), now=21, wall=21)
    assert out.events == [Event("peer_back", "n0", "agent on n0 beats again")] and out.changed
    assert b.status["status"] == "failed" and b.view()["lost"] == []


@pytest.mark.parametrize("bad", [
    {"node": 7}, {"procs": ["trainer-0"]}, {"procs": {"t": "running"}}, {"failure": "boom"},
    {"final": ["finished"]}, {"trainers_expected": "2"}, {"trainers_expected": True},
])
def test_a_beat_of_the_wrong_shape_is_refused_and_changes_nothing(bad):
    b = Board("j1", ["n0"], peer_timeout=5)
    out = b.beat(dict(beat("n0"), **bad), 0, 0)
    assert out.reply["op"] == "error" and not out.changed and b.peers == {}


def test_another_jobs_agent_is_refused_and_an_ended_job_gives_its_port_away():
    b = Board("j1", ["n0"], peer_timeout=5)
    assert "not j2" in b.wrong_job("j2")["error"] and not b.superseded
    b.beat(beat("n0", failure={"reason": "x"}), 0, 0)
    b.wrong_job("j2")
    assert b.superseded


def test_a_restored_board_keeps_the_status_and_gives_peers_a_fresh_timeout():
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    b.beat(beat("n0", trainer("trainer-0")), 0, 10)
    b.beat(beat("n1", failure={"reason": "boom"}), 0, 11)
    saved = json.loads(json.dumps(b.saved(wall=12)))  # as it goes through coordinator.json
    again = Board.restore(saved, "j1", ["n0", "n1"], 5, now=100)
    assert again.status["status"] == "failed" and again.status["reason"] == "boom"
    assert set(again.peers) == {"n0", "n1"} and again.peers["n0"].procs == trainer("trainer-0")
    assert again.check_peers(now=104, wall=0) == []  # seen "now" at restore time
    assert Board.restore(saved, "j2", ["n0"], 5, now=0) is None
    for garbage in (None, [], {"job_id": "j1", "status": "x", "peers": {"n0": 3}}):
        restored = Board.restore(garbage, "j1", ["n0"], 5, now=0)
        assert restored is None or (restored.status["status"] == "running" and restored.peers == {})


# -- the protocol ----------------------------------------------------------------------------------


def test_nesting_and_length_are_bounded_before_parsing():
    assert protocol.nesting_ok(b'{"a":[1,{"b":"[[[[[[[[[[[[[[[["}]}')  # brackets in strings are text
    assert protocol.nesting_ok(b"[" * 8 + b"]" * 8) and not protocol.nesting_ok(b"[" * 9 + b"]" * 9)
    assert not protocol.nesting_ok(b"[" * 200_000)  # what killed the old coordinator's thread
    assert not protocol.nesting_ok(b"[}")
    with pytest.raises(ProtocolError, match="nested deeper"):
        protocol.parse(b"[" * 200_000, max_len=1 << 20)
    with pytest.raises(ProtocolError, match="line of 2000 bytes"):
        protocol.parse(b" " * 2000, max_len=1024)
    for bad in (b"\xff\xfe", b"[1]", b"nul", b'"x"'):
        with pytest.raises(ProtocolError):
            protocol.parse(bad, max_len=1024)
    reader = LineReader(limit=10)
    assert reader.feed(b"ab\ncd") == [b"ab"] and reader.feed(b"\n") == [b"cd"]
    with pytest.raises(ProtocolError, match="longer than 10"):
        reader.feed(b"x" * 11)


def test_only_a_holder_of_the_secret_can_answer_a_hello():
    nonce, theirs = protocol.new_nonce(), protocol.new_nonce()
    assert protocol.read_hello(protocol.hello("j1", "n0", nonce)) == {"job_id": "j1", "node": "n0", "nonce": nonce}
    good = protocol.challenge(SECRET, "j1", "n0", nonce, theirs)
    assert protocol.read_challenge(SECRET, "j1", "n0", nonce, good.strip()) == {"nonce": theirs}
    assert SECRET.encode() not in good
    for forged in (protocol.challenge("not the secret", "j1", "n0", nonce, theirs),
                   protocol.challenge(SECRET, "j1", "n0", protocol.new_nonce(), theirs),  # an old hello's answer
                   protocol.challenge(SECRET, "j1", "n1", nonce, theirs),
                   b'{"op":"status","status":"finished"}'):
        with pytest.raises(ProtocolError):
            protocol.read_challenge(SECRET, "j1", "n0", nonce, forged.strip())
    for bad in (b'{"op":"hello","v":1,"job_id":"j1","node":"n0","nonce":"zz"}',
                b'{"op":"hello","v":2,"job_id":"j1","node":"n0","nonce":"%s"}' % nonce.encode(),
                b'{"op":"beat","job_id":"j1","secret":"x"}'):
        with pytest.raises(ProtocolError):
            protocol.read_hello(bad)


def pair(secret_a=SECRET, secret_c=SECRET):
    a, c = protocol.new_nonce(), protocol.new_nonce()
    return (Channel(secret_a, "j1", "n0", a, c, "agent"), Channel(secret_c, "j1", "n0", a, c, "coordinator"))


def test_frames_are_refused_when_forged_replayed_reflected_or_from_another_connection():
    agent, coord = pair()
    first = agent.seal(beat("n0")).rstrip(b"\n")
    assert coord.open(first)["n"] == 1
    with pytest.raises(ProtocolError, match="out of order"):
        coord.open(first)  # the same frame again
    second = agent.seal(beat("n0", failure={"reason": "x"})).rstrip(b"\n")
    with pytest.raises(ProtocolError, match="bad MAC"):
        coord.open(second.replace(b'"reason":"x"', b'"reason":"y"'))
    with pytest.raises(ProtocolError, match="bad MAC"):
        agent.open(coord.seal({"op": "status"}).rstrip(b"\n").replace(b"status", b"statuz"))
    with pytest.raises(ProtocolError, match="bad MAC"):
        coord.open(coord.seal({"op": "status"}).rstrip(b"\n"))  # its own frame sent back to it
    _, other = pair()
    with pytest.raises(ProtocolError, match="bad MAC"):
        other.open(first)  # another connection's session key
    _, wrong = pair(secret_c="another secret")
    with pytest.raises(ProtocolError, match="bad MAC"):
        wrong.open(pair()[0].seal(beat("n0")).rstrip(b"\n"))
    assert coord.open(second)["failure"] == {"reason": "x"}  # the genuine frame, in order, still passes
    deep = agent.seal({"op": "beat", "procs": json.loads("[" * 20 + "]" * 20)}).rstrip(b"\n")
    with pytest.raises(ProtocolError, match="nested deeper"):
        coord.open(deep)  # even a holder of the secret cannot make the parser recurse


def test_a_frame_is_the_documented_hmac_of_direction_and_body_under_the_session_key():
    """The wire format of protocol.py's docstring, computed here with hmac.digest from the secret:
    an agent of another fabtrain version (or another implementation) interoperates."""
    import hashlib
    import hmac
    a, c = protocol.new_nonce(), protocol.new_nonce()
    agent, coord = Channel(SECRET, "j1", "n0", a, c, "agent"), Channel(SECRET, "j1", "n0", a, c, "coordinator")
    key = hmac.new(SECRET.encode(), json.dumps(["session", "j1", "n0", a, c]).encode(), hashlib.sha256)
    key = key.hexdigest().encode()
    for sender, direction in ((agent, b"agent"), (coord, b"coordinator"), (agent, b"agent")):
        frame = sender.seal(beat("n0"))
        mac, _, body = frame.rstrip(b"\n").partition(b" ")
        assert mac == hmac.digest(key, direction + b" " + body, "sha256").hex().encode()
        assert json.loads(body)["n"] == sender.sent  # 1, 1, then the agent's second frame


# -- at scale: a beat's reply does not grow with the nodes ----------------------------------------


def running_board(n):
    b = Board("j1", ["n%d" % i for i in range(n)], peer_timeout=5)
    known = {}
    for rnd in range(2):
        for i in range(n):
            out = b.beat(beat("n%d" % i, trainer("trainer-0"), roster=known.get(i)), now=rnd, wall=100 + rnd)
            if "roster" in out.reply:
                known[i] = {"epoch": out.reply["roster"]["epoch"], "at": out.reply["roster"]["at"]}
    return b, known


def test_an_up_to_date_beat_is_answered_the_same_at_16_and_1000_nodes():
    replies = []
    for n in (16, 1000):
        b, known = running_board(n)
        out = b.beat(beat("n3", trainer("trainer-0"), roster=known[3]), now=2, wall=102)
        assert "roster" not in out.reply and not out.changed and not out.broadcast
        assert out.reply["trainers_running"] == n and out.reply["nodes_seen"] == n
        replies.append(json.dumps(out.reply).replace(str(n), "N"))
    assert len(replies[0]) == len(replies[1])


def test_the_roster_travels_as_what_changed_since_the_version_the_agent_holds():
    b, known = running_board(50)
    b.beat(beat("n7", done=True), now=3, wall=103)  # n7 is done, n9 goes silent
    for i in range(50):
        if i != 9:
            b.beat(beat("n%d" % i, done=i == 7), now=20, wall=120)
    b.check_peers(now=20, wall=120)
    out = b.beat(beat("n3", roster=known[3]), now=20, wall=120)
    delta = out.reply["roster"]
    assert not delta["full"] and set(delta["nodes"]) == {"n7", "n9"}
    assert delta["nodes"]["n7"][1:] == [True, False] and delta["nodes"]["n9"][1:] == [False, True]
    # Merged into what the agent held, it is the coordinator's whole roster.
    held = roster.merged({}, b.roster.since(None))
    assert roster.merged(roster.merged({}, running_board(50)[0].roster.since(None)), delta).keys() == held.keys()
    view = b.view()
    assert view["lost"] == ["n9"] and view["done"] == ["n7"] and len(view["peers"]) == 50
    # An agent that holds nothing, or another coordinator's version (it restarted), gets it all.
    assert b.roster.since(None)["full"] and b.roster.since({"epoch": "other", "at": 3})["full"]
    assert b.roster.since({"epoch": b.roster.epoch, "at": b.roster.version}) is None


def test_a_peer_whose_connection_stays_open_is_slow_not_lost():
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    b.beat(beat("n0", trainer("trainer-0")), now=0, wall=0)
    b.beat(beat("n1", trainer("trainer-1")), now=0, wall=0)
    assert b.check_peers(now=29, wall=29, connected={"n0", "n1"}) == []  # silent, but its kernel answers TCP
    events = b.check_peers(now=29.5, wall=30, connected={"n0"})  # n1's connection is gone: lost after 5 s
    assert [e.node for e in events] == ["n1"] and "peer_timeout 5 s" in events[0].reason
    b = Board("j1", ["n0"], peer_timeout=5)
    b.beat(beat("n0"), now=0, wall=0)
    (event,) = b.check_peers(now=30, wall=30, connected={"n0"})  # hung_timeout: 6 peer_timeouts
    assert "while its connection stayed open (hung_timeout 30 s)" in event.reason
    assert b.status["status"] == "failed"


def test_trainer_counts_follow_the_beats_and_survive_a_restore():
    b = Board("j1", ["n0", "n1"], peer_timeout=5)
    b.beat(beat("n0", trainer("trainer-0")), 0, 0)
    b.beat(beat("n1", trainer("trainer-1")), 0, 0)
    assert b.status_line()["trainers_running"] == 2
    b.beat(beat("n1", trainer("trainer-1", "exited", 0)), 1, 1)
    assert b.status_line()["trainers_running"] == 1 and b.status["status"] == "running"
    again = Board.restore(json.loads(json.dumps(b.saved(2))), "j1", ["n0", "n1"], 5, now=3)
    assert again.status_line()["trainers_running"] == 1 and again.every_node_spoke()
    again.beat(beat("n0", trainer("trainer-0", "exited", 0)), 4, 4)
    assert again.status["status"] == "finished"


def test_a_beats_reply_on_the_wire_is_the_reply_whatever_changed_between_beats():
    """The status line in every reply is encoded once a change (Board.encoded_status): a node that joins,
    a trainer that exits, a failure, a node that is lost, another roster each show in the next
    reply's bytes, as they do in the reply itself."""
    b = Board("j1", ["n0", "n1", "n2"], peer_timeout=5)
    a, c = protocol.new_nonce(), protocol.new_nonce()
    channel = Channel(SECRET, "j1", "n0", a, c, "coordinator")
    steps = [("n0", trainer("trainer-0"), {}), ("n0", trainer("trainer-0"), {"seq": 2}), ("n2", None, {}),
             ("n1", trainer("trainer-1"), {}), ("n1", trainer("trainer-1", "exited", 0), {"seq": 7}),
             ("n0", trainer("trainer-0"), {"roster": {"epoch": "x", "at": 0}}),
             ("n2", trainer("trainer-2", "exited", 1), {"failure": {"reason": "trainer-2 exited with code 1"}}),
             ("n0", trainer("trainer-0"), {"seq": "not a number"})]
    seen = []
    for i, (node, procs, kw) in enumerate(steps):
        out = b.beat(beat(node, procs, **kw), now=i, wall=100 + i)
        frame = channel.seal(out.reply, out.body).rstrip(b"\n")
        sent = json.loads(frame.partition(b" ")[2])
        assert sent == json.loads(protocol.compact(dict(out.reply, n=i + 1))), (i, sent)
        seen.append((sent["status"], sent["nodes_seen"], sent["trainers_running"], "roster" in sent))
    assert [e.kind for e in b.check_peers(now=100, wall=200)] == ["peer_lost"] * 3
    back = b.beat(beat("n0", trainer("trainer-0")), now=100, wall=200)
    assert json.loads(back.body) == json.loads(protocol.compact(back.reply))
    assert json.loads(back.body)["trainers_running"] == 1 and back.events[0].kind == "peer_back"
    assert [x[:3] for x in seen[:5]] == [("running", 1, 1), ("running", 1, 1), ("running", 2, 1),
                                         ("running", 3, 2), ("running", 3, 1)]
    assert seen[6][0] == "failed" and seen[7][0] == "failed"


# -- a beat carries what changed since the last on its connection ------------------------------------


def test_a_beat_carries_what_changed_since_the_last_one_on_its_connection():
    first = {"op": "beat", "job_id": "j1", "node": "n0", "seq": 1, "procs": trainer("trainer-0"), "done": False,
             "failure": None, "roster": None}
    assert protocol.beat_changes(first, {}) == first  # the first on a connection is whole
    again = dict(first, seq=2)
    assert protocol.beat_changes(again, first) == {"op": "beat", "node": "n0", "seq": 2}
    exited = dict(again, seq=3, procs=trainer("trainer-0", "exited", 0), roster={"epoch": "e", "at": 4})
    assert protocol.beat_changes(exited, again) == {"op": "beat", "node": "n0", "seq": 3,
                                                    "procs": exited["procs"], "roster": {"epoch": "e", "at": 4}}
    fewer = {k: v for k, v in exited.items() if k != "failure"}
    assert protocol.beat_changes(dict(fewer, seq=4), exited) == {"op": "beat", "node": "n0", "seq": 4,
                                                                 "failure": None}


def test_a_board_told_only_what_changed_ends_where_one_told_every_beat_whole_does():
    """Two boards, one fed the agents' whole beats, one what the agents' connections carry: the same
    reply to every beat, the same job, the same peers. Joins, step rates, trainers that exit, a node
    that is done, rosters the agents adopt, a failure that restarts the job, the next generation."""
    policy = RestartPolicy(enabled=True, max_restarts=2, backoff=0.0, exit_codes=None, grace=0.0)
    nodes = ["n0", "n1", "n2"]
    whole_board, told_board = Board("j1", nodes, 5, policy), Board("j1", nodes, 5, policy)
    told_board.roster.epoch = whole_board.roster.epoch
    held = {n: None for n in nodes}  # the roster version each agent holds, from its replies
    last = {n: {} for n in nodes}  # what each agent's connection carried last

    def procs(node, state="running", code=None, rate=None):
        return {"trainer-%s" % node[1]: {"role": "trainer", "rank": int(node[1]), "state": state, "exit_code": code,
                                         "rate": rate}}

    story = [("n0", {}), ("n1", {}), ("n2", {}), ("n0", {"procs": procs("n0", rate=9.5)}),
             ("n1", {"procs": procs("n1", rate=9.7)}), ("n0", {"procs": procs("n0", rate=9.6)}),
             ("n2", {"procs": procs("n2", "exited", 0), "done": True}), ("n1", {}), ("n2", {}),
             ("n1", {"procs": procs("n1", "exited", 3), "failure": {"reason": "trainer-1 exited with code 3",
                                                                     "kind": "exit", "exit_code": 3,
                                                                     "generation": 0}}),
             ("n0", {"procs": {}}), ("n1", {"procs": {}, "failure": None}),
             ("n0", {"procs": procs("n0", rate=1.0), "generation": 1}),
             ("n1", {"procs": procs("n1", rate=1.0), "generation": 1}), ("n2", {"generation": 1}),
             ("n0", {"trainers_expected": 3})]
    state = {n: {"op": "beat", "job_id": "j1", "node": n, "procs": procs(n), "done": False, "failure": None,
                 "final": None, "generation": 0, "trainers_expected": None} for n in nodes}
    for i, (node, change) in enumerate(story):
        state[node] = dict(state[node], seq=i + 1, roster=held[node], **change)
        whole = whole_board.beat(dict(state[node]), now=i, wall=100 + i)
        told = told_board.beat(protocol.beat_changes(state[node], last[node]), now=i, wall=100 + i)
        last[node] = state[node]
        assert told.reply == whole.reply and told.body == whole.body and told.broadcast == whole.broadcast, i
        if "roster" in whole.reply:
            held[node] = {"epoch": whole.reply["roster"]["epoch"], "at": whole.reply["roster"]["at"]}
        if i == 6:
            assert "roster" in whole.reply  # n2 is done: the others hear of it in their next reply
    assert whole_board.status["status"] == "running" and whole_board.status["generation"] == 1
    assert told_board.view() == whole_board.view() and told_board.status == whole_board.status
    for n in nodes:
        assert told_board.peers[n] == whole_board.peers[n], n
    assert (told_board.trainers, told_board.trainers_live, told_board.expected) == \
        (whole_board.trainers, whole_board.trainers_live, whole_board.expected) == (3, 2, 3)
