"""The straggler rules, pure: every rank's step rate, or its timings, in; `straggler` findings out.

A rank is a straggler when its step rate stays below `share` of the median
rank's rate for `window` seconds. The median moves with the job, so a whole
job that slows down together has no straggler: only a rank that falls behind
the others does. Each rank is reported once while it stays behind; once it
keeps up again it may be reported again later. Rates come from the metrics
records' ``step`` field (`StepRate`, fed by the agent that reads that rank's
records); the rule itself sees only numbers, so tests check it as data.

In synchronous training (DDP) every rank steps at the slowest one's pace, so
rates cannot tell: `judge_timings` names the rank the others wait for from
each rank's time a step in data loading, compute and collectives (the
records' ``data_time``, ``compute_time``, ``comm_time``), and, where the
ranks spend their steps in collectives, from the TCP send backlog of each
rank (the agents' samples): the rank whose link does not keep up.
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


# -- synchronous training: who makes the others wait, and why ------------------------------------------

CAUSES = (("data_time", "data loading"), ("compute_time", "compute"))
MIN_EXCESS = 0.1  # of the median step time: less extra time a step than this is noise, not a straggler
# Communication: another rank spends at least COMM_BOUND of its step in collectives (it waits there), and one
# rank's sends are backed up (data written and not yet acknowledged) in at least BACKED_UP of the
# samples, while the median other rank's are in at most LINK_SHARE of that. Its ratio is over the median's share,
# taken as at least MIN_SHARE (the samples cannot tell less). A rank that spends under COMM_WAITS of its step in
# collectives waits for nobody: where it is also the one the others wait for by its compute or data loading, it
# is named for that, not the link of a rank it reads late from.
# A rank that holds bytes received and unread in under UNREAD of the samples reads what it is sent as it comes:
# it waits for its data, whatever the hook's split of its step says.
COMM_BOUND = 0.5
COMM_WAITS = 0.25
UNREAD = 0.5
BACKED_UP = 0.75
LINK_SHARE = 0.5
MIN_SHARE = 0.05


def step_of(t: dict) -> float:
    """A rank's step time: the record's, else the sum of its parts."""
    return t.get("step_time") or sum(t.get(f) or 0.0 for f in ("data_time", "compute_time", "comm_time"))


def comm_share(t: dict) -> float:
    """The share of a rank's step (its mean timings) spent in collectives; 0 where not known."""
    comm, step = t.get("comm_time"), step_of(t)
    return comm / step if isinstance(comm, (int, float)) and not isinstance(comm, bool) and step > 0 else 0.0


def in_collectives(t: dict) -> bool:
    """A rank's mean timings have some time in collectives: it is one of several ranks, and the agent samples
    its sends. Not a share of its step: the hook's split of a step is not exact, and under a capped link
    most of the capped rank's own wait can count as its compute (the rank the others wait for looks, by its
    timings, like one that computes long); its send backlog tells the two apart."""
    return comm_share(t) > 0


@record
class Cause:
    """One rank that makes the others wait in their collectives: what its `straggler` event says."""
    node: str
    name: str
    rank: int | None
    cause: str  # "data loading", "compute" or "communication"
    ratio: float  # its time for the cause over the median rank's (communication: its backed-up share over the median's)
    seconds: float  # its time for the cause a step (mean over the window; communication: its comm_time)
    median: float  # the median rank's
    since: float
    backed_up: float | None = None  # communication: the share of samples its sends were backed up in
    backlog: float | None = None  # ... its mean send backlog, bytes
    others: float | None = None  # ... the median other rank's backed-up share
    comm_share: float | None = None  # ... the share of its step in collectives


