"""The vocabulary of how a process and a job end, and what state they are in: one module.

Node and controller alike use it: node ops' status, the agent's policy,
health.json and events, the coordinator's board, and the controller's verdict,
`fab status`, the dashboard and /metrics. So an exit code of 137 means
"killed by SIGKILL" everywhere, a process whose launcher vanished without
recording an exit code is "killed", never silently "lost", and a job's
"failed" is one word, not a string spelled in five places.

Both enums are str-valued: their values are the ones the JSON records have
always used, and a state read back from JSON compares equal to its member.
"""
from __future__ import annotations

import os
import signal as _signal
from enum import Enum

from fabtrain.contract.jobfolder import DISRUPTED


class ProcessState(str, Enum):
    RUNNING = "running"  # alive, neither stopped nor a zombie, whatever the scheduler says (R, S, D)
    SLEEPING = "sleeping"  # older agents' word for an alive process in S; read back, never decided
    STOPPED = "stopped"
    ZOMBIE = "zombie"
    EXITED = "exited"
    KILLED = "killed"
    LOST = "lost"
    NOT_STARTED = "not started"

    def __str__(self) -> str:
        return self.value

    @property
    def alive(self) -> bool:
        """The process (or its launcher) still holds resources."""
        return self in LIVE

    @property
    def ended(self) -> bool:
        return self in (ProcessState.EXITED, ProcessState.KILLED, ProcessState.LOST)


class JobState(str, Enum):
    """A job's state. The agents and the coordinator move a job between RUNNING, RESTARTING and the
    FINAL states; the controller's verdict adds what only it can see (no job, unknown, starting, killed)."""
    NO_JOB = "no job"
    UNKNOWN = "unknown"  # no node could be reached, and nothing says how the job ended
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    KILLED = "killed"
    RESTARTING = "restarting"  # on_failure restart: torn down, the next generation starts after the backoff

    def __str__(self) -> str:
        return self.value

# Seconds between SIGTERM and SIGKILL when a job's processes are stopped and nothing else says
# (cluster.yaml's job.watchdog.grace defaults to it; node ops' kill, a pod's and a Slurm step's stop use it).
STOP_GRACE = 5.0

# The reason a job ends with when a user ran `fab kill-all`: their own act, so no alert is sent for it.
KILLED_BY_FAB = "stopped by fab kill-all"
# Who else stops a job (the first line node ops' kill writes into the job's `killed` marker): on a user's
# word, or a start that failed on some node (all or nothing; the marker's next lines say why).
START_FAILED = "a start that failed on some node"
# Slurm's warning before its time limit (scheduler.term_before) stops the job on the user's own terms: no failure,
# no restart, no alert; the job reads "stopped by Slurm's time limit".
TIME_LIMIT = "Slurm's time limit"
KILLERS = ("fab kill-all", "the dashboard's Kill button", "fab start-pserver --force", "fab start-trainers --force",
           START_FAILED, TIME_LIMIT)

# What took a node's part away from outside fabtrain (its platform: an eviction, a preemption), written by the
# node's supervisor (node/hosted.py) into the job folder's `disrupted` marker before any signal, as "<kind>\n<cause>"
# (disruption_marker): never a user's stop. LOST: the node is gone and the job may go on (restart, or without it
# under min_nodes); ENDED: the platform ended the whole job (every node gets it), which fails with the cause, not a
# program's.
LOST, ENDED = "lost", "ended"


class FailureKind(str, Enum):
    """What kind of failure an agent reports to the coordinator (its beat's `failure.kind`): whether the job
    may restart after it, or go on without the node (min_nodes)."""
    EXIT = "exit"  # a program exited non-zero, or was killed by a signal nobody of fabtrain's sent
    HANG = "hang"  # the hang rule (docs/watchdog.md)
    LOST = LOST  # the node's platform took it (an eviction, a preemption of one node): its part comes back
    ENDED = ENDED  # the platform ended the whole job (the `disrupted` marker): failed with that cause
    START = "start"  # the node could not start its part (a restart's generation, or the first start)
    LEFT = "left"  # the coordinator's own: a node left the job (lost, or could not start) under min_nodes
    KILL_ALL = "kill-all"  # the user's stop (fab kill-all, the dashboard's Kill): never restarted
    OTHER = "other"  # anything else (an agent stopped while its processes ran): never restarted

    def __str__(self) -> str:
        return self.value


# After these the coordinator restarts the job under on_failure: restart (LEFT too, under min_nodes).
RESTARTABLE = (FailureKind.EXIT, FailureKind.HANG, FailureKind.LOST)


def disruption_marker(kind, cause):
    """The text of a job folder's `disrupted` marker: its kind (LOST or ENDED), then the cause in words."""
    if kind not in (LOST, ENDED):
        raise ValueError("not a disruption's kind: %r" % (kind,))
    return "%s\n%s\n" % (kind, cause)


def read_disruption(jd, name=DISRUPTED):
    """(kind, cause) of a job folder's `disrupted` marker (or `name`: DISRUPTED_BEFORE), (None, None) if none."""
    try:
        with open(os.path.join(jd, name)) as f:
            kind, _, cause = f.read(2000).partition("\n")
    except OSError:
        return None, None
    return (kind.strip() if kind.strip() in (LOST, ENDED) else ENDED), cause.strip() or "stopped by its platform"


def stopped_by(who):
    """The reason a job ends with when a user stopped it through `who` (one of KILLERS)."""
    return "stopped by %s" % (who if who in KILLERS else KILLERS[0])


