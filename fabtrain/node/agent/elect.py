"""The agent's side of a majority election (coordination/election.py's rules, ballot.py's votes), wired.

Only a job that elects (`Layout.elects`: `min_nodes` set, three or more
nodes, every one a trainer node) runs this; every other job's agents never
load it. Each agent of such a job runs:

- a ballot box (`ballot.Box`) on its node's address, at the coordinator's
  port + 1 (UDP), sharing its `Voter` with the link: every coordinator
  line is `heard` (its term and its coordinator's name are stamped on it,
  server.py), and a line of an older term is dropped, never followed;
- a thread that, once this agent has heard a coordinator and that
  coordinator has been silent for lease + MARGIN (`may_stand`), waits
  `candidacy_delay` (`stagger` for each node before it in the cluster file)
  and stands: it votes for itself (saved first), asks the others
  (`ballot.ask`) and, with a strict majority (`tally`), hosts the
  coordinator of the new term on its own address at the coordinator's port
  (`Link.host_elected`, succession.take_over's board);
- following: the link's client points at the coordinator of its term, or,
  before its first line, at the candidate this node voted for; a candidate
  refused by a voter that follows a newer term's coordinator takes up that
  term and follows it (`Voter.learn`): a healed old coordinator's node comes
  back that way.
"""
from __future__ import annotations

import os
import threading
import time

from fabtrain.contract.events import EventKind
from fabtrain.node.coordination import ballot
from fabtrain.node.coordination.election import Known, TermFile, TermState, Voter, candidacy_delay, majority, \
    may_stand, tally

STAGGER = 1.0  # seconds a node waits for each node before it in the cluster file (candidacy_delay)
ASK_AGAIN = 0.5  # seconds after a pre-vote that found no majority before the next: it raised and saved nothing
TERM_FILE = "term.json"  # in the agent's job folder: the newest term, whom this agent voted for, who coordinates


def ballot_port(port: int) -> int:
    """The ballot box's UDP port: the coordinator's + 1 (the coordinator's own UDP port carries pulses)."""
    return port + 1


def known_of(msg: dict) -> Known | None:
    """What a status line says of the job (a vote carries it), or None for another line."""
    if msg.get("op") != "status":
        return None
    g, out, left = msg.get("generation"), msg.get("out"), msg.get("restarts_left")
    return Known(g if type(g) is int else 0, tuple(sorted(n for n in out if isinstance(n, str)))
                 if isinstance(out, list) else (), left if type(left) is int else 0)


