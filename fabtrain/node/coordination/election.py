"""Who coordinates, by majority (min_nodes, three or more trainer nodes), pure: terms, votes, the lease.

Wired by agent/elect.py and tenure.py for a job that elects (docs/partitions.md,
"Majority election"): the rules below are the part a moving coordinator needs, each checked without a
process by tests/unit/test_election.py. No sockets, no threads, no clock of
its own (every call is told `now`, monotonic seconds); the one file it
writes is the term record, through `TermFile` (fsync'ed before a vote is
answered).

- **Terms.** Coordination is numbered by terms (1, 2, ...). Each agent keeps
  the newest term it knows and whom it voted for in it, on disk in its job
  folder, and votes **at most once a term**. An agent started again over a
  term record votes for nobody else for `lease + MARGIN` (its last promise
  was in memory).
- **Majority.** A candidate becomes the coordinator of term t only with
  votes for t from a strict majority of the job's trainer nodes (its own
  included): two coordinators of one term would need two majorities that
  share no node.
- **The lease.** A coordinator keeps its term while a majority (itself
  included) has answered, within `lease`, a line it sent (a beat counts
  from the send time of the line it echoes); the agent of a node that has
  not heard a majority within `lease` steps down and fences its node. A voter refuses
  to vote while the last line it had from a coordinator is younger than
  `lease + MARGIN`, so a successor's majority, which shares a node with any
  majority the old coordinator counts, is formed only after the old one has
  stepped down (the proof is in docs/partitions.md).
- **The numbering goes on.** A vote carries what the voter last knew of the
  job (generation, the nodes out, restarts left); a voter refuses a
  candidate that knows an older generation than its own, and the winner
  continues from the newest its majority knew, its first generation one
  past it: the old coordinator's generation is over. A coordinator lets a
  generation start only once a majority knows it (`may_start`), so no
  successor can number one of its own the same.
- **Candidates by node order.** The lowest-indexed node a candidate still
  hears from goes first; each node before it in the cluster file that it
  still hears from adds `stagger` seconds, so one election usually settles
  it.
"""
from __future__ import annotations

import os

from fabtrain.node import atomic
from fabtrain.node.structs import record

MARGIN = 1.0  # seconds on top of the lease before a voter takes a new candidate (clock rates: ppm, docs)


def majority(nodes: int) -> int:
    """Votes a strict majority of `nodes` is (2 of 3, 3 of 4, 3 of 5)."""
    return nodes // 2 + 1


def no_majority(first: str, nodes: int) -> str | None:
    """Why a job of `nodes` nodes cannot go on without `first`, or None (3 and more); Layout.without_first's words."""
    if nodes >= 3:
        return None
    return "%d of %d nodes is no majority: the other cannot tell %s gone from itself cut off" % (
        nodes - 1, nodes, first)


@record
class Known:
    """What a voter last knew of the job; the winner's board continues from the newest of its majority's."""
    generation: int = 0
    out: tuple = ()  # the nodes out of the job (min_nodes), sorted
    restarts_left: int = 0


@record(frozen=False)
class TermState:
    """The persisted part: the newest term this agent knows, whom it voted for there, who coordinates it."""
    term: int = 0
    voted_for: str | None = None
    coordinator: str | None = None


class TermFile:
    """The term record in the agent's job folder: read once at the agent's start, written (fsync, rename)
    before any vote or term is answered or used, so a restarted agent never votes twice in one term."""

    def __init__(self, path: str):
        self.path = path

    def load(self) -> TermState:
        data = atomic.read_json(self.path, {})
        if not isinstance(data, dict):
            return TermState()
        term = data.get("term")
        term = term if isinstance(term, int) and not isinstance(term, bool) and term >= 0 else 0
        voted, coord = data.get("voted_for"), data.get("coordinator")
        return TermState(term, voted if isinstance(voted, str) else None, coord if isinstance(coord, str) else None)

    def save(self, state: TermState) -> None:
        atomic.write_json(self.path, {"term": state.term, "voted_for": state.voted_for,
                                      "coordinator": state.coordinator}, durable=True)
        _sync_dir(os.path.dirname(self.path) or ".")


def _sync_dir(path: str) -> None:
    """The rename on disk too (a machine that crashes after the vote went out still holds it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@record
class Ballot:
    """A vote's answer: granted (with what the voter knew) or refused (and why)."""
    voter: str
    term: int
    granted: bool
    known: Known = Known()
    why: str = ""
    coordinator: str | None = None  # a refusal: the coordinator the voter follows in `term` (`Voter.learn`)
    # A vote: the moment (the candidate's monotonic clock) by which the voter last heard a coordinator's line,
    # None if it cannot say (ballot.py: its `quiet` taken from the answer's arrival, so never earlier than it was)
    heard_at: float | None = None


