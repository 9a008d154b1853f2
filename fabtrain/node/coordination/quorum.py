"""`may_start` wired into the board (election.py), for a job that elects: a restart's generation is held until a
strict majority of the job's trainer nodes' beats say they know it. Pure, like board.py.

Why: a successor's first generation is one past the newest its voters knew (`tally`). Once a majority knows
generation g, every majority that can elect a successor holds a node that knows g, so no successor numbers a
generation of its own g, and `MASTER_PORT` + g stays one generation's (docs/partitions.md, "Majority
election", "The numbering goes on").

Each beat of such a job names `knows`: the newest generation its agent heard its coordinator's status name
(agent/link.py, the voter's `known`). While a majority does not, the board's restarting status says `held`:
the agents tear down and wait (agent/policy.py); the beat that makes the majority moves the status on, its
backoff the rest of the one decided (never earlier than the board's own start), and every agent starts then.
A job that does not elect has no quorum: its board, status and beats are as without this module.
"""
from __future__ import annotations

from fabtrain.contract.states import JobState

from .election import may_start


def of(restart) -> tuple | None:
    """The nodes whose majority must know a generation before it starts (the job's trainer nodes), or None."""
    layout = restart.layout
    return tuple(layout.trainer_nodes) if layout is not None and layout.elects() else None


def knowing(board) -> dict:
    return {n: p.knows for n, p in board.peers.items()}


def hold(board, status: str, generation: int) -> dict:
    """The status's `held` (only while it restarts to a generation a majority does not know yet)."""
    if board.quorum is None or status != JobState.RESTARTING or may_start(generation, knowing(board), board.quorum):
        return {}
    return {"held": True}


def beat(board, peer, msg: dict, now: float, wall: float) -> bool:
    """Take a beat's `knows`; True if that made a held generation's majority (the status moves on: tell everyone)."""
    known = msg.get("knows")
    if board.quorum is None or type(known) is not int or known <= peer.knows:
        return False
    peer.knows = known
    st = board.status
    if not st.get("held") or not may_start(st["generation"], knowing(board), board.quorum):
        return False
    start = max(board.restart_start if board.restart_start is not None else now, now)
    if board.restart_due is not None and board.restart_start is not None:
        board.restart_due += start - board.restart_start  # its nodes' deadline counts from the start they are given
    board.restart_start = start
    return board._set_status(JobState.RESTARTING, st["reason"], st["node"], wall, st["generation"],
                             round(start - now, 3))
