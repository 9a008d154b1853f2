"""The job's shared state, as a table: who beat when, the job's status, what to do about it.

Pure: no sockets, no threads, no clock of its own (every call is told `now`,
monotonic seconds, and `wall`, epoch seconds), no files (`saved()` and
`Board.restore` give and take plain data). The coordinator's server feeds it
authenticated beats and the passing of time, and carries out what it returns:
a reply, whether to push the new status to every agent, and events to write.

The job's status only moves from running to failed or finished, never back;
the first failure wins. A peer that did not say it was done is lost when it
is silent for `peer_timeout` and its connection is gone (closed, reset, or
timed out by TCP: the process or the network is gone), or for
`hung_timeout(peer_timeout)` while its connection stays open (the kernel on
its side still answers: the agent is slow, stopped or starved, and slow is
not lost). A lost node fails a running job.

Work per beat does not grow with the number of nodes: the reply is the
job's status, counters kept as beats come in (`trainers_running`, the
trainers that finished), and only the roster entries that changed since the
version the sender holds (roster.py). Under `on_failure:
restart` (restart.py decides) a failure of the current generation moves it to
``restarting`` instead, with the next generation's number: every agent tears
down, waits the backoff and starts its part again; once every node that ran
processes has said so the status is ``running`` again, and if one has not
within the restart's deadline the job fails naming it. A failure of an older
generation (an agent that has not heard yet) changes nothing. With `min_nodes` (elastic.py) a node that is lost or
cannot start its part leaves instead (the status's `out`): the job restarts without it; a lost one heard again comes back.
"""
from __future__ import annotations

from fabtrain.node.structs import as_dict, factory, record
from typing import NamedTuple

from fabtrain.contract.events import EventKind
from fabtrain.contract.states import FINAL, LIVE, FailureKind, JobState, ProcessState

from .connections import hung_timeout
from .fence import Departures
from .protocol import compact
from .restart import REJOIN, RestartPolicy, note_loaded
from .roster import Roster
from . import quorum, spares

MAX_PROCS = 4096  # processes one node may report; a real node has a handful


class Event(NamedTuple):
    """Something the hosting agent writes to events.jsonl (`fields`: more of the event's keys)."""
    kind: str
    node: str | None
    reason: str
    fields: dict | None = None


class Outcome(NamedTuple):
    """What to do with one beat: the reply to its sender, save the board?, events, push the status to everyone?"""
    reply: dict
    changed: bool
    events: list
    broadcast: bool = False
    body: bytes | None = None  # `reply` as compact JSON, where the board built it (see Board.encoded_status)


@record(frozen=False)
class Peer:
    seen: float  # monotonic, of the last beat or pulse (pulse.py)
    beat_seen: float = 0.0  # monotonic, of the last beat: a pulse carries no news, so it cannot stand in for long
    fencing: bool = False  # its last pulse said its agent is fencing itself (no answer past its fence_after)
    ts: float | None = None  # epoch, of the last beat
    done: bool = False  # nothing of the job is left on that node: it may go quiet
    lost: bool = False
    procs: dict = factory(dict)
    expected: int | None = None  # trainers the job has (WORLD_SIZE), if the node knows
    had_procs: bool = False  # it has run job processes: it must start its part of every generation
    generation: int = 0  # the last generation it said it started
    trainers: int = 0  # of procs: trainers, those that exited with code 0, those alive
    trainers_ok: int = 0
    trainers_live: int = 0
    roster: dict | None = None  # the roster version the agent last said it holds (roster.py)
    running: int = 0  # of procs, those alive (any role), kept after it left: a node back with none may rejoin
    part: str | None = None  # the id of the node's part its agent said (job.json's `part`): a new one is a new start
    knows: int = 0  # a job that elects: the newest generation its beats said its agent knows (quorum.py)


