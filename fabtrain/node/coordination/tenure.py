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
        """False once it stepped down; it steps down here when its lease does not hold."""
        if self.stepped_down is not None:
            return False
        if not self.armed() and self.lease.superseded is None:
            return True
        if self.lease.holds(now):
            return True
        self.stepped_down = self.lease.why_not(now)
        return False
