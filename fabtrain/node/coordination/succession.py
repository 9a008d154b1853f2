"""A coordinator a majority elected (election.py) takes over the job's board, pure.

An elected agent's link calls it (agent/link.py, docs/partitions.md, "Majority election").
The new coordinator has no board of the old one's: it starts one from what
its majority knew (`Won.known`: the newest generation, the nodes out) and
takes the old coordinator's node as lost now. That is the board's own
leave (`Board._leave`), so the first generation of the new term is the
newest its majority knew plus one, and it starts no earlier than
`fence_wait` from the moment its voters last heard a coordinator's line
(`Won.heard`, the latest of them; the election's own moment where a voter
cannot say). Why that is enough: the old coordinator counts a node for its
lease only while that node echoes one of its lines sent within the lease
(election.Lease), so once every voter has been silent for the lease it
holds fewer than a majority (the voters are one) and steps down; its node's
dead-man deadline is that step-down + `fence_slack` whether its agent runs
or not (node/deadman.py), and the lease is `fence_after`: its node's
processes are gone within `stop_bound` of that latest hearing.
"""
from __future__ import annotations

from fabtrain.contract.events import EventKind
from fabtrain.contract.states import JobState

from .board import Board, Event
from .election import Won, moved
from .restart import RestartPolicy


def take_over(job_id: str, nodes: list, peer_timeout: float, restart: RestartPolicy, won: Won, me: str,
              previous: str | None, now: float, wall: float) -> tuple[Board, list]:
    """The board of `me`, coordinator of `won.term`, and its events: the move (`coordinator`), and the old
    coordinator's node leaving (`node_left`), or the job's end where it cannot go on without it."""
    board = Board(job_id, nodes, peer_timeout, restart)
    board.elected = True
    board.out = frozenset(n for n in won.known.out if n in board.node_set)
    board._set_status(JobState.RUNNING, None, None, wall, won.known.generation)
    for voter in won.voters:  # they were in the world: each starts its part of the next generation
        board._join(voter, now).had_procs = True
    events = [Event(EventKind.COORDINATOR, me, moved(me, won.term, previous),
                    {"term": won.term, "previous": previous, "voters": list(won.voters)})]
    if previous is None or previous in board.out:
        return board, events
    # Its last hearing, for the fence wait: the latest any voter heard a coordinator (never later than now)
    board._join(previous, now).seen = now if won.heard is None else min(now, won.heard)
    reason = "node %s lost: the coordinator there lost its majority; %s" % (previous, moved(me, won.term, None))
    board._leave(previous, reason, now, wall, events)
    return board, events
