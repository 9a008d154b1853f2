"""THE supervisor of a node's part hosted inside another system's unit of work: a Slurm step task, a pod.

On SSH nodes fab starts a node's part over the node's connector and leaves.
Where a platform starts it instead, one process stays with the part as the
platform's unit of work (the step task, the pod's PID 1): it starts it through
node ops' start (the same launcher, spawn and agent), follows it until nothing
of it is left on its node, stops it when the platform says so, and ends with
an exit code the platform reads. That loop is here, once; what differs is a
small adapter, a `Host`, that says what its platform gives:

    part()          this node's job.json, agent spec and roles: its index, its peers' addresses,
                    the GPUs it was granted (fabtrain/node/allocation.py: SLURM_NODEID and
                    scontrol; fabtrain/node/pod.py: the completion index and the Secret's files)
    sigterm(jd)     what a SIGTERM to it means (a `Stop`): the user's stop through fabtrain (its
                    `killed` marker is written before any signal), the platform's time limit, or
                    the platform taking the node or the job (an eviction, a preemption)
    warned(jd)      a stop the platform announced without a signal (Slurm's time-limit file)
    tick(final)     what it does while it waits (a pod's PID 1 reaps, and copies the logs to stdout)
    said(reply)     what it prints of node ops' start

Its exit code is the agents' verdict (`exit_code`), never the processes'
exit files: 0 when the job finished (a pserver that the agents stop at the
end, 143, included), 1 when it failed, 143 when the platform or the user
stopped it before either. Only a job without agents (watchdog disabled) has
no verdict; then every process exiting 0 is its 0.

A platform's stop is never the user's: the supervisor writes the cause into
the job folder's `disrupted` marker (contract/states.py) before it stops the
node's processes, unmarked, so the agents report a lost node ("node n1 evicted
by Kubernetes", restarted under on_failure: restart, or left behind under
min_nodes) or the platform's end of the job ("node n1 preempted by Slurm"),
never "stopped by fab kill-all".

An MPI rank's bootstrap (node/mpirank.py) is not hosted here: it execs THE
launcher in place, so that Open MPI's daemon holds the rank itself; the
node's part around it is started and followed by node ops and the agent.
Standard library only.
"""
import os
import signal
import sys
import threading
import time

from fabtrain.node import launch, ops, procfs
from fabtrain.node.spawn import clear_exit, expand
from fabtrain.contract.events import EventKind
from fabtrain.contract.jobfolder import JobFolder
from fabtrain.contract.states import LOST, JobState, disruption_marker, read_disruption
from fabtrain.node.structs import record
from fabtrain.node.workspace import job_dir

POLL = 0.2
STOPPING_POLL = 0.05
AGENT_EXIT_WAIT = 10  # seconds an agent that wrote agent_exit may take to be gone
STOPPED = 128 + signal.SIGTERM  # what a part stopped before the job ended exits with


@record
class Stop:
    """What ends a node's part before the job does, and how it reads."""
    reason: str  # words the `killed` events of the node's processes
    by: str = None  # who the job's `killed` marker names (states.KILLERS): a stop on the user's terms
    disruption: str = None  # the `disrupted` marker's kind (states.LOST or ENDED): the platform's doing
    mark: bool = False  # node ops' kill writes the `killed` marker (by): no one wrote it before the signal


class Host:
    """What a platform gives the supervisor (see the module's doc); each platform's adapter subclasses it."""
    NAME = ""

    def part(self):
        raise NotImplementedError

    def sigterm(self, jd):
        raise NotImplementedError

    def warned(self, jd):
        return None

    def tick(self, final=False):
        pass

    def said(self, reply, job):
        for failed in reply["failed"]:
            print("fabtrain: %s did not start: %s" % (failed["name"], " | ".join(failed["log"])), file=sys.stderr)
        for warning in reply["warnings"]:
            print("fabtrain: %s" % warning, file=sys.stderr)


def events(jd):
    return JobFolder(jd).read_events()


def outcome(jd, node):
    """The job's end as this node's agent knows it: JobState.FINISHED, FAILED, or None (not yet). An agent
    leaves once its node's part has ended and the coordinator has its word, maybe before the job's end is
    decided: with no failure said on this node, its part finished."""
    ended = None
    for ev in events(jd):
        kind = ev.get("kind")
        if kind == EventKind.FINISHED or (kind == EventKind.AGENT_EXIT and ev.get("node") == node and ended is None):
            ended = JobState.FINISHED
        elif kind in (EventKind.JOB_FAILED, EventKind.KEPT, EventKind.FAILURE):
            ended = JobState.FAILED
        elif kind == EventKind.RESTARTED:
            ended = None  # a failure the job restarted from is not its end
    return ended


