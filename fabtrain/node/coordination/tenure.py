"""A coordinator's term, for a job that elects (Layout.elects): its lines stamped, its lease kept from the
beats' echoes, its stepping down (election.py's `Lease`, wired into server.py).

Every line the coordinator sends carries its term, its node (`by`) and its
monotonic time (`t`); every beat of an agent of such a job carries the term
it follows and echoes the newest `t` it received (`echo`). The coordinator
holds its term while `Lease.holds`: a strict majority, itself included,
echoed within `lease` a line it sent. It checks that before it takes any
beat and every half interval; once it does not hold, it steps down: it
stops answering and closing every connection, and its agent fences its node
at once (`stepped_down` is the fence's reason, agent/policy.py). The first
term's coordinator (nodes[0] at the start) begins to count once a majority
has echoed a line of its (the agents start one after another); an elected
one counts its voters from the moment it asked for their votes.
"""
from __future__ import annotations

import time

from fabtrain.contract.events import EventKind
from fabtrain.contract.states import FINAL

from .election import Lease, majority


class Tenure:
    def __init__(self, me: str, lease: Lease):
        self.me, self.lease, self.term = me, lease, lease.term
        self.terms: dict = {}  # node -> the term its beats named last (a beat names it only when it changed)
        self.stepped_down: str | None = None

    def stamp(self, msg: dict) -> dict:
        return dict(msg, term=self.term, by=self.me, t=round(time.monotonic(), 6))

    def beat(self, msg: dict) -> None:
        """A beat's echo renews its node for the lease; a newer term named makes this coordinator step down."""
        node = msg.get("node")
        if type(msg.get("term")) is int:
            self.terms[node] = msg["term"]
        echo = msg.get("echo")
        term = self.terms.get(node, self.term)
        if isinstance(echo, (int, float)) and not isinstance(echo, bool):
            self.lease.beat(node, term, float(echo))
        elif term > self.term:
            self.lease.beat(node, term, float("-inf"))

    def armed(self) -> bool:
        return len(self.lease.heard) >= majority(len(self.lease.nodes))

    def holds(self, now: float) -> bool:
        """False once it stepped down; it steps down here when its lease does not hold (without a board: tests)."""
        return self.check(None, now, 0.0)[0]

    def check(self, board, now: float, wall: float) -> tuple[bool, list]:
        """(whether it still coordinates, the board's events). Its lease not held, and no newer term named:
        a board that ended the job keeps saying so (it starts nothing); where no successor could go on
        without this node either (`no_successor`), the board first loses the nodes it has not heard within
        the lease, which ends the job as it would without an election (`fewer than min_nodes`); else it
        steps down."""
        if self.stepped_down is not None:
            return False, []
        lease, events = self.lease, []
        if lease.superseded is None:
            if not self.armed() or lease.holds(now):
                return True, []
            if board is not None and board.status["status"] not in FINAL and no_successor(board, self.me):
                for node in sorted(unheard(lease, board, now)):
                    board._leave(node, "node %s lost: it answered no line of the coordinator for %.1f s (its lease)"
                                 % (node, lease.lease), now, wall, events)
            if board is not None and board.status["status"] in FINAL:
                return True, events
        self.stepped_down = lease.why_not(now)
        return False, events


def unheard(lease: Lease, board, now: float) -> list:
    return [n for n in lease.nodes if n != lease.me and n not in board.out
            and now - lease.heard.get(n, float("-inf")) >= lease.lease]


def no_successor(board, me: str) -> bool:
    """No coordinator elected without `me` could go on: the nodes left without it (and those out) are fewer
    than min_nodes (its successor's board leaves it out, and knows no fewer nodes out)."""
    layout = board.restart.layout
    return layout is not None and len(layout.world(board.out | {me}, board.stand_in)) < layout.min_nodes


def held(co, msg: dict | None = None) -> bool:
    """Whether coordinator `co` (server.py, its lock held) still coordinates, a beat `msg` taken first; where
    its lease's check ended the job, the board saved, its events written, every agent told next."""
    if msg is not None:
        co.tenure.beat(msg)
    ok, events = co.tenure.check(co.board, time.monotonic(), time.time())
    if events:
        co._save()
        co._emit(events)
        co._pending_broadcast = True
    return ok


def keeps(co) -> bool:
    """`held`, from the coordinator's loop; False: it steps down now (its `coordinator` event says why)."""
    with co.lock:
        ok = held(co)
    if not ok:
        co.on_event(EventKind.COORDINATOR, reason=co.tenure.stepped_down, term=co.tenure.term)
    return ok
