"""The straggler rule, pure: every rank's step rate in, `straggler` findings out.

A rank is a straggler when its step rate stays below `share` of the median
rank's rate for `window` seconds. The median moves with the job, so a whole
job that slows down together has no straggler: only a rank that falls behind
the others does. Each rank is reported once while it stays behind; once it
keeps up again it may be reported again later. Rates come from the metrics
records' ``step`` field (`StepRate`, fed by the agent that reads that rank's
records); the rule itself sees only numbers, so tests check it as data.
"""
from __future__ import annotations

from fabtrain.node.structs import factory, record, replace


@record
class Rule:
    """job.watchdog.straggler's settings (cluster.yaml's config holds the defaults)."""
    share: float
    window: float


@record
class Finding:
    """One rank found behind: what its `straggler` event says."""
    name: str
    node: str
    rate: float
    median: float
    since: float


@record
class Behind:
    """Which ranks are below the share now, since when, and which were already reported."""
    since: dict = factory(dict)  # (node, name) -> first time below
    reported: frozenset = frozenset()


def median(values) -> float:
    xs = sorted(values)
    n = len(xs)
    return (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2.0) if n else 0.0


def judge(rates: dict, behind: Behind, now: float, rule: Rule) -> tuple[list, Behind]:
    """`rates`: {(node, name): steps per second, or None while not yet known}. Fewer than two known
    rates compare nothing; a median of 0 (the job is stalled: the hang rule's business) neither."""
    known = {k: r for k, r in rates.items() if r is not None}
    mid = median(known.values())
    if len(known) < 2 or mid <= 0:
        return [], Behind()
    since, reported, found = {}, set(), []
    for key in sorted(known):
        if known[key] >= rule.share * mid:
            continue
        since[key] = behind.since.get(key, now)
        if key in behind.reported:
            reported.add(key)
        elif now - since[key] >= rule.window:
            reported.add(key)
            found.append(Finding(key[1], key[0], round(known[key], 3), round(mid, 3), since[key]))
    return found, replace(behind, since=since, reported=frozenset(reported))


def standing(rates: dict, behind: Behind) -> list:
    """The ranks reported and still behind, with their rate and the median now: what health.json's
    `stragglers` says (the controller marks these in fab status, fab watch and the dashboard)."""
    known = {k: r for k, r in rates.items() if r is not None}
    mid = median(known.values())
    return [{"node": key[0], "name": key[1], "rate": round(known[key], 3), "median": round(mid, 3),
             "since": round(behind.since[key], 3)}
            for key in sorted(behind.reported) if key in known and key in behind.since]


def rates_of(peers: dict) -> dict:
    """{(node, name): rate} of the running trainers in the beats' process tables ({node: procs})."""
    return {(node, name): p.get("rate") for node, procs in peers.items() for name, p in (procs or {}).items()
            if isinstance(p, dict) and p.get("role") == "trainer" and p.get("state") == "running"
            and (p.get("rate") is None or isinstance(p.get("rate"), (int, float)))}


def rule_of(watchdog: dict) -> Rule | None:
    """job.json's watchdog.straggler (the plan writes it from cluster.yaml), or None: no check."""
    s = watchdog.get("straggler") if isinstance(watchdog, dict) else None
    try:
        return Rule(float(s["share"]), float(s["window"])) if isinstance(s, dict) else None
    except (KeyError, TypeError, ValueError):
        return None


def reason(f: Finding, rule: Rule) -> str:
    return ("%s on %s runs at %.3g steps/s, below %g of the median rank's %.3g steps/s for %g s or more"
            % (f.name, f.node, f.rate, rule.share, f.median, rule.window))


class StepRate:
    """A rank's step rate over the last `window` seconds, from (time, step) samples of its records."""

    def __init__(self, window: float):
        self.window = window
        self.samples: list = []

    def add(self, t: float, step) -> None:
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            return
        if self.samples and step < self.samples[-1][1]:
            self.samples = []  # a restarted program counts anew
        self.samples.append((t, step))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.window:
            self.samples.pop(0)

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None