def beat_error(msg: dict) -> str | None:
    """Why a beat's fields cannot be taken in, or None. The sender was authenticated; this is about shape."""
    if not isinstance(msg.get("node"), str):
        return "beat without a node"
    procs = msg.get("procs")
    if procs is not None and (not isinstance(procs, dict) or len(procs) > MAX_PROCS
                              or not all(isinstance(p, dict) for p in procs.values())):
        return "beat's procs is not a table of processes"
    for key in ("failure", "final"):
        if msg.get(key) is not None and not isinstance(msg[key], dict):
            return "beat's %s is not an object" % key
    expected = msg.get("trainers_expected")
    if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool)):
        return "beat's trainers_expected is not a number"
    return None


def _silence(name: str, p: Peer, open_: bool, now: float, peer_timeout: float) -> str | None:
    """Why the peer `name` is lost now, or None: silent for peer_timeout with its connection gone, for
    hung_timeout with it open (slow is not lost), its pulse saying it fences itself (what it sends gets
    here, what we send does not), or no beat for hung_timeout though pulses come."""
    hung = hung_timeout(peer_timeout)
    if now - p.seen >= (hung if open_ else peer_timeout):
        return ("no heartbeat from the agent on %s for %.0f s while its connection stayed open (hung_timeout %.0f s)"
                % (name, now - p.seen, hung) if open_ else
                "no heartbeat from the agent on %s for %.0f s (peer_timeout %.0f s)" % (name, now - p.seen, peer_timeout))
    if p.fencing:
        return ("the agent on %s says it has had no answer from the coordinator for longer than its fence_after: "
                "it fences itself" % name)
    if now - p.beat_seen >= hung:
        return ("no beat from the agent on %s for %.0f s, though its pulses come: its connection to the coordinator "
                "cannot be kept (hung_timeout %.0f s)" % (name, now - p.beat_seen, hung))
    return None


def _text(value, default: str) -> str:
    return value if isinstance(value, str) else default


