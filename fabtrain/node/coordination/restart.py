"""The restart policy (`job.watchdog.on_failure: restart`), pure: a failure and a generation in, a decision out.

The coordinator's board asks it once per failure of the job's current
generation; tests/test_restart_policy.py checks it with no process. A failure
is what an agent's beat carries: ``{"reason", "generation", "kind",
"exit_code"}``, where kind is ``exit`` (a process ended non-zero or by a
signal), ``hang`` (the agent stopped a hung process), ``lost`` (its platform
took the node: a pod evicted, node/hosted.py) or anything else (a node gone
silent, a start that never joined, ``fab kill-all``, a relaunch that could not
start): only the first three are restarted. With ``min_nodes`` (elastic.py) a
node that left (kind ``left``) restarts the job too, on the nodes that are left,
and one that is back (``rejoin``, the board's) restarts it on the larger world.
Two generations in a row failing soon after loading one checkpoint file stop
the restarts (a damaged checkpoint fails every restart the same way), or, with
``on_bad_checkpoint: previous``, restart once more pointing the next generation
at the checkpoint saved before that file (the Decision's ``resume``: the
board's status carries it, the agents give it as FABTRAIN_RESUME_FROM).
"""
from __future__ import annotations

from fabtrain.contract import checkpoints as words
from fabtrain.contract.states import RESTARTABLE, FailureKind
from fabtrain.node.structs import record

from . import fence
from .elastic import Layout

BACKOFF_CAP = 300.0  # the doubling stops here (or at restart_backoff, if that is larger)
# The board's own kind (min_nodes): a node that left is back; the next generation takes it in. A new
# generation like any restart (its own MASTER_PORT, in the range checked at start): it counts against max_restarts.
REJOIN = "rejoin"
START_WINDOW = 15.0  # after backoff + teardown, how long every node has to report its part started


@record
class Decision:
    restart: bool
    generation: int  # the generation to start (restart), else the current one
    backoff: float = 0.0
    why_not: str | None = None  # why a failure under on_failure restart is not restarted
    damaged: bool = False  # not restarted: two generations in a row failed soon after loading one checkpoint
    # on_bad_checkpoint previous: what the restarted generation resumes from instead of the damaged file:
    # {generation, path, step, instead_of, failed: [g-1, g], after, text} (the board's status `resume_from`)
    resume: dict | None = None

    def failed(self, cause: str) -> str:
        """The job's reason when it is not restarted: `<cause>; not restarted: <why>`, or for a damaged
        checkpoint `<cause>; generation 2 and 3 failed 4 s after loading ...: the checkpoint may be damaged;
        not restarted` (its why_not may say more before `; not restarted`: no checkpoint before it)."""
        if self.damaged:
            return "%s; %s; not restarted" % (cause, self.why_not)
        return cause + ("; not restarted: %s" % self.why_not if self.why_not else "")

    def restarting(self, cause: str) -> str:
        """The job's reason while it restarts: the cause, and where it falls back to (on_bad_checkpoint)."""
        return "%s; %s" % (cause, self.resume["text"]) if self.resume else cause