def stopped_by_user(reason):
    """Whether a reason says that a user stopped the job (no alert is sent for that)."""
    return any(stopped_by(who) in str(reason or "") for who in KILLERS)


def killed_marker(who, why=None):
    """The text of a job's `killed` marker, its one format: who stopped the job (one of KILLERS), then, for a
    failed start (START_FAILED), why on the next line. read_marker reads it back, and reads an older marker
    (an empty one, a Slurm kill-all's before this format was its too) as KILLERS[0]'s."""
    if who not in KILLERS:
        raise ValueError("not one of the stops a `killed` marker names: %r" % (who,))
    return who + ("\n" + why if why and who == START_FAILED else "")


def read_marker(marker):
    """A job's `killed` marker (killed_marker's text): (who stopped it, one of KILLERS; why, for a failed start),
    (None, None) if none. An empty or unreadable marker (an older writer's) reads as KILLERS[0]'s."""
    try:
        with open(marker) as f:
            text = f.read(2000)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except OSError:
        return KILLERS[0], None
    who, _, why = text.partition("\n")
    who = who.strip()
    if who not in KILLERS:
        return KILLERS[0], None
    return who, (why.strip() or None) if who == START_FAILED else None


def read_killer(marker):
    """Who wrote a job's `killed` marker (one of KILLERS); None when it has none."""
    return read_marker(marker)[0]

LIVE = (ProcessState.RUNNING, ProcessState.SLEEPING, ProcessState.STOPPED, ProcessState.ZOMBIE)
# The ends the agents and the coordinator agree on: a job's status never moves on from these.
FINAL = (JobState.FAILED, JobState.FINISHED)
# The verdict's ends: FINAL, and `fab kill-all`'s (which only the controller's marker tells).
TERMINAL = frozenset(FINAL + (JobState.KILLED,))


# /proc/<pid>/stat's state letter. A training process blocked on I/O or a
# collective (S, D) is as much "running" as one on a CPU: what the job cares
# about is stopped (SIGSTOP) or defunct.
_LETTERS = {"T": ProcessState.STOPPED, "t": ProcessState.STOPPED, "Z": ProcessState.ZOMBIE, "X": ProcessState.ZOMBIE}
_MAX_SIGNAL = 64


def signal_name(sig: int | None) -> str | None:
    """"SIGKILL" for 9, "signal 99" for a number with no name, None for no signal."""
    if sig is None:
        return None
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return "signal %d" % sig


def signal_of(exit_code) -> int | None:
    """The signal an exit code stands for (the shell's 128 + n, or subprocess' -n), or None for a plain
    exit; anything but an int (a value read from a node record) means no signal."""
    if isinstance(exit_code, bool) or not isinstance(exit_code, int):
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code <= 128 + _MAX_SIGNAL:
        return exit_code - 128
    return None


def shell_code(exit_code: int | None, signal: int | None = None) -> int | None:
    """One convention for an ending: the shell's (128 + n for signal n)."""
    if signal is not None:
        return 128 + signal
    if exit_code is not None and exit_code < 0:
        return 128 - exit_code
    return exit_code


def state_of(alive: bool, proc_state: str | None = None, exit_code: int | None = None,
              signal: int | None = None, started: bool = True, before_boot: bool = False) -> ProcessState:
    """The state of one job process.

    alive:       its launcher (or the program) is still there
    proc_state:  the program's /proc state letter, when alive
    exit_code:   the recorded exit code, if any (128 + n: killed by signal n)
    signal:      the signal that ended it, where known directly
    before_boot: its run record predates this boot (nothing can be known of it)
    """
    if not started:
        return ProcessState.NOT_STARTED
    if alive:
        return _LETTERS.get(proc_state or "R", ProcessState.RUNNING)
    if signal is not None or signal_of(exit_code) is not None:
        return ProcessState.KILLED
    if exit_code is not None:
        return ProcessState.EXITED
    # Gone without an exit record: the launcher itself was killed, and the
    # program with it (PR_SET_PDEATHSIG). Only across a reboot is it unknown.
    return ProcessState.LOST if before_boot else ProcessState.KILLED


def describe_end(exit_code: int | None, signal: int | None = None, launcher: int | None = None) -> str:
    """How a process ended, in the words events and `fab status` use."""
    code = shell_code(exit_code, signal)
    sig = signal if signal is not None else signal_of(code)
    if sig is not None:
        return "killed by %s (exit code %d)" % (signal_name(sig), code)
    if code is not None:
        return "exited with code %d" % code
    who = "its launcher (pid %d)" % launcher if launcher else "its launcher"
    return "killed: %s died without recording an exit code" % who


# -- for records read back from a node (the controller's side) ---------------------------

_NAMES = {s.value: s for s in ProcessState}


def recorded_state(alive: bool, proc_state: str | None, exit_code, signal) -> ProcessState:
    """state_of() for a node's record, whose state may already be a name ("killed", "not started")."""
    named = _NAMES.get(proc_state or "")
    code = exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None
    signal = signal if isinstance(signal, int) and not isinstance(signal, bool) else None
    if named is ProcessState.NOT_STARTED or (alive and named is not None):
        return named
    if not alive and code is None and signal is None and named in (ProcessState.KILLED, ProcessState.LOST):
        return named  # the node knew how it ended without a code (kill-all, a record from before boot)
    # An end is decided by its code: "exited" with 137 from an older node is killed by SIGKILL.
    return state_of(alive, proc_state if alive else None, code, signal)