def exit_code(jd, job, ws, stopped, agents=True):
    """The part's exit code: the agents' verdict (see the module's doc); `stopped`: a stop came first."""
    ended = outcome(jd, job["node"])
    if ended == JobState.FINISHED:
        return 0
    if stopped is not None or os.path.exists(JobFolder(jd).killed):  # marked: stopped from outside
        return STOPPED
    if ended == JobState.FAILED or agents:
        return 1  # failed, or agents that never said how it ended
    return 0 if all(launch.read_exit(expand(p["exit"], ws)) == 0 for p in job["processes"]) else 1


def agent_said_exit(jd, node):
    """This node's agent wrote agent_exit: nothing of the job is left for it to watch."""
    return any(ev.get("kind") == EventKind.AGENT_EXIT and ev.get("node") == node for ev in events(jd))


def stop_node(ws, jd, node, grace, stop):
    """Stop this node's part: the platform's cause first (the `disrupted` marker), then node ops' kill."""
    if stop.disruption:
        with open(JobFolder(jd).disrupted, "w") as f:
            f.write(disruption_marker(stop.disruption, stop.reason))
    payload = {"workspace": ws, "grace": grace, "node": node, "reason": stop.reason, "mark": stop.mark}
    if stop.by:
        payload["by"] = stop.by
    result = ops.op_kill(payload)
    print("stopped (%s): %d processes, %d left" % (stop.reason, len(result["killed"]), len(result["left"])), flush=True)


def forget_earlier_part(jd, job):
    """This node's part starts again (a pod that replaces an evicted one, on the same workspace): the
    old disruption is over, and the old processes' exit records are not the new ones'. A loss of the node
    (LOST) is kept as `disrupted.before`, which the new agent reports first: the agent the platform took may
    not have said it (stopped in its first moments, or by SIGKILL), and the coordinator must not read the
    new part as the old one going on."""
    folder = JobFolder(jd)
    try:
        if read_disruption(jd)[0] == LOST:
            os.replace(folder.disrupted, folder.disrupted_before)
        else:
            os.unlink(folder.disrupted)
    except OSError:
        pass
    for proc in job["processes"]:
        clear_exit(jd, proc["name"])


class Signals:
    """The SIGTERM the platform sends (its stop); SIGHUP ignored, as the launcher does. `wait` returns at
    once when it comes: a stop starts within the signal's delivery, not the next poll."""

    def __init__(self):
        self.got = None
        self.came = threading.Event()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _on_signal(self, signum, frame):
        self.got = signum
        self.came.set()

    def wait(self, seconds):
        if self.came.wait(seconds):
            self.came.clear()  # taken: the next wait waits again


def follow(host, signals, ws, jd, node, grace):
    """Until nothing of the job is left on this node; stops it when the platform says so. The Stop, or None."""
    stopped, settled_at, exiting_since = None, None, None
    while True:
        host.tick()
        if stopped is None:
            stopped = host.sigterm(jd) if signals.got else host.warned(jd)
            if stopped is not None:
                stop_node(ws, jd, node, grace, stopped)
        live = ops.live_job_processes(jd)
        if live == ["agent"] and agent_said_exit(jd, node):
            exiting_since = exiting_since or time.time()
            if time.time() - exiting_since > AGENT_EXIT_WAIT:  # it said it is done: it must not hold the node
                stop_node(ws, jd, node, grace, Stop("the agent had not exited %d s after agent_exit" % AGENT_EXIT_WAIT))
        if not live:
            left = procfs.marked(ws, skip=procfs.ancestors())
            settled_at = settled_at or time.time()
            if not left:
                host.tick(final=True)
                return stopped
            if time.time() - settled_at > grace + 2:  # outlived every launcher: nothing will end it now
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        # Once stopping, what is left is looked at more often: the platform waits for this process to end.
        signals.wait(POLL if stopped is None else STOPPING_POLL)


def run(host):
    """Start this node's part, follow it to its end, and return the exit code the platform reads."""
    signals = Signals()
    job, agent, roles = host.part()
    ws = os.path.abspath(os.path.expanduser(job["workspace"]))
    # together: the platform starts every node's part at once, so nothing here waits for the coordinator.
    payload = {"job": dict(job, workspace=ws), "roles": roles, "together": True}
    if agent:
        payload["agent"] = agent
    try:
        forget_earlier_part(job_dir(ws, job["job_id"]), job)
        reply = ops.op_start(payload)
    except ops.UserFacing as e:
        print("fabtrain: %s: %s" % (job["node"], e), file=sys.stderr)
        return 1
    host.said(reply, job)
    jd = reply["job_dir"]
    stopped = follow(host, signals, ws, jd, job["node"], float(job["watchdog"]["grace"]))
    return exit_code(jd, job, ws, stopped, agents=bool(agent))