class Board:
    def __init__(self, job_id: str, nodes: list[str], peer_timeout: float, restart: RestartPolicy | None = None):
        self.job_id = job_id
        self.nodes = list(nodes)
        self.node_set = frozenset(self.nodes)
        self.peer_timeout = peer_timeout
        self.hung_timeout = hung_timeout(peer_timeout)
        self.restart = restart or RestartPolicy.never()
        self.status: dict = {"status": JobState.RUNNING, "reason": None, "node": None, "ts": None, "generation": 0,
                             "restarts_left": self.restart.restarts_left(0), "backoff": None}
        self.restart_due: float | None = None  # monotonic: every node's part of the generation started by then
        self.restart_start: float | None = None  # monotonic: when the agents start the generation (backoff over)
        self.out: frozenset = frozenset()  # nodes that left the job (min_nodes): no generation waits for them
        self.departed = Departures(self.restart.max_rejoins)  # when and why each left; which were told (fence.py)
        self.back: set = set()  # nodes of `out` that beat again with nothing of the job left: the next generation's
        self.stand_in: dict = {}  # spare -> the node that left whose slot it holds (spares.py)
        self.joining: tuple = ()  # (generation, `node3 back in generation 2 (WORLD_SIZE 3)`): its status says so
        self.peers: dict[str, Peer] = {}
        self.roster = Roster()
        self.spoke = 0  # peers that are nodes of the job
        self.trainers = self.trainers_ok = self.trainers_live = 0  # sums of the peers' counts
        self.expected: int | None = None  # the largest trainers_expected a peer said
        self.superseded = False  # a newer job asked for this port while ours is over
        self.elected = False  # its coordinator was elected by majority (succession.py): nodes[0] may leave too
        self.quorum = quorum.of(self.restart)  # a job that elects: who must know a generation before it starts
        self.loaded: dict[int, dict] = {}  # generation -> what a failed process of it had just loaded (restart.py)
        self.resume: dict | None = None  # the restarting generation's fallback checkpoint (on_bad_checkpoint previous)
        self._status_cache: tuple | None = None  # (status dict, (peers, trainers live), status line, its JSON)

    # -- what it says -------------------------------------------------------------------------

    def status_line(self) -> dict:
        """The status line every agent gets when the job's status changes: its size does not grow with the nodes."""
        return {"op": "status", "job_id": self.job_id, **self.status,
                "nodes_seen": len(self.peers), "trainers_running": self.trainers_live}

    def encoded_status(self) -> tuple[dict, bytes]:
        """(status_line(), its compact JSON). Every beat's reply repeats it, and it changes rarely: built
        once a change, not once a beat (encoding it was a fifth of a beat's cost at 1,000 nodes).
        _set_status replaces self.status, never changes it in place: the dict itself is the version."""
        counts = (len(self.peers), self.trainers_live)
        cached = self._status_cache
        if cached is None or cached[0] is not self.status or cached[1] != counts:
            line = self.status_line()
            cached = self._status_cache = (self.status, counts, line, compact(line).encode())
        return cached[2], cached[3]

    def view(self) -> dict:
        """The status line with the whole roster (the agents build the same from the replies' rosters)."""
        return dict(self.status_line(), peers={n: e[0] for n, e in self.roster.entries.items()},
                    done=self.roster.names(1), lost=self.roster.names(2))

    def finished_now(self) -> bool:
        """Every trainer of the job has exited with code 0, and every trainer is accounted for."""
        if not self.trainers or self.trainers_ok != self.trainers:
            return False
        return self.every_node_spoke() or (self.expected is not None and self.trainers >= self.expected)

    def every_node_spoke(self) -> bool:
        return self.spoke >= len(self.node_set)

    def all_peers_settled(self) -> bool:
        """Every agent that ever spoke is done or lost: nobody needs the coordinator any more."""
        return all(p.done or p.lost for p in self.peers.values())

    def knows(self, node: str) -> bool:
        """Whether `node` is one of the job's nodes (any node, for a board that was given none)."""
        return not self.nodes or node in self.node_set

    # -- what changes it ------------------------------------------------------------------------

    def _set_status(self, status: str, reason: str | None, node: str | None, wall: float, generation: int | None = None,
                    backoff: float | None = None) -> bool:
        if self.status["status"] in FINAL:
            return False
        g = self.status["generation"] if generation is None else generation
        self.status = {"status": status, "reason": reason, "node": node, "ts": wall, "generation": g,
                       "restarts_left": self.restart.restarts_left(g), "backoff": backoff, **_extras(self, status, g)}
        if status != JobState.RESTARTING:
            self.restart_due = None
        return True

    def _failure(self, failure: dict, node: str, now: float, wall: float, events: list) -> bool:
        """A failure an agent reported: restart the job (a new generation) or fail it."""
        generation = self.status["generation"]
        note_loaded(self.loaded, failure)  # any node's word on it, also after the generation's decision
        if failure.get("generation", 0) != generation or node in self.out or spares.idle(self, node):
            return False  # of an older generation, already acted on (or of one this board never started), or a spare's
        reason = _text(failure.get("reason"), "failed") or "failed"
        if failure.get("kind") in (FailureKind.START, FailureKind.LOST) and self.restart.layout is not None:
            # min_nodes: the job goes on without it
            return self._leave(node, reason, now, wall, events, failure.get("kind") == FailureKind.LOST)
        if failure.get("kind") == FailureKind.LOST and node in self.peers and not failure.get("before"):  # silent now
            self.peers[node].done = True
        return self._decide(failure, reason, node, now, wall)

    def _decide(self, failure: dict, reason: str, node: str | None, now: float, wall: float,
                not_before: float | None = None, since: float | None = None) -> bool:
        """Restart after this failure, or fail the job; the backoff counts from `since`, when the failure began (a lost
        node's last word: finding it out took part of the wait), and ends no earlier than `not_before` (its fence)."""
        generation = self.status["generation"]
        decision = self.restart.decide(failure, generation, self.loaded.get(generation - 1))
        if not decision.restart:
            return self._set_status(JobState.FAILED, decision.failed(reason), node, wall)
        for p in self.peers.values():  # once a failure: O(nodes) here is not O(nodes) a beat
            p.had_procs = p.had_procs or bool(p.procs)
        backoff = decision.backoff if since is None else max(0.0, decision.backoff - (now - since))
        if not_before is not None and not_before - now > backoff:
            backoff = round(not_before - now, 3)
        self.resume, reason = decision.resume, decision.restarting(reason)  # on_bad_checkpoint previous's fallback
        changed = self._set_status(JobState.RESTARTING, reason, node, wall, decision.generation, backoff)
        self.restart_due = now + self.restart.start_deadline(decision.generation) + (backoff - decision.backoff)
        self.restart_start = now + backoff
        return changed

    def _leave(self, node: str, reason: str, now: float, wall: float, events: list, returns: bool = True) -> bool:
        """`node` is lost or could not start its part: the job goes on without it (min_nodes), or fails.
        `returns`: it may come back (lost, or fenced itself), not one that could not start its part."""
        layout, st = self.restart.layout, self.status
        if st["status"] in FINAL or spares.idle(self, node):
            return False  # (an idle spare is in no generation's world: its loss is its peer_lost only)
        stand_in = spares.after_leave(self, node) if layout is not None else {}
        out, why = layout.leave(node, self.out, stand_in, self.elected) if layout is not None else (None, "")
        if out is None:
            return self._set_status(JobState.FAILED, reason + ("; not restarted: %s" % why if why else ""), node, wall)
        if out == self.out:
            return False
        self.out, self.stand_in, before = out, stand_in, self.stand_in
        self.departed.leave(node, st["generation"], reason, returns)
        peer = self.peers.get(node)
        # Its agent stops everything of the job there within the fence's bound of its last beat: no
        # generation without it starts before then (fence.py).
        since = peer.seen if peer is not None else now
        not_before = since + self.restart.fence_wait
        if peer is not None:  # its processes are no longer the job's: they count for nothing
            self._count(peer, {})
            peer.had_procs = False
        left = "%s left the job (%s)" % (node, reason)
        # A generation no agent has started yet (its backoff is not over) runs without the node, once the
        # node's fence allows (its start moves later if need be: the agents take the remaining backoff);
        # otherwise the nodes that started it with the node in their world start the next one.
        if st["status"] == JobState.RESTARTING and self.restart_start is not None and now < self.restart_start - 1.0:
            later = max(0.0, not_before - self.restart_start)
            self.restart_start += later
            self.restart_due = self.restart_due + later if self.restart_due is not None else None
            changed = self._set_status(JobState.RESTARTING, st["reason"], st["node"], wall, st["generation"],
                                       round(self.restart_start - now, 3))
        else:
            changed = self._decide({"kind": FailureKind.LEFT}, left, node, now, wall, not_before, since)
        if self.status["status"] == JobState.RESTARTING:
            events += [_node_left(node, left, self.status["generation"], layout, out, stand_in), *spares.taken(self, before, Event)]
        return changed

    def _restarted(self, wall: float) -> bool:
        """Every node that runs processes has started its part of the new generation: running again."""
        g = self.status["generation"]
        if self.status["status"] != JobState.RESTARTING or \
                any(p.had_procs and p.generation < g and n not in self.out for n, p in self.peers.items()):
            return False
        return self._set_status(JobState.RUNNING, None, None, wall)

    def _join(self, node: str, now: float) -> Peer:
        peer = self.peers[node] = Peer(seen=now, beat_seen=now)
        self.spoke += node in self.node_set
        return peer

    def _count(self, peer: Peer, procs: dict) -> None:
        """Set the peer's processes, keeping the board's trainer counts (so no beat walks every peer)."""
        trainers = ok = live = 0
        for proc in procs.values():
            if proc.get("role") == "trainer":
                state = proc.get("state")
                trainers += 1
                ok += state == ProcessState.EXITED and proc.get("exit_code") == 0
                live += state in LIVE
        self.trainers += trainers - peer.trainers
        self.trainers_ok += ok - peer.trainers_ok
        self.trainers_live += live - peer.trainers_live
        peer.procs, peer.trainers, peer.trainers_ok, peer.trainers_live = procs, trainers, ok, live

    def _expect(self, peer: Peer, expected: int | None) -> None:
        """The trainers the job has, as the peer says (WORLD_SIZE); the board keeps the largest said."""
        peer.expected = expected
        if expected:
            self.expected = max(self.expected or 0, expected)

    def beat(self, msg: dict, now: float, wall: float) -> Outcome:
        """Take in one agent's beat (already authenticated as coming from msg["node"])."""
        error = beat_error(msg)
        if error:
            return Outcome({"op": "error", "error": error}, False, [])
        node, events = msg["node"], []
        peer = self.peers.get(node) or self._join(node, now)
        replaced = _part_replaced(self, peer, msg)
        if node in self.out:
            return _returning(self, peer, node, msg, now, wall)
        if peer.lost:
            peer.lost = False  # it came back; the job's status stays what it is
            events.append(Event(EventKind.PEER_BACK, node, "agent on %s beats again" % node))
        peer.seen = peer.beat_seen = now
        peer.ts, peer.fencing = wall, False
        # A field the beat leaves out did not change since the sender's last beat (protocol.beat_changes).
        if "done" in msg:
            peer.done = bool(msg["done"])
        changed = self.roster.set(node, wall, peer.done, peer.lost)
        if "trainers_expected" in msg:
            self._expect(peer, msg["trainers_expected"])
        # Process states change all the time; the board keeps counts of them, the replies carry the counts.
        if node in self.out:
            if peer.procs:
                self._count(peer, {})
        elif "procs" in msg:
            self._count(peer, spares.counted(self, node, msg["procs"] or {}))
            peer.running = _alive(msg["procs"] or {})
        peer.had_procs = peer.had_procs or bool(peer.procs)
        status = False
        started = msg.get("generation")
        if isinstance(started, int) and not isinstance(started, bool) and started > peer.generation:
            peer.generation = started
            status |= self._restarted(wall)
        status |= quorum.beat(self, peer, msg, now, wall)
        failure, final = msg.get("failure"), msg.get("final")
        if failure:
            status |= self._failure(failure, node, now, wall, events)
        elif final and final.get("status") in FINAL:
            status |= self._set_status(final["status"], _text(final.get("reason"), ""),
                                       _text(final.get("node"), node), wall)
        if replaced:  # after the beat's own failure: a cause its agent knows (an eviction) is the better word
            status |= self._failure(replaced, node, now, wall, events)
        if self.status["status"] == JobState.RUNNING and self.finished_now():
            status |= self._set_status(JobState.FINISHED, "every trainer exited with code 0", None, wall)
        if self.back:
            status |= _grow(self, now, wall, events)
        return _answer(self, peer, msg, changed or status, events, status)

    def pulse(self, node: str, now: float, fencing: bool = False) -> bool:
        """A pulse from `node` (pulse.py): it is still there. True if it is answered: not once it is lost
        or left, so its lease runs out and it fences itself, nor when it says it is fencing itself (its
        answers do not reach it: the next check_peers loses it)."""
        peer = self.peers.get(node)
        if peer is None or peer.lost or node in self.out:
            return False
        peer.seen, peer.fencing = now, fencing
        return not fencing

    def check_peers(self, now: float, wall: float, connected=()) -> list[Event]:
        """Mark lost the agents silent for peer_timeout whose connection is gone, or for hung_timeout
        while it is in `connected` (the nodes with an open connection), or whose beats have not come for
        hung_timeout while their pulses do; a lost node fails a running job."""
        events = []
        for name, p in self.peers.items():
            reason = None if p.done or p.lost else _silence(name, p, name in connected, now, self.peer_timeout)
            if reason is None:
                continue
            p.lost = True
            self.roster.set(name, wall, p.done, True)
            events.append(Event(EventKind.PEER_LOST, name, reason))
            if name not in self.out:
                self._leave(name, "node %s lost: %s" % (name, reason), now, wall, events)
            self.back.discard(name)
        if self.status["status"] == JobState.RESTARTING and self.restart_due is not None and now >= self.restart_due:
            g = self.status["generation"]
            late = sorted(n for n, p in self.peers.items() if p.had_procs and p.generation < g and n not in self.out)
            reason = ("restart to generation %d failed: node%s %s did not start %s part within %.0f s (%s)" % (
                g, "s" if len(late) > 1 else "", ", ".join(late), "their" if len(late) > 1 else "its",
                self.restart.start_deadline(g), self.status["reason"]))
            if self.restart.layout is not None and late:
                for name in late:
                    self._leave(name, "node %s did not start its part of generation %d" % (name, g), now, wall, events,
                                False)
            else:
                self._set_status(JobState.FAILED, reason, late[0] if late else None, wall)
            if self.status["status"] == JobState.FAILED:
                events.append(Event(EventKind.RESTART_FAILED, late[0] if late else None, self.status["reason"]))
        return events

    def wrong_job(self, job_id: str) -> dict:
        """The answer to another job's agent. A job that is over gives its port to a newer one."""
        if self.status["status"] in FINAL:
            self.superseded = True
        return {"op": "error", "error": "this is the coordinator of job %s, not %s" % (self.job_id, job_id)}

    # -- kept across a restart -------------------------------------------------------------------

    def saved(self, wall: float) -> dict:
        return {"job_id": self.job_id, "status": self.status, "saved": wall,
                "peers": {n: {k: v for k, v in as_dict(p).items() if k in SAVED} for n, p in self.peers.items()}}

    @classmethod
    def restore(cls, saved, job_id: str, nodes: list[str], peer_timeout: float, now: float,
                restart: RestartPolicy | None = None) -> Board | None:
        """The board a previous coordinator of this job saved, or None (another job's, or unreadable)."""
        if not isinstance(saved, dict) or saved.get("job_id") != job_id:
            return None
        return _restored(cls(job_id, nodes, peer_timeout, restart), saved, now)