class Voter:
    """One agent's side of the votes. `heard` on every line from a coordinator; `request` on a candidate's.
    `changed` after either: the state must be saved (TermFile.save) before the answer goes out."""

    def __init__(self, node: str, nodes: tuple, state: TermState, lease: float, known: Known = Known(),
                 started: float | None = None):
        """`started`: when this agent started (monotonic), where it may have promised before (a term record
        read back): its last promise is not on disk, so it counts as given at the start, and this voter
        votes for nobody else for lease + MARGIN."""
        self.node, self.nodes, self.state, self.lease = node, tuple(nodes), state, lease
        self.known = known
        self.last_contact: float | None = None  # monotonic: the last line from `holder`, or the vote given it
        # monotonic: the last line from any coordinator; an agent started again may have heard one until its start
        self.coordinator_heard: float | None = started
        self.holder: str | None = None  # the coordinator heard last, or the candidate voted for last
        if started is not None and state.term:
            self.last_contact, self.holder = started, state.coordinator or state.voted_for
        self.changed = False

    def holds_lease(self, now: float) -> bool:
        """A coordinator was heard within lease + MARGIN: no vote for anyone else yet."""
        return self.last_contact is not None and now - self.last_contact < self.lease + MARGIN

    def heard(self, term: int, coordinator: str, now: float, known: Known | None = None) -> bool:
        """A line from `coordinator` of `term`. False if that term is older than ours: it is not followed
        (its sender must step down); else it is this agent's coordinator, and its contact renews."""
        if term < self.state.term:
            return False
        if term > self.state.term:
            self.state.term, self.state.voted_for, self.changed = term, None, True
        if self.state.coordinator != coordinator:
            self.state.coordinator, self.changed = coordinator, True
        self.last_contact, self.holder, self.coordinator_heard = now, coordinator, now
        if known is not None and known.generation >= self.known.generation:
            self.known = known
        return True

    def request(self, candidate: str, term: int, known: Known, now: float) -> Ballot:
        """A candidate's request for a vote in `term`, knowing `known`: granted at most once a term."""
        st = self.state
        if candidate not in self.nodes:
            return self._refused("%s is not a node of the job" % candidate)
        if term < st.term or (term == st.term and st.coordinator is not None and candidate != st.coordinator):
            return self._refused("term %d is not newer than %d%s" % (
                term, st.term, " (coordinator %s)" % st.coordinator if st.coordinator else ""))
        if self.holds_lease(now) and candidate != self.holder:
            return self._refused("%s (term %d) heard %.1f s ago, within its lease "
                                 "(%.1f s + %.1f s)" % (self._holder(), st.term, now - self.last_contact, self.lease, MARGIN))
        if known.generation < self.known.generation:
            return self._refused("%s knows generation %d, this node %d" % (
                candidate, known.generation, self.known.generation))
        if term > st.term:
            st.term, st.voted_for, st.coordinator, self.changed = term, None, None, True
        if st.voted_for not in (None, candidate):
            return self._refused("voted for %s in term %d" % (st.voted_for, term))
        if st.voted_for is None:
            st.voted_for, self.changed = candidate, True
        # A vote is a promise as a beat is: no other candidate for lease + MARGIN (the winner counts it)
        self.last_contact, self.holder = now, candidate
        return Ballot(self.node, term, True, self.known, heard_at=self.coordinator_heard)

    def _refused(self, why: str) -> Ballot:
        """A refusal, naming the term this voter knows and the coordinator it follows there (sealed with the
        answer, ballot.py): a candidate behind it learns who won (`learn`)."""
        return Ballot(self.node, self.state.term, False, self.known, why, self.state.coordinator)

    def learn(self, ballots, now: float) -> str | None:
        """A candidate's refusals: where one names a term newer than this agent's (or its own term, where it knows
        no coordinator of it) and the coordinator its voter follows there, this agent takes up that term and
        follows that coordinator, as if it had heard its line (`heard`: never an older term). That coordinator,
        or None. Why: an old coordinator's node, healed, would ask in vain forever, its pre-votes raising no
        term; a voter follows only a coordinator whose stamped lines it heard, and there is one a term."""
        st, best = self.state, None
        for b in ballots:
            if b.granted or b.coordinator not in self.nodes or b.coordinator == self.node:
                continue
            if (b.term > st.term or (b.term == st.term and st.coordinator is None)) and \
                    (best is None or b.term > best.term):
                best = b
        if best is None:
            return None
        self.heard(best.term, best.coordinator, now, best.known)
        return best.coordinator

    def _holder(self) -> str:
        return ("coordinator %s" % self.holder if self.holder == self.state.coordinator else
                "candidate %s, voted for," % self.holder)


