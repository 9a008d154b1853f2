"""Fencing, pure: how long a node cut off from the coordinator may still run the job, and how long the
coordinator waits before a generation without it starts.

A node's agent holds a **lease**: the moment it sent the newest beat or
pulse (pulse.py) the coordinator has answered (its monotonic clock). The
coordinator's view of the same node is the moment it received that node's
last beat or pulse, which is never earlier, so a duration counted from the
lease on the node ends no later than the same duration counted on the
coordinator from the last beat (both clocks run at the same rate; drift is
parts per million). A pulse is answered only while the node is in the job,
so the lease of a node the coordinator lost runs out as if it had heard
nothing.

- The agent **fences** (stops every process of the job on its node, as a
  teardown: SIGTERM, `grace`, SIGKILL, the launcher a second later) once its
  connection is gone and the lease is `fence_after` old, or the lease is
  `hung_timeout` old on an open connection (a coordinator that answers
  nothing). Its kernel ends a connection whose other side stopped answering
  within `fence_after` of the last answer, plus a keepalive period
  (connections.watch_liveness; the client's TCP_USER_TIMEOUT is `fence_after`).
- So every process of the job there is gone within `stop_bound` of the lease:
  `fence_after`, a beat period (the last beat may have gone out one interval
  after the lease), the keepalive period, the agent's tick, `grace`, and the
  launcher's SIGKILL.
- That needs the agent to run. So that a node whose agent is stopped
  (SIGSTOP) or frozen fences itself too, the agent publishes in the job's
  run folder the moment by which it would have begun that fence, its
  lease + `fence_after` + `fence_slack` (node/deadman.py), and each job
  process's launcher is a dead-man (node/launch.py): once that moment
  passes unrenewed it ends its program as a fence does. Its SIGTERM comes
  at most a poll (DEADMAN_POLL) after the moment, its SIGKILL at most a
  poll after the grace: two polls fit in the launcher's SIGKILL term, so
  the same `stop_bound` holds, no term added.
- The coordinator lets a generation that runs without a lost node start only
  once that node has been silent for `fence_wait` = `stop_bound` + 1 s: its
  old processes are gone before the new world starts, by construction, not
  by the backoff's luck. A node that left may come back (its processes
  all gone, it beats again) into a later generation, up to `max_rejoins`
  times; after that it is fenced for good: the coordinator answers its
  beats with `fenced` and its agent ends.
"""
from __future__ import annotations

from .connections import kernel_timeout

KEEPALIVE_PERIOD = 1.0  # connections.watch_liveness: a probe each second on an idle connection
KILL_AFTER = 1.0  # the launcher's SIGKILL, a second after the program's (agent/policy.py, escalations)
SAFETY = 1.0  # on top of the bound: the coordinator's own check runs every interval/2


def peer_timeout(interval: float) -> float:
    """Silence after which a coordinator (or a peer) whose connection is gone is lost."""
    return max(5 * interval, 5.0)


def fence_after(interval: float) -> float:
    """Age of the lease, with the connection gone, at which an agent stops its node's part of the job:
    an interval under peer_timeout, and the client's TCP_USER_TIMEOUT (connections.kernel_timeout)."""
    return kernel_timeout(peer_timeout(interval), interval)


def fence_slack(interval: float) -> float:
    """Seconds from the moment an agent's rule says fence (its lease fence_after old with the connection gone) to
    the moment its teardown has begun at the latest: the last beat may have gone out (and been answered) an
    interval after the lease, the kernel ends the connection a keepalive probe later, and the agent acts at its
    next tick. A dead-man's deadline (node/deadman.py) is that moment too."""
    return interval + KEEPALIVE_PERIOD + interval


def stop_bound(interval: float, grace: float) -> float:
    """Seconds from the lease by which every process of the job on a cut-off node is gone: the fence begun by
    fence_after + fence_slack, then grace and the launcher's SIGKILL. The dead-man of a node whose agent is
    stopped fits the same sum: its deadline is that same moment, and its two polls (a SIGTERM a poll late, the
    SIGKILL a poll after the grace: launch.DEADMAN_POLL) fit in KILL_AFTER, so no term is added for it."""
    return fence_after(interval) + fence_slack(interval) + grace + KILL_AFTER


def fence_wait(interval: float, grace: float) -> float:
    """Silence of a lost node after which a generation without it may start."""
    return stop_bound(interval, grace) + SAFETY


class Departures:
    """The nodes that left the job (min_nodes): the generation each left at and why, how many times, and
    which were told they are fenced out for good (left more than `max_rejoins` times: the coordinator
    answers each of their beats with `fenced`)."""

    def __init__(self, max_rejoins: int = 0):
        self.max_rejoins = max_rejoins
        self.left_at: dict = {}  # node -> the generation it left at
        self.left_why: dict = {}  # node -> why
        self.times: dict = {}  # node -> how many times it left
        self.stuck: set = set()  # nodes that left because they could not start their part: never taken back
        self.told: set = set()  # nodes whose beats were answered `fenced` (the event once a node)

    def leave(self, node: str, generation: int, reason: str, returns: bool = True) -> None:
        self.left_at[node], self.left_why[node] = generation, reason
        self.times[node] = self.times.get(node, 0) + 1
        if not returns:
            self.stuck.add(node)

    def may_rejoin(self, node: str) -> bool:
        """Whether `node`, which left, may come back into a later generation (it has not flapped past the bound)."""
        return node not in self.stuck and self.times.get(node, 0) <= self.max_rejoins

    def refusal(self, job_id: str, node: str, generation: int, seq) -> tuple[dict, str | None]:
        """The `fenced` answer to a beat from `node`, which left; and the event's reason the first time
        its beat is refused (None after)."""
        left_at = self.left_at.get(node, "?")
        reason = None
        if node not in self.told:
            self.told.add(node)
            reason = ("refused a beat from %s: it left the job at generation %s; its agent is told it is fenced "
                      "out and ends" % (node, left_at))
        times = self.times.get(node, 1)
        kept = ("a node that left never rejoins it" if not self.max_rejoins else
                "a node that could not start its part is not taken back" if node in self.stuck else
                "it left %d times, more than max_rejoins (%d): it is kept out" % (times, self.max_rejoins))
        reply = {"op": "fenced", "job_id": job_id, "node": node, "generation": generation,
                 "reason": "%s left the job at generation %s (%s); %s" % (
                     node, left_at, self.left_why.get(node, "lost"), kept), "ack": seq}
        return reply, reason
