"""Spare nodes on the board (`spare: true`, under min_nodes): which spare takes the slot of a node that leaves.

A spare's agent beats from the start and runs nothing: the spare is in no
generation's world, it is not `out` (it never left), and its processes count
for nothing on the board (`counted`), so a job whose spares never ran still
finishes. When a trainer node leaves (lost, or it could not start its part),
the first spare in the cluster file's order that beats, is not lost and runs
nothing takes its slot (`board.stand_in`, {spare: node}): the next generation
keeps the world's size and order (elastic.py, Layout.world, renumbered). A
stand-in that leaves gives its slot back to the next ready spare, or the world
goes on without that slot. A node that comes back while a spare holds its slot
stays out, idle, until the slot is free again (no generation is spent on
swapping it back; board._grow). A spare that left and comes back with nothing
running is a ready spare again. Pure, as the board.
"""
from __future__ import annotations

from fabtrain.contract.events import EventKind


def is_spare(board, node: str) -> bool:
    layout = board.restart.layout
    return layout is not None and node in layout.spares


def idle(board, node: str) -> bool:
    """`node` is a spare that holds no slot: nothing it runs or reports is the job's."""
    return is_spare(board, node) and node not in board.stand_in


def counted(board, node: str, procs: dict) -> dict:
    """The processes of `node`'s beat that count for the job: none of an idle spare's (its trainers, never
    started, would keep the job from finishing)."""
    return {} if idle(board, node) else procs


def ready(board, skip=()) -> str | None:
    """The first spare that may take a slot now: it beats, is not lost nor done, holds no slot, runs nothing."""
    for name in board.restart.layout.spares:
        peer = board.peers.get(name)
        if name in skip or name in board.stand_in or name in board.out or peer is None:
            continue
        if not (peer.lost or peer.done or peer.running):
            return name
    return None


def after_leave(board, node: str) -> dict:
    """The stand-ins once `node` leaves: its own slot (or, a stand-in itself, the slot it held) given to a ready
    spare, where there is one."""
    stand_in = {s: slot for s, slot in board.stand_in.items() if s != node}
    slot = board.stand_in.get(node, node)
    if slot in board.restart.layout.trainer_nodes:
        spare = ready(board, skip=(node,))
        if spare is not None:
            stand_in[spare] = slot
    return stand_in


def taken(board, before: dict, event) -> list:
    """The spares that took a slot since `before` must start their part of the generation the board restarts
    to; the `stand_in` events that say so (`event`: the board's Event): `n4 (spare) takes n2's place in
    generation 1 (WORLD_SIZE 3)`."""
    generation = board.status["generation"]
    world, events = board.restart.layout.world_size(board.out, board.stand_in), []
    for spare, slot in sorted(board.stand_in.items()):
        if before.get(spare) == slot:
            continue
        board.peers[spare].had_procs = True  # it must start its part of the generation, as every other node
        events.append(event(EventKind.STAND_IN, spare, "%s (spare) takes %s's place in generation %d (WORLD_SIZE %d)"
                       % (spare, slot, generation, world), {"generation": generation, "world_size": world, "slot": slot}))
    return events


def came_back(board, node: str) -> bool:
    """A spare that left (it stood in, then was lost) beats again with nothing running: ready again, idle,
    no generation spent on it. True if so."""
    peer = board.peers[node]
    if not is_spare(board, node) or peer.running:
        return False
    board.out = board.out - {node}
    return True