def _restored(board: Board, saved: dict, now: float) -> Board:
    """`board`, new, given the status and peers of `saved`."""
    status = saved.get("status")
    if isinstance(status, dict) and status.get("status") in (JobState.RUNNING, JobState.RESTARTING) + FINAL:
        _restore_status(board, status, now)
    peers = saved.get("peers")
    for name, p in (peers if isinstance(peers, dict) else {}).items():
        if isinstance(p, dict):
            _restore_peer(board, name, p, now)
    return board


def _restore_status(board: Board, status: dict, now: float) -> None:
    """The job's status of a saved board, into the restored `board`."""
    board.status.update({k: status.get(k) for k in ("status", "reason", "node", "ts")})
    g = status.get("generation")
    board.status["generation"] = g if isinstance(g, int) and not isinstance(g, bool) and g >= 0 else 0
    board.status["restarts_left"] = board.restart.restarts_left(board.status["generation"])
    board.status["backoff"] = status.get("backoff")
    out = status.get("out")
    board.out = frozenset(n for n in out if isinstance(n, str)) if isinstance(out, list) else frozenset()
    stand_in = status.get("stand_in")
    board.stand_in = {s: n for s, n in stand_in.items() if isinstance(s, str) and isinstance(n, str)} \
        if isinstance(stand_in, dict) else {}
    if board.out and board.restart.layout is not None:  # out, world_size, stand_in: as the board says them
        board.status.update(_extras(board, JobState.RUNNING, -1))
    if board.status["status"] == JobState.RESTARTING:  # a fresh deadline, as peers get a fresh peer_timeout
        board.restart_due = now + board.restart.start_deadline(board.status["generation"])
        resume = status.get("resume_from")
        if isinstance(resume, dict) and resume.get("generation") == board.status["generation"]:
            board.resume = board.status["resume_from"] = resume


