"""The rank to blame at a hang, pure: every rank's last step and stack in, the rank(s) the others wait
for out, with the one sentence that says it.

At a hang of a synchronous job every rank stops stepping: the one that got
stuck, and the others that wait for it in a collective. The rank to blame is

1. by the stacks: the rank(s) whose main thread does not wait for the others
   (its innermost frames are not a collective of torch.distributed,
   paddle.distributed, ..., nor torch's backward(), where DDP's and FSDP's
   reducers wait from C++: agent/stacks.py `collective`; a stopped rank,
   which cannot answer, counts as outside) while at least one other rank's
   does;
2. else, when every rank waits but not all in the same place (collective and
   last step) and more than half of them share one, the rank(s) elsewhere:
   a rank that skipped a collective the others entered has gone on to wait
   in another one (or one that entered a collective the others skipped waits
   in it alone);
3. else by the steps: the rank(s) whose last step is behind the others'.

If none tells them apart (every rank waits in a collective, or none does,
at the same step) no rank is named and the sentence says where they all
stand. Ranks come from every node (the beats carry each node's after its
dump), so a rank on another node is named with its node.
"""
from __future__ import annotations

import os

from fabtrain.node.structs import record

CAP = 12  # ranks listed by number in a sentence; more are counted


@record
class RankView:
    """One rank at the hang: where it stood and what it reported last."""
    node: str
    name: str  # the job process it belongs to (trainer-1; a torchrun holds several ranks)
    rank: int | None  # its global rank (None: a process with no RANK)
    step: float | None = None  # its last step reported (None: none)
    frame: str | None = None  # its main thread's top frame, path:line in function
    collective: str | None = None  # the collective its main thread waits in (all_reduce, barrier, ...)
    why: str | None = None  # no stack: why (stopped, not Python, ...)


@record
class Blame:
    ranks: tuple  # the RankViews the others wait for (empty: none stands out)
    waiting: tuple  # the RankViews in a collective (the others')
    sentence: str


def label(r: RankView) -> str:
    return ("rank %d" % r.rank if r.rank is not None else r.name) + " on %s" % r.node


def _numbers(views) -> str:
    ranks = sorted(v.rank for v in views if v.rank is not None)
    named = [str(x) for x in ranks[:CAP]] + ["%d more" % (len(ranks) - CAP)] * (len(ranks) > CAP)
    others = sorted("%s on %s" % (v.name, v.node) for v in views if v.rank is None)
    word = "ranks" if len(ranks) > 1 else "rank"
    return ", ".join(([word + " " + ", ".join(named)] if ranks else []) + others)


def short(frame: str | None) -> str | None:
    """``/long/path/loader.py:88 in __getitem__`` -> ``loader.py:88 in __getitem__``."""
    if not frame:
        return frame
    path, sep, rest = frame.partition(":")
    return os.path.basename(path) + sep + rest


def _step(step) -> str:
    return "%d" % step if isinstance(step, (int, float)) and float(step).is_integer() else str(step)


def stood(r: RankView) -> str:
    """What a blamed rank did: where it stopped stepping."""
    at = " at step %s" % _step(r.step) if r.step is not None else " before its first step"
    if r.why and "stopped" in r.why:
        return "%s is stopped%s (%s)" % (label(r), at, r.why.split(" is ", 1)[-1].replace(" and cannot answer", ""))
    where = " in `%s`" % short(r.frame) if r.frame else " (%s)" % r.why if r.why else ""
    return "%s stopped stepping%s%s" % (label(r), at, where)


def apart(r: RankView) -> str:
    """What a blamed rank that waits elsewhere than most ranks did."""
    at = " at step %s" % _step(r.step) if r.step is not None else " before its first step"
    where = " (`%s`)" % short(r.frame) if r.frame else ""
    return "%s stopped stepping%s waiting in %s, where the others are not%s" % (label(r), at, r.collective, where)


