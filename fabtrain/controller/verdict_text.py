"""The job's verdict in words: the one sentence `fab status` prints and the dashboard's banner shows.

State first, then the first cause (the process and its node, as the agents
said it), then what fabtrain did about it or is waiting for, with the time
left where a timer runs (the startup allowance, a restart's backoff). Both
outputs call `sentence`, so they say the same words; the facts come from
`jobstate.job_verdict`.
"""
from __future__ import annotations

from fabtrain.controller.jobstate import RESTARTING_AFTER, JobState, Verdict


def duration_text(seconds: float) -> str:
    """7 -> "7s", 560 -> "9m 20s", 7500 -> "2h 05m" (never below 0)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def _restarting(v: Verdict, now: float) -> str:
    cause = v.reason.removeprefix(RESTARTING_AFTER)
    when = ""
    if v.restart_at is not None:
        left = v.restart_at - now
        when = f"generation {v.generation} starts in {duration_text(left)}" if left >= 0.5 \
            else f"generation {v.generation} is starting"
    if v.restarts_left is not None:
        more = f"{v.restarts_left} restart{'s' if v.restarts_left != 1 else ''} left after it"
        when = f"{when}, {more}" if when else more
    cause = f"{cause} ({v.blame})" if v.blame else cause
    return f"JOB RESTARTING after {cause}" + (f": {when}" if when else "")


def _starting(v: Verdict, now: float) -> str:
    text = f"job starting: {v.reason}"
    if v.startup_deadline is not None:
        text += f"; startup_timeout fails the start in {duration_text(v.startup_deadline - now)} if it does not come together"
    return text


def _running(v: Verdict) -> str:
    live = [p for p in v.processes if p.live]
    nodes = sorted({p.node for p in live})
    text = f"job running: {len(live)} of {len(v.processes)} processes on {len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    return text + (f" ({v.restarts})" if v.restarts else "")


def sentence(v: Verdict, now: float) -> str:
    """The verdict as one line (`now`: the nodes' clock, for the time left on a timer)."""
    said = f"  [{', '.join(v.said_by)}]" if v.said_by else ""
    if v.state == JobState.FAILED:
        text = f"JOB FAILED: {v.summary()}{said}"
    elif v.state == JobState.FINISHED:
        text = f"job finished: {v.reason}{said}"
    elif v.state == JobState.RESTARTING:
        text = _restarting(v, now)
    elif v.state == JobState.KILLED:
        text = f"job killed: {v.reason}"
    elif v.state == JobState.STARTING:
        text = _starting(v, now)
    elif v.state == JobState.RUNNING:
        text = _running(v)
    elif v.state == JobState.UNKNOWN:
        return f"job state unknown: {v.reason}"
    else:
        return v.reason or str(v.state)
    if v.left and v.state in (JobState.RUNNING, JobState.RESTARTING, JobState.STARTING):
        text += f"; without {', '.join(v.left)} (left the job: min_nodes), WORLD_SIZE {v.world_size}"
    if v.back:
        text += f"; {v.back}"
    if v.spares and v.state in (JobState.RUNNING, JobState.RESTARTING, JobState.STARTING):
        text += "".join(f"; {spare} (spare) in {slot}'s place" if slot else f"; {spare} spare (idle)"
                        for spare, slot in v.spares)
    if v.unreachable:
        text += f"; not reached: {', '.join(v.unreachable)} (what runs there is not seen)"
    return text