class Elector(threading.Thread):
    def __init__(self, link, job: dict, job_dir: str, lease: float):
        super().__init__(name="elector", daemon=True)
        self.link, self.me, self.lease = link, job["node"], lease
        self.nodes = tuple(n["name"] for n in job["nodes"])
        self.addresses = {n["name"]: n["address"] for n in job["nodes"]}
        self.file = TermFile(os.path.join(job_dir, TERM_FILE))
        state = self.file.load()
        if not state.term:  # the start: term 1, nodes[0] coordinates
            state = TermState(1, None, self.nodes[0])
        # Its last promise was in memory: no vote for anyone else for lease + MARGIN from this start.
        self.voter = Voter(self.me, self.nodes, state, lease, started=time.monotonic())
        self.lock = threading.Lock()
        self.contacted = False  # heard a coordinator's stamped line: only then may this node stand
        self.due: float | None = None  # when this node stands, once it may
        self.rest_until = 0.0  # after a candidacy that did not win: no other before this (the lease)
        self.box = ballot.Box(link.job_id, link.secret, self.addresses[self.me], ballot_port(link.port), self.voter,
                              self.file, self.lock)
        self._stopping = threading.Event()

    @property
    def term(self) -> int:
        return self.voter.state.term

    def heard(self, msg: dict) -> bool:
        """A line from the link's coordinator: False if it is of an older term (dropped: not followed)."""
        term, by = msg.get("term"), msg.get("by")
        if type(term) is not int or not isinstance(by, str):
            return True  # unstamped (an error line before any channel): nothing to follow
        with self.lock:
            ok = self.voter.heard(term, by, time.monotonic(), known_of(msg))
            self._save()
        self.contacted = self.contacted or ok
        return ok

    def _save(self) -> None:
        if self.voter.changed:
            self.file.save(self.voter.state)
            self.voter.changed = False

    def start(self) -> None:
        self.box.start()
        super().start()

    def stop(self) -> None:
        self._stopping.set()
        self.box.stop()

    def run(self) -> None:
        while not self._stopping.wait(0.2):
            try:
                self.tick(time.monotonic())
            except Exception as e:  # noqa: BLE001 - the agent goes on; the event says why
                self.link.on_event(EventKind.AGENT_ERROR, reason="election: %s: %s" % (type(e).__name__, e))

    def tick(self, now: float) -> None:
        with self.lock:
            st = self.voter.state
            target = st.coordinator or (st.voted_for if st.voted_for != self.me else None)
            stand = self.contacted and may_stand(self.voter, now)
        if target is not None and target != self.me:
            self.link.follow(target, self.addresses[target])
        if not stand or self.link.hosting():
            self.due = None
            return
        if self.due is None:
            self.due = now + candidacy_delay(self.nodes, self.me, set(self.nodes) - {self.me}, STAGGER)
            return
        if now >= self.due and now >= self.rest_until:
            self.due = None
            # After a candidacy, none other for the lease: two candidates at once split each term's votes. A
            # pre-vote that found no majority raised and saved nothing anywhere: ask again soon, so that a node
            # cut off and healed (an old coordinator's) learns its coordinator within about a second of the heal.
            self.rest_until = time.monotonic() + (self.lease if self.stand() else ASK_AGAIN)

    def learned(self, ballots) -> bool:
        """Whether a refusal told this node of a newer term and its coordinator (a healed old coordinator's node,
        say): it takes up that term, and `tick` points its link at that coordinator, which takes it back
        into a later generation (`node_back`) or fences it out for good, as any node that left."""
        with self.lock:
            coordinator = self.voter.learn(ballots, time.monotonic())
            self._save()
        if coordinator is not None:
            self.link.on_event(EventKind.COORDINATOR, reason="%s learned from a refused vote: coordinator %s (term %d)"
                               % (self.me, coordinator, self.term), term=self.term)
        return coordinator is not None

    def stand(self) -> bool:
        """Ask for a strict majority's votes in the next term; host the coordinator if they are given. First
        whether they would be (a pre-vote, nothing saved anywhere): a node cut off raises no term, so once
        healed it follows its coordinator's lines again (a line of an older term is not followed). Returns
        whether it stood for a term (False: the pre-vote found no majority, or taught it a coordinator)."""
        others = {n: (self.addresses[n], ballot_port(self.link.port)) for n in self.nodes if n != self.me}
        enough = majority(len(self.nodes)) - 1
        with self.lock:
            term, known = self.voter.state.term + 1, self.voter.known
        would = ballot.ask(self.link.job_id, self.link.secret, self.me, term, known, others, timeout=1.0,
                           enough=enough, pre=True)
        if self.learned(would) or sum(1 for b in would if b.granted and b.term == term) < enough:
            return False
        asked = time.monotonic()
        with self.lock:
            previous = self.voter.state.coordinator
            term = self.voter.state.term + 1
            own = self.voter.request(self.me, term, self.voter.known, asked)
            self._save()
            known = self.voter.known
        if not own.granted:
            return True
        ballots = ballot.ask(self.link.job_id, self.link.secret, self.me, term, known, others, timeout=1.0,
                             enough=enough)
        won = tally(self.nodes, self.me, term, list(ballots) + [own])
        if won is None:
            self.learned(ballots)
            return True
        with self.lock:
            if self.voter.state.term != term:
                return True  # a newer term came meanwhile
            self.voter.heard(term, self.me, time.monotonic())
            self._save()
        self.link.host_elected(won, previous, asked, self.lease)
        return True