def waits(views) -> str:
    """"ranks 0, 1, 3 wait in all_reduce" (grouped by collective)."""
    by: dict = {}
    for v in views:
        by.setdefault(v.collective, []).append(v)
    parts = []
    for coll in sorted(by, key=lambda c: (-len(by[c]), c)):
        text = _numbers(by[coll])
        verb = "waits" if len(by[coll]) == 1 and not text.startswith("ranks") else "wait"
        parts.append("%s %s in %s" % (text, verb, coll))
    return ", ".join(parts)


def judge(views) -> Blame:
    views = sorted(views, key=lambda v: (v.rank is None, v.rank if v.rank is not None else 0, v.node, v.name))
    if not views:
        return Blame((), (), "")
    inside = [v for v in views if v.collective]
    outside = [v for v in views if not v.collective and (v.frame or (v.why and "stopped" in v.why))]
    if inside and outside:
        return Blame(tuple(outside), tuple(inside), "; ".join([s for s in map(stood, outside)] + [waits(inside)]))
    if len(inside) == len(views):
        places: dict = {}
        for v in views:
            places.setdefault((v.collective, v.step), []).append(v)
        most = max(places.values(), key=len)
        if len(places) > 1 and 2 * len(most) > len(views):
            elsewhere = [v for group in places.values() if group is not most for v in group]
            elsewhere.sort(key=lambda v: (v.rank is None, v.rank if v.rank is not None else 0, v.node, v.name))
            rest = waits(most) + (" at step %s" % _step(most[0].step) if any(v.step != most[0].step for v in elsewhere)
                                  and most[0].step is not None else "")
            return Blame(tuple(elsewhere), tuple(most), "; ".join([apart(v) for v in elsewhere] + [rest]))
    stepped = [v for v in views if v.step is not None]
    if len(stepped) > 1:
        low = min(v.step for v in stepped)
        behind = [v for v in stepped if v.step == low]
        if len(behind) < len(stepped):
            ahead = [v for v in stepped if v.step != low]
            rest = waits(ahead) if all(v.collective for v in ahead) else \
                "%s reached step %s" % (_numbers(ahead), _step(max(v.step for v in ahead)))
            return Blame(tuple(behind), tuple(v for v in ahead if v.collective),
                         "; ".join([stood(v) for v in behind] + [rest]))
    steps = sorted({_step(v.step) for v in stepped})
    at = " at step %s" % "/".join(steps) if steps else ""
    if inside and len(inside) == len(views):
        return Blame((), tuple(inside), "no rank stands out: %s%s" % (waits(inside), at))
    return Blame((), tuple(inside), "no rank stands out: %s stopped stepping%s" % (_numbers(views), at))


def views_of(node: str, stacks: dict, steps: dict) -> list:
    """This node's RankViews from a dump's result ({name: {"ranks": [{pid, rank, frame, collective, why}]}})
    and each process's ranks' last steps ({name: {rank or None: step}})."""
    out = []
    for name in sorted(stacks):
        ranks = (stacks[name] or {}).get("ranks") or []
        known = steps.get(name) or {}
        for r in ranks:
            rank = r.get("rank")
            step = known.get(rank, known.get(None) if len(ranks) == 1 else None)
            out.append(RankView(node, name, rank, step, r.get("frame"), r.get("collective"), r.get("why")))
    return out


def to_beat(views) -> list:
    """RankViews as the beat carries them (compact lists)."""
    return [[v.name, v.rank, v.step, v.frame, v.collective, v.why] for v in views]


def from_beat(node: str, rows) -> list:
    """A beat's rows back into RankViews (malformed rows are left out)."""
    out = []
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, list) or len(row) != 6 or not isinstance(row[0], str):
            continue
        name, rank, step, frame, coll, why = row
        out.append(RankView(node, name, rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
                            step if isinstance(step, (int, float)) and not isinstance(step, bool) else None,
                            frame if isinstance(frame, str) else None, coll if isinstance(coll, str) else None,
                            why if isinstance(why, str) else None))
    return out
