"""The states of one job process: the one vocabulary of node ops, the agent and the controller.

Standard library only (it runs on the nodes). A process that died of a
signal is `killed`, whether the launcher recorded it as exit code 128+N
(137 for SIGKILL) or the agent saw the signal itself; `exited` is an end
with an exit code of the program's own; `lost` is gone without either.
"""
from __future__ import annotations

from enum import Enum


class ProcessState(str, Enum):
    RUNNING = "running"
    SLEEPING = "sleeping"
    STOPPED = "stopped"
    ZOMBIE = "zombie"
    EXITED = "exited"
    KILLED = "killed"
    LOST = "lost"
    NOT_STARTED = "not started"

    def __str__(self) -> str:
        return self.value


LIVE = frozenset({ProcessState.RUNNING, ProcessState.SLEEPING, ProcessState.STOPPED, ProcessState.ZOMBIE})

# /proc/<pid>/stat state letters, and the names for them.
_ALIVE = {"R": ProcessState.RUNNING, "S": ProcessState.SLEEPING, "D": ProcessState.SLEEPING,
          "I": ProcessState.SLEEPING, "W": ProcessState.SLEEPING, "T": ProcessState.STOPPED,
          "t": ProcessState.STOPPED, "Z": ProcessState.ZOMBIE, "X": ProcessState.ZOMBIE}
_ALIVE.update({s.value: s for s in LIVE})


def exit_signal(exit_code: int | None) -> int | None:
    """The signal an exit code stands for: 128+N from a shell wrapper, -N from Popen; else None."""
    if isinstance(exit_code, bool) or not isinstance(exit_code, int):
        return None
    if 128 < exit_code < 128 + 65:
        return exit_code - 128
    if -65 < exit_code < 0:
        return -exit_code
    return None


def process_state(alive: bool, proc_state: str | None, exit_code: int | None,
                  signal: int | None) -> ProcessState:
    """Classify one process.

    alive: it (or its launcher) is still there; proc_state: its /proc state
    letter or a state name ("killed" where something else knows it was
    killed, e.g. by fab kill-all); exit_code: what its launcher recorded, if
    it ended; signal: the signal that ended it, where known without an exit code.
    """
    if proc_state == ProcessState.NOT_STARTED.value:
        return ProcessState.NOT_STARTED
    if alive:
        return _ALIVE.get(proc_state or "R", ProcessState.RUNNING)
    if signal or exit_signal(exit_code) or proc_state == ProcessState.KILLED.value:
        return ProcessState.KILLED
    if exit_code is not None:
        return ProcessState.EXITED
    return ProcessState.LOST
