"""What the agent's policy (policy.py) tells the loop (loop.py) to do: actions, as data.

The loop executes them in order: a Note is an event, DumpStacks comes before a hang's
Stops, Stop and Escalate are the one kill escalation, Relaunch starts the next generation."""
from __future__ import annotations

from fabtrain.node.structs import factory, record


@record
class Note:
    """An event for events.jsonl."""
    kind: str
    reason: str
    name: str | None = None
    fields: dict = factory(dict)


@record
class DumpStacks:
    """Record every thread's stack of these live processes into the job's directory (stacks.py), before
    the Stop actions that follow it; the next `hang` or `teardown` Note carries each one's top frame."""
    names: tuple


@record
class Stop:
    """SIGTERM to a job process and everything it started; the grace starts."""
    name: str
    reason: str


@record
class Escalate:
    """SIGKILL to what of a job process survived its grace."""
    name: str


@record
class KillLauncher:
    name: str


@record
class Relaunch:
    """Start this node's processes again as generation `generation` (on_failure restart)."""
    generation: int


@record
class Signal:
    """A signal to one process that is not a job process of its own (an orphan, a zombie's parent)."""
    pid: int
    ctime: float | None
    signal: int
