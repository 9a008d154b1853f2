"""The agent's side of the dead-man: the moment by which it would have begun its fence, published for the
launchers of its node's job processes (node/launch.py reads it; coordination/fence.py says why it is enough).

A node's agent fences its node when its lease runs out (coordination/fence.py), and the coordinator
starts a generation without a lost node only `fence_wait` after it last heard it. That holds only while
the agent runs: an agent stopped (SIGSTOP) or frozen ends nothing. So in a job whose agents fence
(the plan gives the job's launchers `--deadline`, contract/launcher.py), the agent writes into the job's
run folder (`run/deadline`, JobFolder.deadline) the moment, on CLOCK_MONOTONIC (system-wide: the launchers'
clock too), by which it would have begun its fence had nothing more come:

- its lease (the newest beat or pulse the coordinator answered) + `fence_after` + `fence_slack`, the
  moment the fence argument already allows a running agent to begin its teardown by;
- where its node hosts the coordinator of a job that elects, no later than its term's step-down (its
  tenure: the newest moment a strict majority, itself included, echoed within the lease, + the lease)
  + `fence_slack`;
- while its connection is open, or it has no lease (a new coordinator followed), no sooner than `hold`
  from now: a running agent does not fence on an open connection whose coordinator is merely late
  (hung_timeout), so it vouches for its programs itself; `hold` is what the lease gives in the steady
  state (a lease at most an interval old), so the file moves with the lease there.

It is rewritten (atomically, not fsync'ed: a machine that crashes takes the launchers with it) when the
moment moves earlier, or later once it has passed, and at most once a second when it moves later otherwise;
removed when the agent ends on purpose.
Nothing is written before the agent's first lease: the agent does not fence before it either.
"""
from __future__ import annotations

import os

from fabtrain.contract.launcher import DEADLINE_FLAG, deadline_text, read_deadline
from fabtrain.node import atomic
from fabtrain.node.coordination import fence
from fabtrain.node.coordination.election import majority

PERIOD = 1.0  # seconds between two rewrites that move the deadline later (one that moves it earlier: at once)


def wanted(job: dict) -> bool:
    """Whether this node's launchers read a deadline (the plan gave them `--deadline`): only then is one written."""
    return any(DEADLINE_FLAG in (p.get("launch") or []) for p in job.get("processes") or [])


def hold(interval: float) -> float:
    """How far ahead a running agent vouches for its programs: the lease's own deadline when the lease is an
    interval old, the steady state's oldest."""
    return fence.fence_after(interval) + fence.fence_slack(interval) - interval


def step_down_at(heard: dict, nodes: tuple, me: str, lease: float) -> float | None:
    """When a coordinator whose majority echoed at `heard` (node -> monotonic) steps down if nothing more comes:
    the newest moment a strict majority, itself included, was heard, + the lease (election.Lease.holds);
    None before a majority was heard (it does not count yet)."""
    others = sorted((t for n, t in heard.items() if n != me and n in nodes), reverse=True)
    need = majority(len(nodes)) - 1
    if need < 1 or len(others) < need:
        return None
    return others[need - 1] + lease


def tenure_step_down(co) -> float | None:
    """step_down_at of the coordinator this node hosts, where it holds an elected term (tenure.py); else None."""
    tenure = getattr(co, "tenure", None) if co is not None else None
    if tenure is None or tenure.stepped_down is not None or tenure.lease.superseded is not None:
        return None  # none, or it steps down now: its agent fences at once, and the client's lease bounds the rest
    lease = tenure.lease
    return step_down_at(dict(lease.heard), lease.nodes, lease.me, lease.lease)


def fence_deadline(now: float, lease: float | None, connected: bool, interval: float,
                   step_down: float | None = None) -> float:
    """The moment by which this agent would have begun its fence had nothing more come (the module's docstring)."""
    slack = fence.fence_slack(interval)
    at = lease + fence.fence_after(interval) + slack if lease is not None else now + hold(interval)
    if connected or lease is None:
        at = max(at, now + hold(interval))
    if step_down is not None:
        at = min(at, step_down + slack)
    return at


class Deadline:
    """run/deadline, as this agent writes it."""

    def __init__(self, path: str, grace: float):
        self.path, self.grace = path, grace
        self.at: float | None = None  # the deadline written last
        self.written = float("-inf")  # when (monotonic)
        try:  # an earlier agent's (this one was restarted by its keeper): this one renews it from its first step
            with open(path) as f:
                self.at = (read_deadline(f.read(200)) or (None,))[0]
        except (OSError, UnicodeDecodeError):
            pass

    def update(self, now: float, lease: float | None, connected: bool, interval: float, co=None) -> None:
        """From the link's lease and connection (and the coordinator it hosts): write the deadline if it moved."""
        if lease is None and self.at is None:
            return  # no lease yet: the agent does not fence either
        at = fence_deadline(now, lease, connected, interval, tenure_step_down(co))
        # Later at most once a second; but one that passed (a fence just ended, this node taken back) at once
        if self.at is not None and (abs(at - self.at) < 0.01 or (now < self.at < at and now - self.written < PERIOD)):
            return
        try:
            atomic.write(self.path, deadline_text(at, self.grace), durable=False)
        except OSError:
            return  # a full disk: the launchers keep the last one (the agent still runs and fences itself)
        self.at, self.written = at, now

    def clear(self) -> None:
        """The agent ends on purpose: no dead-man after it (nothing of the job runs here, or it was told to stop)."""
        if self.at is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.at = None
