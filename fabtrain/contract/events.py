"""events.jsonl's records: their kinds, the sets of kinds that mean something together, and the one reader.

A record is one JSON object a line: {"ts", "node", "kind", ["name"], "reason", ...fields}. The
agent writes them (fabtrain/node/agent/events.py, the one writer), node ops' kill appends its own
(fabtrain/node/killevents.py); the agents replay them, node ops read them back for a start, a pod's
or a Slurm step's exit code and the run history, and the controller collects them for the verdict,
`fab status` and the dashboard.

EventKind is str-valued: a kind is the same string in the JSON it has always been, and a kind read
back from a file compares equal to (and hashes as) its member.
"""
import json
from enum import Enum


class EventKind(str, Enum):
    # the agent's own life on its node
    AGENT_STARTED = "agent_started"
    AGENT_RESTARTED = "agent_restarted"  # a new agent took over from one that died
    AGENT_ERROR = "agent_error"
    AGENT_LAUNCHER_LOST = "agent_launcher_lost"
    AGENT_EXIT = "agent_exit"  # nothing of the job is left on this node
    AGENT_STOPPED = "agent_stopped"
    # one of the job's processes
    EXITED = "exited"
    KILLED = "killed"
    HANG = "hang"
    ORPHAN = "orphan"
    ZOMBIE = "zombie"
    STRAGGLER = "straggler"
    BLAME = "blame"  # after a hang: the rank the others wait for, from every node's ranks (the first node's agent)
    RESUMED = "resumed"  # a restarted process's first step: the checkpoint it loaded (or none), the steps lost
    NO_CHECKPOINT = "no_checkpoint"  # no trainer wrote a checkpoint for job.watchdog.no_checkpoint (the first node's agent)
    # the job
    FAILURE = "failure"  # a failure the coordinator decides on (on_failure restart): a restart or the end
    JOB_FAILED = "job_failed"
    FINISHED = "finished"
    KEPT = "kept"  # failed, its processes left running (on_failure keep)
    TEARDOWN = "teardown"
    RESTARTING = "restarting"
    RESTARTED = "restarted"
    START_FAILED = "start_failed"  # node ops: the start failed on some node, all of it was stopped
    ATTEMPT = "attempt"  # a requeued Slurm job's next attempt began here (fabtrain/node/attempts.py)
    # the coordinator and the other nodes
    NOT_JOINED = "not_joined"
    PEER_LOST = "peer_lost"
    PEER_BACK = "peer_back"
    NODE_LEFT = "node_left"
    NODE_BACK = "node_back"  # a node that left the job (min_nodes) is back in a new generation
    STAND_IN = "stand_in"  # a spare node takes the slot of a node that left (min_nodes), the world keeps its size
    FENCED = "fenced"  # a node that left the job (min_nodes) spoke again: the coordinator refused it, it ended
    RESTART_FAILED = "restart_failed"
    COORDINATOR = "coordinator"
    COORDINATOR_ERROR = "coordinator_error"
    COORDINATOR_REFUSED = "coordinator_refused"
    # alerts
    NOTIFY_FAILED = "notify_failed"

    def __str__(self):
        return self.value

    # As the string it is: a kind read from JSON finds its member in a dict or a set, and the member the string.
    __hash__ = str.__hash__


K = EventKind
# How the agents say the job ended: it failed, it finished, or it failed and was kept running.
OUTCOMES = (K.JOB_FAILED, K.FINISHED, K.KEPT)
# The steps of a restart (on_failure restart); both carry the generation.
RESTARTS = (K.RESTARTING, K.RESTARTED)
# What the job as a whole did, as opposed to the watchdog's running commentary: the verdict reads these.
JOB_EVENTS = OUTCOMES + RESTARTS
# A process's end.
PROCESS_ENDS = (K.EXITED, K.KILLED)
# What a process did that can be why a job failed.
CAUSES = (K.EXITED, K.KILLED, K.HANG)
# What a node's agent (not a process) said that can be why a job failed.
NODE_CAUSES = (K.NOT_JOINED, K.PEER_LOST, K.FAILURE, K.JOB_FAILED)
# The agent's routine: its start and its end, not news on their own.
ROUTINE = (K.AGENT_STARTED, K.AGENT_EXIT, K.AGENT_STOPPED)
# Where the agent records every thread's stack of the processes it is about to stop.
STACK_DUMPS = (K.HANG, K.TEARDOWN)
del K


def read_events(path, offset=0):
    """events.jsonl's records from byte `offset` on: every whole line that is a JSON object (a line
    being written, or one that does not parse, is skipped); [] where there is no file yet."""
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        if offset:
            f.seek(offset)
        data = f.read()
    out = []
    for line in data.split(b"\n"):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out