def _restore_peer(board: Board, name: str, p: dict, now: float) -> None:
    """One peer of a saved board (SAVED), into the restored `board`."""
    # A restarted coordinator gives every known peer a fresh peer_timeout.
    procs = p.get("procs") if isinstance(p.get("procs"), dict) else {}
    peer = board._join(name, now)
    peer.ts, peer.done, peer.lost = p.get("ts"), bool(p.get("done")), bool(p.get("lost"))
    board._expect(peer, p.get("expected") if isinstance(p.get("expected"), int) else None)
    board._count(peer, {k: v for k, v in procs.items() if isinstance(v, dict)})
    peer.had_procs = bool(p.get("had_procs"))
    peer.generation = p.get("generation") if isinstance(p.get("generation"), int) else 0
    peer.part = p.get("part") if isinstance(p.get("part"), str) else None
    board.roster.set(name, peer.ts, peer.done, peer.lost)


def _answer(board: Board, peer: Peer, msg: dict, changed: bool, events: list, status: bool) -> Outcome:
    """The reply to `peer`'s beat `msg`: the status line, the ack, and the roster it lacks."""
    if "roster" in msg:
        peer.roster = msg["roster"]
    seq = msg.get("seq")
    extra = {"ack": seq}
    roster = board.roster.since(peer.roster)
    if roster is not None:
        extra["roster"] = roster
    # The reply to nearly every beat is the status line and the ack: that one written directly.
    tail = b'"ack":%d}' % seq if roster is None and type(seq) is int else compact(extra)[1:].encode()
    line, line_json = board.encoded_status()
    return Outcome({**line, **extra}, changed, events, status, line_json[:-1] + b"," + tail)