@record
class RestartPolicy:
    """No defaults here: cluster.yaml's config holds the only copy, and job.json carries every setting."""
    enabled: bool  # on_failure is restart
    max_restarts: int
    backoff: float
    exit_codes: tuple | None  # None: any exit code
    grace: float  # the teardown's SIGTERM -> SIGKILL, before a node can start again
    layout: Layout | None = None  # with min_nodes: the job's nodes, to go on without a lost one
    fence_wait: float = 0.0  # a lost node's silence before a generation without it starts (fence.py)
    on_bad_checkpoint: str = words.ON_BAD_CHECKPOINT[0]  # stop, or previous: fall back to the checkpoint before
    max_rejoins: int = 0  # min_nodes: times one node that left may come back into the job (board.py, REJOIN)

    @classmethod
    def never(cls) -> RestartPolicy:
        """A job that is not restarted (on_failure kill-job or keep)."""
        return cls(enabled=False, max_restarts=0, backoff=0.0, exit_codes=None, grace=0.0)

    @classmethod
    def from_watchdog(cls, w: dict, job: dict | None = None) -> RestartPolicy:
        """From job.json's `watchdog` (the plan's copy of cluster.yaml's job.watchdog) and, for
        min_nodes, the job's `nodes` and `trainers`, strictly: KeyError, TypeError or ValueError
        where a setting is missing or malformed."""
        codes, enabled, min_nodes = w["restart_on_exit_codes"], w["on_failure"] == "restart", w["min_nodes"]
        layout = None
        if enabled and min_nodes is not None and job is not None:
            layout = Layout.from_job(min_nodes, job["nodes"], job["trainers"], w.get("ranks_per_trainer", 1))
        # on_bad_checkpoint: in job.json only where it is not the default (job.json before it has none)
        bad = w.get("on_bad_checkpoint", words.ON_BAD_CHECKPOINT[0])
        if bad not in words.ON_BAD_CHECKPOINT:
            raise ValueError("on_bad_checkpoint must be one of %s, got %r" % (", ".join(words.ON_BAD_CHECKPOINT), bad))
        return cls(enabled=enabled, max_restarts=int(w["max_restarts"]),
                   backoff=float(w["restart_backoff"]),
                   exit_codes=tuple(int(c) for c in codes) if codes is not None else None,
                   grace=float(w["grace"]), layout=layout,
                   fence_wait=fence.fence_wait(float(w["interval"]), float(w["grace"])), on_bad_checkpoint=bad,
                   max_rejoins=int(w.get("max_rejoins", 0)) if layout is not None else 0)  # an older job.json: 0

    def backoff_for(self, generation: int) -> float:
        """Seconds before generation g (1, 2, ...) starts: restart_backoff, doubled each time, capped."""
        return min(self.backoff * 2 ** max(0, generation - 1), max(BACKOFF_CAP, self.backoff))

    def restarts_left(self, generation: int) -> int:
        return max(0, self.max_restarts - generation) if self.enabled else 0

    def start_deadline(self, generation: int) -> float:
        """Seconds from the decision until every node must have started its part of generation g."""
        return self.backoff_for(generation) + self.grace + 1.0 + START_WINDOW

    def decide(self, failure: dict, generation: int, before: dict | None = None) -> Decision:
        """Restart after this failure of generation `generation`, or not (and why not). `before`: the
        checkpoint a failed process of the generation before had just loaded (its failure's `loaded`)."""
        if not self.enabled:
            return Decision(False, generation)
        kind, code = failure.get("kind"), failure.get("exit_code")
        if kind == REJOIN and self.layout is not None:  # not a failure: the world grows back, after one backoff
            if generation >= self.max_restarts:
                return Decision(False, generation, why_not="max_restarts (%d) spent" % self.max_restarts)
            return Decision(True, generation + 1, self.backoff)
        if kind not in RESTARTABLE and not (kind == FailureKind.LEFT and self.layout is not None):
            return Decision(False, generation, why_not="not a restartable failure (only an exit, a hang or a lost node is)")
        if kind == FailureKind.EXIT and self.exit_codes is not None and code not in self.exit_codes:
            return Decision(False, generation, why_not="exit code %s is not in restart_on_exit_codes %s"
                            % (code, list(self.exit_codes)))
        damaged = damaged_checkpoint(failure, generation, before)
        if damaged and self.on_bad_checkpoint != "previous":
            return Decision(False, generation, why_not=damaged, damaged=True)
        if damaged:
            fallback = previous_checkpoint(failure, generation, before)
            if fallback is None:
                return Decision(False, generation, why_not=damaged + " and there is no checkpoint before it to fall "
                                "back to", damaged=True)
            if generation >= self.max_restarts:
                return Decision(False, generation, why_not="%s; %s (the checkpoint before it) is not tried: "
                                "max_restarts (%d) spent" % (damaged, fallback["path"], self.max_restarts),
                                damaged=True)
            return Decision(True, generation + 1, self.backoff_for(generation + 1), resume=fallback)
        if generation >= self.max_restarts:
            return Decision(False, generation, why_not="max_restarts (%d) spent" % self.max_restarts)
        return Decision(True, generation + 1, self.backoff_for(generation + 1))


def note_loaded(loaded: dict, failure: dict) -> None:
    """Keep, per generation, the first `loaded` a failure of it carries (the board's `loaded`)."""
    g = failure.get("generation", 0)
    if isinstance(g, int) and isinstance(failure.get("loaded"), dict) and g not in loaded:
        loaded[g] = failure["loaded"]


def _loaded(value) -> tuple | None:
    """A failure's `loaded` ({path, step, after, previous}: agent/checkpoints.py) as (path, step, after,
    previous: (path, step) of the checkpoint saved before it, or None), else None."""
    if not isinstance(value, dict) or not isinstance(value.get("path"), str) or not value["path"]:
        return None
    step, after, prev = words.number(value.get("step")), words.number(value.get("after")), value.get("previous")
    if isinstance(prev, dict) and isinstance(prev.get("path"), str) and prev["path"] and prev["path"] != value["path"]:
        prev = (prev["path"], words.number(prev.get("step")))
    else:
        prev = None
    return value["path"], step, after, prev


def damaged_checkpoint(failure: dict, generation: int, before: dict | None) -> str | None:
    """Two generations in a row whose programs failed soon after loading the same checkpoint file: the words
    that stop the restart loop (a torn or corrupt file fails every restart the same way), else None."""
    now, then = _loaded(failure.get("loaded")), _loaded(before)
    if generation < 1 or failure.get("kind") != FailureKind.EXIT or now is None or then is None or now[0] != then[0]:
        return None
    afters = [a for a in (now[2], then[2]) if a is not None]  # None: it failed in the load itself
    step = now[1] if now[1] is not None else then[1]
    return words.damaged_text(generation - 1, generation, max(afters) if afters else None, now[0], step)


def previous_checkpoint(failure: dict, generation: int, before: dict | None) -> dict | None:
    """on_bad_checkpoint previous: what generation g+1 resumes from instead of the file generations g-1 and g
    failed loading (the checkpoint saved before it, as the failing node's agent knows its saves), else None."""
    now, then = _loaded(failure.get("loaded")), _loaded(before)
    prev = now[3] or then[3]
    if prev is None:
        return None
    afters = [a for a in (now[2], then[2]) if a is not None]
    fallback = {"generation": generation + 1, "path": prev[0], "step": prev[1], "instead_of": now[0],
                "failed": [generation - 1, generation], "after": max(afters) if afters else None}
    fallback["text"] = words.fallback_text(generation + 1, fallback)
    return fallback
