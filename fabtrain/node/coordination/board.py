"""The job's shared state, as a table: who beat when, the job's status, what to do about it.

Pure: no sockets, no threads, no clock of its own (every call is told `now`,
monotonic seconds, and `wall`, epoch seconds), no files (`saved()` and
`Board.restore` give and take plain data). The coordinator's server feeds it
authenticated beats and the passing of time, and carries out what it returns:
a reply, whether to push the new status to every agent, and events to write.

The job's status only moves from running to failed or finished, never back;
the first failure wins. A peer silent for `peer_timeout` that did not say it
was done is lost, and a lost node fails a running job. Under `on_failure:
restart` (restart.py decides) a failure of the current generation moves it to
``restarting`` instead, with the next generation's number: every agent tears
down, waits the backoff and starts its part again; once every node that ran
processes has said so the status is ``running`` again, and if one has not
within the restart's deadline the job fails naming it. A failure of an older
generation (an agent that has not heard yet) changes nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from fabtrain.node.states import FINAL, LIVE, JobState, ProcessState

from .restart import RestartPolicy

MAX_PROCS = 4096  # processes one node may report; a real node has a handful


class Event(NamedTuple):
    """Something the hosting agent writes to events.jsonl."""
    kind: str
    node: str | None
    reason: str


class Outcome(NamedTuple):
    """What to do with one beat: the reply to its sender, push the status to everyone?, events."""
    reply: dict
    changed: bool
    events: list


@dataclass
class Peer:
    seen: float  # monotonic, of the last beat
    ts: float | None = None  # epoch, of the last beat
    done: bool = False  # nothing of the job is left on that node: it may go quiet
    lost: bool = False
    procs: dict = field(default_factory=dict)
    expected: int | None = None  # trainers the job has (WORLD_SIZE), if the node knows
    had_procs: bool = False  # it has run job processes: it must start its part of every generation
    generation: int = 0  # the last generation it said it started


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


def _text(value, default: str) -> str:
    return value if isinstance(value, str) else default


class Board:
    def __init__(self, job_id: str, nodes: list[str], peer_timeout: float, restart: RestartPolicy | None = None):
        self.job_id = job_id
        self.nodes = list(nodes)
        self.peer_timeout = peer_timeout
        self.restart = restart or RestartPolicy.never()
        self.status: dict = {"status": JobState.RUNNING, "reason": None, "node": None, "ts": None, "generation": 0,
                             "restarts_left": self.restart.restarts_left(0), "backoff": None}
        self.restart_due: float | None = None  # monotonic: every node's part of the generation started by then
        self.peers: dict[str, Peer] = {}
        self.superseded = False  # a newer job asked for this port while ours is over

    # -- what it says -------------------------------------------------------------------------

    def view(self) -> dict:
        """The status line as every agent gets it."""
        trainers_running = sum(1 for p in self.peers.values() for proc in p.procs.values()
                               if proc.get("role") == "trainer" and proc.get("state") in LIVE)
        return {"op": "status", "job_id": self.job_id, **self.status,
                "peers": {n: p.ts for n, p in self.peers.items()},
                "done": sorted(n for n, p in self.peers.items() if p.done),
                "lost": sorted(n for n, p in self.peers.items() if p.lost),
                "nodes_seen": len(self.peers), "trainers_running": trainers_running}

    def finished_now(self) -> bool:
        """Every trainer of the job has exited with code 0, and every trainer is accounted for."""
        trainers, expected = {}, None
        for p in self.peers.values():
            if p.expected:
                expected = max(expected or 0, p.expected)
            trainers.update((name, proc) for name, proc in p.procs.items() if proc.get("role") == "trainer")
        if not trainers or any(t.get("state") != ProcessState.EXITED or t.get("exit_code") != 0 for t in trainers.values()):
            return False
        return self.every_node_spoke() or (expected is not None and len(trainers) >= expected)

    def every_node_spoke(self) -> bool:
        return set(self.nodes) <= set(self.peers)

    def all_peers_settled(self) -> bool:
        """Every agent that ever spoke is done or lost: nobody needs the coordinator any more."""
        return all(p.done or p.lost for p in self.peers.values())

    def knows(self, node: str) -> bool:
        """Whether `node` is one of the job's nodes (any node, for a board that was given none)."""
        return not self.nodes or node in self.nodes

    # -- what changes it ------------------------------------------------------------------------

    def _set_status(self, status: str, reason: str | None, node: str | None, wall: float, generation: int | None = None,
                    backoff: float | None = None) -> bool:
        if self.status["status"] in FINAL:
            return False
        g = self.status["generation"] if generation is None else generation
        self.status = {"status": status, "reason": reason, "node": node, "ts": wall, "generation": g,
                       "restarts_left": self.restart.restarts_left(g), "backoff": backoff}
        if status != JobState.RESTARTING:
            self.restart_due = None
        return True

    def _failure(self, failure: dict, node: str, now: float, wall: float) -> bool:
        """A failure an agent reported: restart the job (a new generation) or fail it."""
        generation = self.status["generation"]
        if failure.get("generation", 0) != generation:
            return False  # of an older generation, already acted on (or of one this board never started)
        reason = _text(failure.get("reason"), "failed") or "failed"
        decision = self.restart.decide(failure, generation)
        if not decision.restart:
            return self._set_status(JobState.FAILED, reason + ("; not restarted: %s" % decision.why_not
                                                        if decision.why_not else ""), node, wall)
        for p in self.peers.values():
            p.had_procs = p.had_procs or bool(p.procs)
        changed = self._set_status(JobState.RESTARTING, reason, node, wall, decision.generation, decision.backoff)
        self.restart_due = now + self.restart.start_deadline(decision.generation)
        return changed

    def _restarted(self, wall: float) -> bool:
        """Every node that runs processes has started its part of the new generation: running again."""
        g = self.status["generation"]
        if self.status["status"] != JobState.RESTARTING or \
                any(p.had_procs and p.generation < g for p in self.peers.values()):
            return False
        return self._set_status(JobState.RUNNING, None, None, wall)

    def beat(self, msg: dict, now: float, wall: float) -> Outcome:
        """Take in one agent's beat (already authenticated as coming from msg["node"])."""
        error = beat_error(msg)
        if error:
            return Outcome({"op": "error", "error": error}, False, [])
        node, events = msg["node"], []
        peer = self.peers.get(node)
        changed = peer is None
        if peer is None:
            peer = self.peers[node] = Peer(seen=now)
        if peer.lost:
            peer.lost, changed = False, True  # it came back; the job's status stays what it is
            events.append(Event("peer_back", node, "agent on %s beats again" % node))
        peer.seen, peer.ts = now, wall
        changed |= peer.done != bool(msg.get("done"))
        peer.done = bool(msg.get("done"))
        # Process states change all the time; they travel with each reply, not in broadcasts.
        peer.procs = msg.get("procs") or {}
        peer.expected = msg.get("trainers_expected")
        peer.had_procs = peer.had_procs or bool(peer.procs)
        started = msg.get("generation")
        if isinstance(started, int) and not isinstance(started, bool) and started > peer.generation:
            peer.generation = started
            changed |= self._restarted(wall)
        failure, final = msg.get("failure"), msg.get("final")
        if failure:
            changed |= self._failure(failure, node, now, wall)
        elif final and final.get("status") in FINAL:
            changed |= self._set_status(final["status"], _text(final.get("reason"), ""),
                                        _text(final.get("node"), node), wall)
        if self.status["status"] == JobState.RUNNING and self.finished_now():
            changed |= self._set_status(JobState.FINISHED, "every trainer exited with code 0", None, wall)
        return Outcome(dict(self.view(), ack=msg.get("seq")), changed, events)

    def check_peers(self, now: float, wall: float) -> list[Event]:
        """Mark agents silent for peer_timeout lost (a lost node fails a running job); the events."""
        events = []
        for name, p in self.peers.items():
            if p.done or p.lost or now - p.seen < self.peer_timeout:
                continue
            p.lost = True
            reason = "no heartbeat from the agent on %s for %.0f s (peer_timeout %.0f s)" % (
                name, now - p.seen, self.peer_timeout)
            events.append(Event("peer_lost", name, reason))
            self._set_status(JobState.FAILED, "node %s lost: %s" % (name, reason), name, wall)
        if self.status["status"] == JobState.RESTARTING and self.restart_due is not None and now >= self.restart_due:
            g = self.status["generation"]
            late = sorted(n for n, p in self.peers.items() if p.had_procs and p.generation < g)
            reason = ("restart to generation %d failed: node%s %s did not start %s part within %.0f s (%s)" % (
                g, "s" if len(late) > 1 else "", ", ".join(late), "their" if len(late) > 1 else "its",
                self.restart.start_deadline(g), self.status["reason"]))
            self._set_status(JobState.FAILED, reason, late[0] if late else None, wall)
            events.append(Event("restart_failed", late[0] if late else None, reason))
        return events

    def wrong_job(self, job_id: str) -> dict:
        """The answer to another job's agent. A job that is over gives its port to a newer one."""
        if self.status["status"] in FINAL:
            self.superseded = True
        return {"op": "error", "error": "this is the coordinator of job %s, not %s" % (self.job_id, job_id)}

    # -- kept across a restart -------------------------------------------------------------------

    def saved(self, wall: float) -> dict:
        return {"job_id": self.job_id, "status": self.status, "saved": wall,
                "peers": {n: {k: v for k, v in asdict(p).items() if k != "seen"} for n, p in self.peers.items()}}

    @classmethod
    def restore(cls, saved, job_id: str, nodes: list[str], peer_timeout: float, now: float,
                restart: RestartPolicy | None = None) -> Board | None:
        """The board a previous coordinator of this job saved, or None (another job's, or unreadable)."""
        if not isinstance(saved, dict) or saved.get("job_id") != job_id:
            return None
        board = cls(job_id, nodes, peer_timeout, restart)
        status = saved.get("status")
        if isinstance(status, dict) and status.get("status") in (JobState.RUNNING, JobState.RESTARTING) + FINAL:
            board.status.update({k: status.get(k) for k in ("status", "reason", "node", "ts")})
            g = status.get("generation")
            board.status["generation"] = g if isinstance(g, int) and not isinstance(g, bool) and g >= 0 else 0
            board.status["restarts_left"] = board.restart.restarts_left(board.status["generation"])
            board.status["backoff"] = status.get("backoff")
            if board.status["status"] == JobState.RESTARTING:  # a fresh deadline, as peers get a fresh peer_timeout
                board.restart_due = now + board.restart.start_deadline(board.status["generation"])
        peers = saved.get("peers")
        for name, p in (peers if isinstance(peers, dict) else {}).items():
            if not isinstance(p, dict):
                continue
            # A restarted coordinator gives every known peer a fresh peer_timeout.
            procs = p.get("procs") if isinstance(p.get("procs"), dict) else {}
            board.peers[name] = Peer(seen=now, ts=p.get("ts"), done=bool(p.get("done")), lost=bool(p.get("lost")),
                                     procs={k: v for k, v in procs.items() if isinstance(v, dict)},
                                     expected=p.get("expected") if isinstance(p.get("expected"), int) else None,
                                     had_procs=bool(p.get("had_procs")),
                                     generation=p.get("generation") if isinstance(p.get("generation"), int) else 0)
        return board