def _part_replaced(board: Board, peer: Peer, msg: dict) -> dict | None:
    """The failure of the node's part of the running generation when `msg` comes from a part started again
    there (a pod replacing an evicted one on a fresh workspace, whose agent was killed before it could say
    so), or None. Its agent was heard going on, so no silence will lose it: the new part's agent beats
    within peer_timeout, with new programs in a world that lost the old ones. The peer takes the new part."""
    part = msg.get("part")
    if not isinstance(part, str):
        return None
    earlier, peer.part = peer.part, part
    g = board.status["generation"]
    if earlier is None or earlier == part or board.status["status"] != JobState.RUNNING or peer.done \
            or not peer.had_procs or peer.generation != g:
        return None
    return {"kind": FailureKind.LOST, "generation": g, "before": True,
            "reason": "node %s lost: its part was started again while generation %d ran there (its programs are "
                      "new, the old ones gone)" % (msg["node"], g)}


def _alive(procs: dict) -> int:
    return sum(1 for p in procs.values() if p.get("state") in LIVE)


def _returning(board: Board, peer: Peer, node: str, msg: dict, now: float, wall: float) -> Outcome:
    """A beat from a node that left the job. Fenced (it counts for nothing) once it left more than max_rejoins
    times; else it is heard again, and with nothing of the job left there it is back: the next generation takes
    it in (_grow). Its old processes are gone by its own word, and that generation has a rendezvous of its own."""
    if board.restart.layout is None or not board.departed.may_rejoin(node):
        return _fenced(board, peer, node, msg, now, wall)
    events = []
    if peer.lost:
        peer.lost = False
        events.append(Event(EventKind.PEER_BACK, node, "agent on %s beats again (it left the job)" % node))
    peer.seen = peer.beat_seen = now
    peer.ts, peer.fencing = wall, False
    if "done" in msg:
        peer.done = bool(msg["done"])
    if "procs" in msg:
        peer.running = _alive(msg["procs"] or {})
    changed = board.roster.set(node, wall, peer.done, peer.lost)
    if not peer.running and board.status["status"] not in FINAL and not spares.came_back(board, node):
        board.back.add(node)
    status = _grow(board, now, wall, events) if board.back else False
    return _answer(board, peer, msg, changed or status, events, status)