@record
class Won:
    """An election won: the term, the votes, and what the new coordinator's board continues from."""
    term: int
    voters: tuple
    known: Known
    heard: float | None = None  # the latest its voters last heard a coordinator's line (None: one cannot say)

    def first_generation(self) -> int:
        """The new coordinator's first generation: one past the newest its majority knew."""
        return self.known.generation + 1


def tally(nodes: tuple, candidate: str, term: int, ballots) -> Won | None:
    """The election of `candidate` for `term`, if the ballots (its own included) are a strict majority of
    `nodes` granted for that term, one per node of the job; else None."""
    granted = {}
    for b in ballots:
        if b.granted and b.term == term and b.voter in nodes and b.voter not in granted:
            granted[b.voter] = b
    if candidate not in granted or len(granted) < majority(len(nodes)):
        return None
    newest = max((b.known for b in granted.values()), key=lambda k: k.generation)
    left = min(b.known.restarts_left for b in granted.values() if b.known.generation == newest.generation)
    heard = [b.heard_at for b in granted.values()]
    return Won(term, tuple(sorted(granted)), Known(newest.generation, tuple(sorted(newest.out)), left),
               None if None in heard else max(heard))


def may_start(generation: int, knows: dict, nodes: tuple) -> bool:
    """Whether the coordinator may let `generation` start: a strict majority of `nodes` (itself included) said
    in a beat that they know it (`knows`: node -> the newest generation its beat named). Then every majority
    that can elect a successor holds a node that knows it, and the successor's first generation (one past
    the newest its voters knew) is never a number this generation had."""
    return sum(1 for n in nodes if knows.get(n, -1) >= generation) >= majority(len(nodes))


def candidacy_delay(nodes: tuple, node: str, heard: set, stagger: float) -> float:
    """Seconds `node` waits, once it may stand, before it asks for votes: `stagger` for each node before it in
    the cluster file that it still hears from (those go first)."""
    return stagger * sum(1 for n in nodes[:nodes.index(node)] if n in heard)


def may_stand(voter: Voter, now: float) -> bool:
    """Whether this agent may stand: its own coordinator has been silent for lease + MARGIN (it would vote)."""
    return not voter.holds_lease(now)


class Lease:
    """The coordinator's side: it holds its term while a strict majority of the job's trainer nodes (itself
    included) answered it within `lease`. A node counts from the moment the coordinator **sent** the line the
    node's beat echoes (each reply carries the coordinator's monotonic time; each beat names the newest it
    received), never from the beat's arrival: a beat held in a queue (a paused coordinator, a slow link)
    proves nothing newer than what it echoes. A beat naming a newer term means another coordinator was
    elected: this one steps down at once."""

    def __init__(self, nodes: tuple, me: str, term: int, lease: float, asked: float, voters=()):
        """`asked`: when it asked for the votes (before any was given); `voters`: who granted them."""
        self.nodes, self.me, self.term, self.lease = tuple(nodes), me, term, lease
        self.heard = {n: asked for n in voters if n in self.nodes}  # node -> monotonic, of what it echoed
        self.heard[me] = asked
        self.since = asked
        self.superseded: int | None = None  # a newer term some node named

    def beat(self, node: str, term: int, echoed: float) -> bool:
        """A beat from `node` naming `term` and echoing the coordinator's line sent at `echoed` (its own
        monotonic time): True if it counts for this coordinator's lease."""
        if term > self.term:
            self.superseded = max(term, self.superseded or 0)
            return False
        if term < self.term or node not in self.nodes:
            return False
        if echoed > self.heard.get(node, float("-inf")):
            self.heard[node] = echoed
        return True

    def holds(self, now: float) -> bool:
        """A majority heard within the lease, itself included, and no newer term named."""
        if self.superseded is not None:
            return False
        self.heard[self.me] = now
        fresh = sum(1 for n, t in self.heard.items() if now - t < self.lease)
        return fresh >= majority(len(self.nodes))

    def why_not(self, now: float) -> str:
        """Why it steps down, in one line (its fence's reason)."""
        if self.superseded is not None:
            return "a node names term %d, newer than this coordinator's %d: it steps down" % (
                self.superseded, self.term)
        fresh = sorted(n for n, t in self.heard.items() if now - t < self.lease)
        return ("coordinator %s (term %d) heard %d of %d trainer nodes within its lease (%.1f s), fewer than a "
                "majority (%d): it steps down and its node fences itself" % (
                    self.me, self.term, len(fresh), len(self.nodes), self.lease, majority(len(self.nodes))))


def moved(node: str, term: int, previous: str | None) -> str:
    """The event's and `fab status`'s line when a coordinator is elected."""
    return "coordinator now on %s (term %d)%s" % (node, term, ", after %s" % previous if previous else "")