def judge_timings(timings: dict, behind: Behind, now: float, rule: Rule) -> tuple[list, Behind]:
    """`timings`: {(node, name, rank): {"data_time", "compute_time", "comm_time", "step_time"}} (each a
    mean a step over the last seconds). In synchronous training every rank steps at the slowest one's
    pace, so rates tell nothing; the one that makes the others wait arrives last at the collective:
    it waits there least (the least comm_time), and its data loading or compute is far above the
    median of the other ranks' (at least 1/share of it, and by at least MIN_EXCESS of the median step time), while
    the others wait in comm about that much longer than it. A job whose ranks are equally slow has
    none. Where the job is comm-bound and one rank's sends stay backed up while the others' drain
    (`link_suspect`), that rank is named for its communication, first (`suspect`). Reported after
    `window` seconds, once while it lasts, as `judge` does; the same rank found for another cause (its
    compute, then its link) is a new finding."""
    known = {k: t for k, t in timings.items() if all(isinstance(t.get(f), (int, float)) for f, _ in CAUSES)
             and isinstance(t.get("comm_time"), (int, float))}
    if len(known) < 2:
        return [], Behind()
    found_now = suspect(known, rule)
    since, reported, found = {}, set(), []
    if found_now is not None:
        key, cause, ratio, seconds, mid, link = found_now
        held = key + (cause,)  # (node, name, rank, cause)
        since[held] = behind.since.get(held, now)
        if held in behind.reported:
            reported.add(held)
        elif now - since[held] >= rule.window:
            reported.add(held)
            found.append(Cause(key[0], key[1], key[2], cause, round(ratio, 2), round(seconds, 4), round(mid, 4),
                               since[held], **link))
    return found, replace(behind, since=since, reported=frozenset(reported))


def suspect(known: dict, rule: Rule):
    """(key, cause, ratio, its seconds, the median's, {communication's figures}) of the rank that makes the
    others wait, or None. A link that backs up (`link_suspect`) is what the step waits for: its sends are
    pending for at least BACKED_UP of the step. The rank the timings name (`timing_suspect`) is named instead
    only where it waits in its collectives for under COMM_WAITS of its step, and is not the backed-up rank:
    a rank busy elsewhere reads late what its neighbour sends it, and backs up that neighbour's link. (The
    backed-up rank itself often looks, by the hook's split, like a rank that computes long: the wait for its
    own sends counted as compute. Where ranks share a machine's CPUs, one starved of CPU for a while that still
    waits in its collectives leaves the capped link named.)"""
    link = link_suspect(known)
    timing = timing_suspect(known, rule)
    if link is not None and (timing is None or timing[0] == link[0] or comm_share(known[timing[0]]) >= COMM_WAITS
                             or reads_as_it_comes(known[timing[0]])):
        return link
    return timing


def reads_as_it_comes(t: dict) -> bool:
    """Its sockets held bytes received and unread in under UNREAD of the samples: it waits for what it is sent
    (a rank busy elsewhere leaves it unread). Under a capped link the hook may count the wait of the rank that
    receives from it as that rank's compute (seen: 0.5 s of a 0.6 s step); its sockets tell. Unknown (an
    older agent's rows): False."""
    unread = t.get("unread")
    return isinstance(unread, (int, float)) and not isinstance(unread, bool) and unread < UNREAD


def timing_suspect(known: dict, rule: Rule):
    """The rank the others wait for by its data loading or compute, from the timings alone (see judge_timings)."""
    key = min(known, key=lambda k: (known[k]["comm_time"], k[0], k[1], k[2] if k[2] is not None else -1))
    mine = known[key]
    step = median(t.get("step_time") or sum(t[f] for f, _ in CAUSES) + t["comm_time"] for t in known.values())
    others_comm = median(t["comm_time"] for k, t in known.items() if k != key)
    best = None
    for field, cause in CAUSES:
        mid = median(t[field] for k, t in known.items() if k != key)  # the others' (with two ranks, the other's)
        excess = mine[field] - mid
        if excess < MIN_EXCESS * step or mine[field] * rule.share < mid or others_comm - mine["comm_time"] < excess / 2:
            continue
        ratio = mine[field] / mid if mid > 0 else float("inf")
        if best is None or excess > best[0]:
            best = (excess, cause, ratio, mine[field], mid)
    if best is None:
        return None
    return key, best[1], min(best[2], 999.0), best[3], best[4], {}