def _fenced(board: Board, peer: Peer, node: str, msg: dict, now: float, wall: float) -> Outcome:
    """A beat from a node that left the job: it counts for nothing (no failure, no process, no
    generation), and the answer tells its agent it is fenced out for good, so it stops and ends."""
    peer.seen = peer.beat_seen = now
    peer.ts = wall
    if "done" in msg:
        peer.done = bool(msg["done"])
    board.roster.set(node, wall, peer.done, peer.lost)
    g = board.status["generation"]
    reply, first = board.departed.refusal(board.job_id, node, g, msg.get("seq"))
    return Outcome(reply, False, [Event(EventKind.FENCED, node, first, {"generation": g})] if first else [])


def _grow(board: Board, now: float, wall: float, events: list) -> bool:
    """The nodes back (board.back) into the next generation: the one that has not started yet (more than a
    second before its start), else a new one once the job runs (a restart on the larger world, after one
    restart_backoff, counted against max_restarts). None while a generation starts, or no restart is left."""
    st, layout = board.status, board.restart.layout
    ready = sorted(n for n in board.back if n in board.out and not board.peers[n].lost and not board.peers[n].running
                   and n not in board.stand_in.values())  # a node whose slot a spare holds stays out, idle
    if not ready or st["status"] in FINAL:
        return False
    waiting = st["status"] == JobState.RESTARTING and board.restart_start is not None and now < board.restart_start - 1.0
    if st["status"] == JobState.RESTARTING and not waiting:
        return False  # the generation about to start runs without them; the next one takes them (once it runs)
    if not waiting and not board.restart.decide({"kind": REJOIN}, st["generation"]).restart:
        return False  # no restart left to take them in: they stay out, idle
    board.out, board.back = board.out - set(ready), board.back - set(ready)
    for n in ready:
        board.peers[n].had_procs = True  # it must start its part of the generation, as every other node
    g, world = st["generation"] + (not waiting), layout.world_size(board.out, board.stand_in)

    def back(names) -> str:
        return "%s back in generation %d (WORLD_SIZE %d)" % (", ".join(names), g, world)

    board.joining = (g, back(ready))

    if waiting:
        changed = board._set_status(JobState.RESTARTING, st["reason"], st["node"], wall, g,
                                    round(board.restart_start - now, 3))
    else:
        changed = board._decide({"kind": REJOIN}, back(ready), ready[0], now, wall)
    fields = {"generation": g, "world_size": world, "nodes": layout.nodes_left(board.out, board.stand_in)}
    events += [Event(EventKind.NODE_BACK, n, back([n]), fields) for n in ready]
    return changed


