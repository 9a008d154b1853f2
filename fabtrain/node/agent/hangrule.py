"""The hang rule's reading of progress, pure: when a process last made progress, and why it hangs.

policy.py asks these while it decides; nothing here acts. The rule is the
table in docs/watchdog.md: after its first metrics record only new records
count (only a new step, for records of the launcher's hook); before it any
activity does. A rank the launcher's hook saw working between steps (evaluating,
saving a checkpoint: its records' `busy_at`) made progress then.
"""
from __future__ import annotations


def progress_at(p, ledger) -> float | None:
    """When the process (a policy.ProcFacts) last made progress, by the hang rule.

    After its first metrics record, only new records count. Before it (its
    startup, and a process that never writes metrics) any activity counts:
    a record, log output, CPU time. A pserver waiting in silence for trainers
    (the ledger's `quiet`) made progress while it waited.
    """
    t = p.last_record if p.last_record is not None else p.last_activity
    quiet = dict(ledger.quiet).get(p.name)
    return max(t, quiet) if t is not None and quiet is not None else t


def first_to_stall(procs, ledger, exit_only: tuple, default):
    """The live process, among those watched for hangs, that progressed least recently (`default`: none)."""
    return min((q for q in procs if q.live and q.role not in exit_only and progress_at(q, ledger) is not None),
               key=lambda q: progress_at(q, ledger), default=default)


def hang_reason(p, ledger, timeout: float, now: float) -> str | None:
    """Why the process hangs at `now` under `timeout` (hang_timeout), in words; None while it does not."""
    since = progress_at(p, ledger)
    if since is None:
        return None
    if p.stopped_since is not None and now - min(p.stopped_since, since) >= timeout:
        return "stopped (SIGSTOP) for %.0f s; hang_timeout %g s" % (now - min(p.stopped_since, since), timeout)
    if now - since < timeout:
        return None
    if p.last_record is not None and p.stalled is not None and p.stalled[2] and p.stalled[3]:
        rank, step, _, busy = p.stalled
        return ("no progress for %.0f s: %s did no work since it was last seen %s after step %s (no optimizer "
                "step, no forward pass or batch finished, no byte of a save written; hang_timeout %g s)" % (
                    now - since, "rank %s" % rank if rank is not None else "it", busy, step, timeout))
    if p.last_record is not None and p.stalled is not None and p.stalled[2]:
        rank, step = p.stalled[:2]
        return ("no progress for %.0f s: no new metrics record with a new step from %s%s (after its first "
                "record only a new step counts, for every rank in its metrics; log output and CPU time do "
                "not; hang_timeout %g s)" % (now - since, "rank %s" % rank if rank is not None else "it",
                                              " after step %s" % step if step is not None else "", timeout))
    if p.last_record is not None:
        who = " from rank %s" % p.stalled[0] if p.stalled is not None and p.stalled[0] is not None else ""
        return ("no progress for %.0f s: no new metrics record%s (after its first record only new records "
                "count; log output and CPU time do not; hang_timeout %g s)" % (now - since, who, timeout))
    return "no progress for %.0f s (no metrics record, no log output, no CPU time; hang_timeout %g s)" % (
        now - since, timeout)