def link_suspect(known: dict):
    """Communication: in a ring all-reduce every rank waits in its collectives alike, so comm_time cannot
    tell which link is slow; its sends can. The rank whose link does not keep up keeps data written and
    unacknowledged through the whole collective; the others' drain at once. Named when every rank's backlog
    was sampled (`backlog`: the share of samples with one), the most backed-up rank's share is at least
    BACKED_UP while the median other rank's is at most LINK_SHARE of it, and another rank waits in its
    collectives for at least COMM_BOUND of its step. Neither its own share of collectives nor all the
    others' is asked: the hook may count a wait for the link as compute, its own or its receiver's. (A rank that does not read what it is sent, busy elsewhere,
    backs up its sender's link too; `suspect` names that rank instead.)"""
    if len(known) < 2 or any(not isinstance(t.get("backlog"), (int, float)) for t in known.values()):
        return None
    key = max(known, key=lambda k: (known[k]["backlog"], known[k].get("backlog_bytes") or 0, str(k)))
    mine = known[key]
    others = median(t["backlog"] for k, t in known.items() if k != key)
    if mine["backlog"] < BACKED_UP or others > LINK_SHARE * mine["backlog"] or \
            max(comm_share(t) for k, t in known.items() if k != key) < COMM_BOUND:
        return None
    ratio = mine["backlog"] / max(others, MIN_SHARE)
    comm = median(t["comm_time"] for k, t in known.items() if k != key)
    return key, "communication", ratio, mine["comm_time"], comm, {
        "backed_up": round(mine["backlog"], 2), "backlog": round(mine.get("backlog_bytes") or 0.0),
        "others": round(others, 2), "comm_share": round(comm_share(mine), 2)}


def size(n: float) -> str:
    """Bytes as a person reads them: 850 B, 213 kB, 4.2 MB."""
    return "%d B" % n if n < 1000 else "%.3g kB" % (n / 1e3) if n < 1e6 else "%.3g MB" % (n / 1e6)


def cause_reason(c: Cause) -> str:
    """The one sentence: "rank 1 on node2: data loading 4.2x the median"."""
    who = "rank %s" % c.rank if c.rank is not None else c.name
    if c.cause == "communication":
        return ("%s on %s: communication, its sends back up (data waiting to go out in %d%% of the samples, %s on "
                "average, vs %d%% for the median rank) while collectives take %d%% of its step; the other ranks "
                "wait for it in their collectives"
                % (who, c.node, round(100 * (c.backed_up or 0)), size(c.backlog or 0), round(100 * (c.others or 0)),
                   round(100 * (c.comm_share or 0))))
    return ("%s on %s: %s %.1fx the median (%.3g s a step vs %.3g s); the other ranks wait for it in their collectives"
            % (who, c.node, c.cause, c.ratio, c.seconds, c.median))


def timings_of(peers: dict) -> dict:
    """{(node, name, rank): timings} of the running trainers' ranks in the beats' process tables; a rank
    whose agent sampled its sockets (the beat's `sendq` rows: [rank, share backed up, mean bytes, share with
    bytes unread]; a beat of an agent that does not sample has none; an older agent's rows have 3 elements)
    also has `backlog` (the share), `backlog_bytes` and, from a 4-element row, `unread`."""
    out = {}
    for node, procs in peers.items():
        for name, p in (procs or {}).items():
            if not isinstance(p, dict) or p.get("role") != "trainer" or p.get("state") != "running":
                continue
            for row in p.get("timing") or []:
                if isinstance(row, list) and len(row) == 5:
                    rank, data, compute, comm, step = row
                    out[(node, name, rank if isinstance(rank, int) else None)] = {
                        "data_time": data, "compute_time": compute, "comm_time": comm, "step_time": step}
            for row in p.get("sendq") or []:
                if isinstance(row, list) and len(row) in (3, 4) and isinstance(row[0], int) and \
                        all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row[1:]) and \
                        (node, name, row[0]) in out:
                    out[(node, name, row[0])].update(backlog=row[1], backlog_bytes=row[2])
                    if len(row) == 4:
                        out[(node, name, row[0])]["unread"] = row[3]
    return out


def standing_timings(timings: dict, behind: Behind, rule: Rule) -> list:
    """The rank reported by `judge_timings` while it still makes the others wait (health.json's
    `stragglers`, as `standing` for rates)."""
    known = {k: t for k, t in timings.items() if all(isinstance(t.get(f), (int, float)) for f, _ in CAUSES)
             and isinstance(t.get("comm_time"), (int, float))}
    now = suspect(known, rule) if len(known) >= 2 else None
    held = now[0] + (now[1],) if now is not None else None
    if now is None or held not in behind.reported or held not in behind.since:
        return []
    (node, name, rank), cause, ratio, seconds, mid, _ = now
    return [{"node": node, "name": name, "rank": rank, "cause": cause, "ratio": round(ratio, 2),
             "seconds": round(seconds, 4), "median": round(mid, 4), "since": round(behind.since[held], 3)}]


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