def _extras(board: Board, status: str, g: int) -> dict:
    """What a status of generation g says beyond its fields: the nodes that left (min_nodes: each agent starts
    its part without them), and while it restarts, the checkpoint it falls back to (on_bad_checkpoint previous:
    each agent's FABTRAIN_RESUME_FROM)."""
    extras = {}
    if board.out:
        extras.update(out=sorted(board.out), world_size=board.restart.layout.world_size(board.out, board.stand_in))
    if board.stand_in:  # the spares in the slots of nodes that left: each agent renumbers with them
        extras["stand_in"] = dict(board.stand_in)
    if status == JobState.RESTARTING and board.resume is not None and board.resume.get("generation") == g:
        extras["resume_from"] = board.resume
    if board.joining and board.joining[0] == g:  # the nodes it took back (min_nodes): not a failure
        extras["back"] = board.joining[1]
    return {**extras, **quorum.hold(board, status, g)}


def _node_left(node: str, left: str, generation: int, layout, out: frozenset, stand_in: dict) -> Event:
    """The event of `node` leaving the job (`left`: that it left, and why) while `generation` starts without it."""
    world, n = layout.world_size(out, stand_in), layout.nodes_left(out, stand_in)
    spares = "".join(", %s (spare) in %s's place" % (s, slot) for s, slot in sorted(stand_in.items()))
    return Event(EventKind.NODE_LEFT, node, "%s; generation %d runs on %d of %d nodes without %s%s (WORLD_SIZE %d)"
                 % (left, generation, n, len(layout.trainer_nodes), ", ".join(sorted(out)), spares, world),
                 {"world_size": world, "nodes_left": n, "generation": generation})


SAVED = ("ts", "done", "lost", "procs", "expected", "had_procs", "generation", "part")  # what a restored board needs of a peer
