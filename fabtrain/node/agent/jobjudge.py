"""The agent's judgements over ranks: the rank to blame after a hang, and the stragglers.

Every agent keeps its own ranks' last steps and stacks at its dump of stacks
(a hang's), which its beats carry, and names the rank to blame among them. The
coordinator's node also judges for the whole job, from what every node's beats
carry: the rank(s) the others wait for after a hang (one `blame` event), and,
once an interval, the straggler rules over every rank's step rate and, in synchronous training, its
timings and send backlog. The loop
(loop.py) calls these and puts what they keep into health.json and the beats;
the rules themselves are coordination/blame.py's and coordination/stragglers.py's.
"""
from __future__ import annotations

from fabtrain.contract.events import EventKind
from fabtrain.contract.states import JobState
from fabtrain.node.coordination import blame, stragglers

from . import policy

BLAME_WAIT = 3.0  # s the coordinator's agent waits, after a hang, for every node's ranks before naming one


def rank_steps(contexts) -> dict:
    """{name: {rank or None: its last step}} of this node's processes, from their metrics records."""
    return {ctx.name: {k: r.step for k, r in ctx.progress.ranks.items()} for ctx in contexts
            if ctx.progress is not None}


class JobJudge:
    def __init__(self, node: str, watchdog, events):
        self.node, self.events = node, events
        self.straggler_rule = stragglers.rule_of(watchdog)
        self.behind = stragglers.Behind()
        self.waited_for = stragglers.Behind()  # the synchronous rule's (by timings)
        self.straggling: list = []  # the ranks reported and still behind (health.json's `stragglers`)
        self.rank_views: list = []  # this node's ranks at its last dump of stacks (the beats carry them)
        self.local_blame: dict | None = None  # {"text": the rank to blame, "job": named from every node's ranks}
        self.blame_since: float | None = None
        self.blame_done = False

    def new_generation(self) -> None:
        """A restart: nothing of the last generation's ranks is kept."""
        self.rank_views, self.local_blame, self.blame_since, self.blame_done = [], None, None, False

    def dumped(self, frames: dict, contexts) -> None:
        """This node just dumped its processes' stacks: its ranks' views, for the beats."""
        self.rank_views = blame.views_of(self.node, frames, rank_steps(contexts))

    def blame_here(self) -> str | None:
        """The rank to blame among this node's ranks (its hang event says it)."""
        found = blame.judge(self.rank_views)
        self.local_blame = {"text": found.sentence, "job": False} if found.sentence else None
        return found.sentence

    def check_blame(self, co, ledger: policy.Ledger, now: float, waiting: bool = True) -> None:
        """On the coordinator's node (`co`), after a hang anywhere: once every node that ran trainers has
        sent its ranks' last steps and stacks (its beat after its dump), or BLAME_WAIT after the hang was
        known here, name the rank(s) the others wait for, job-wide, in one `blame` event. Not `waiting`
        (the job's end): whatever came in is all there is."""
        st = ledger.status
        if not waiting:
            self.blame_since = -BLAME_WAIT
        if co is None or self.blame_done or policy.HUNG not in (st.reason or "") or \
                st.status not in (JobState.FAILED, JobState.RESTARTING):
            return
        self.blame_since = self.blame_since or now
        with co.lock:
            tables = {node: dict(peer.procs) for node, peer in co.board.peers.items() if node not in co.board.out}
        views, missing = [], []
        for node, procs in sorted(tables.items()):
            rows = [row for p in procs.values() if isinstance(p, dict) for row in (p.get("ranks") or [])]
            if rows:
                views += blame.from_beat(node, rows)
            elif any(isinstance(p, dict) and p.get("role") == "trainer" for p in procs.values()):
                missing.append(node)
        if missing and now - self.blame_since < BLAME_WAIT:
            return
        self.blame_done = True
        found = blame.judge(views)
        if not found.sentence:
            return
        self.local_blame = {"text": found.sentence, "job": True}
        first = found.ranks[0] if found.ranks else None
        self.events.write(EventKind.BLAME, found.sentence + (" (no stacks from %s)" % ", ".join(missing) if missing else ""),
                          first.name if first else None, origin=first.node if first else None,
                          rank=first.rank if first else None, step=first.step if first else None,
                          frame=first.frame if first else None, ranks=len(views),
                          generation=ledger.generation)

    def check_stragglers(self, co, status: str, now: float) -> None:
        """On the coordinator's node (`co`), once an interval while the job's `status` is running: the
        straggler rule over every node's step rates, which the beats carry (the coordinator itself does
        no more work a beat)."""
        if co is None or self.straggler_rule is None or status != JobState.RUNNING:
            self.straggling = []
            return
        with co.lock:
            tables = {node: peer.procs for node, peer in co.board.peers.items()}
        rates = stragglers.rates_of(tables)
        found, self.behind = stragglers.judge(rates, self.behind, now, self.straggler_rule)
        timings = stragglers.timings_of(tables)
        causes, self.waited_for = stragglers.judge_timings(timings, self.waited_for, now, self.straggler_rule)
        self.straggling = stragglers.standing_timings(timings, self.waited_for, self.straggler_rule) + \
            stragglers.standing(rates, self.behind)
        for c in causes:
            link = {"backed_up": c.backed_up, "backlog": c.backlog} if c.backed_up is not None else {}
            self.events.write(EventKind.STRAGGLER, stragglers.cause_reason(c), c.name, role="trainer", rank=c.rank,
                              origin=c.node, cause=c.cause, ratio=c.ratio, seconds=c.seconds, median=c.median, **link)
        for f in found:
            p = tables.get(f.node, {}).get(f.name, {})
            self.events.write(EventKind.STRAGGLER, stragglers.reason(f, self.straggler_rule), f.name, role=p.get("role"),
                              rank=p.get("rank"), origin=f.node, rate=f.rate, median=f.median)
