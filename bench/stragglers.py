"""What does the straggler check cost the first node's agent, against the beats it handles anyway?

In-process (no sockets), on the first node's side of a 16-node job (--nodes), once with one
trainer a node and once with eight (--ranks): every watchdog interval that agent's coordinator
handles one beat from each node, and the agent runs the straggler check once.

  beats   the baseline: one interval's beats, each as the coordinator gets it (the frame's MAC
          checked and parsed, the board updated, the reply built and sealed), every rank's step
          rate in its beat; no straggler check
  check   the agent's own `check_stragglers` (fabtrain/node/agent/jobjudge.py, the method itself, on
          the agent's JobJudge, given that coordinator): the board's tables under its lock, the rule
          (`stragglers.judge`) over every rank's rate, and what health.json will say (`standing`);
          one rank runs at half the others' rate, so it is found and then stays reported

Each is timed as CPU (time.process_time) over --intervals intervals, interleaved in rounds. Prints
CPU per interval of each, the ratio check / beats, and the share of a core the check takes at
the default interval (1 s).

    .venv/bin/python bench/stragglers.py [--nodes 16] [--ranks 1,8] [--intervals 2000]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from fabtrain.node.agent.jobjudge import JobJudge  # noqa: E402
from fabtrain.node.coordination import stragglers  # noqa: E402
from fabtrain.node.coordination.server import Coordinator  # noqa: E402
from fabtrain.node.coordination.protocol import Channel  # noqa: E402
from fabtrain.contract.states import JobState  # noqa: E402

INTERVAL = 1.0
SECRET = "s" * 32


def job(nodes: int, ranks: int):
    """A coordinator that knows every node, the sealed beats of one interval, and the agent's JobJudge."""
    names = [f"node{i}" for i in range(nodes)]
    co = Coordinator("job", "127.0.0.1", 0, names, INTERVAL, 5.0, secret=SECRET)
    pairs = {x: (Channel(SECRET, "job", x, "a" * 32, "b" * 32, "agent"),
                 Channel(SECRET, "job", x, "a" * 32, "b" * 32, "coordinator")) for x in names}
    known: dict = {}

    def procs(i: int) -> dict:
        return {f"trainer-{r}": {"role": "trainer", "rank": r, "state": "running", "exit_code": None,
                                 "rate": 5.0 if r == ranks * nodes // 2 else 10.0 + 0.01 * r}
                for r in range(i * ranks, (i + 1) * ranks)}

    def beat(x: str, seq: int) -> bytes:
        i = names.index(x)
        return pairs[x][0].seal({"op": "beat", "job_id": "job", "node": x, "seq": seq, "ts": time.time(),
                                 "procs": procs(i), "done": False, "failure": None, "final": None,
                                 "trainers_expected": nodes * ranks, "roster": known.get(x),
                                 "generation": 0})[:-1]

    def answer(x: str, frame: bytes) -> int:
        reply, _ = co.handle(pairs[x][1].open(frame))
        if isinstance(reply.get("roster"), dict):
            known[x] = {"epoch": reply["roster"]["epoch"], "at": reply["roster"]["at"]}
        return len(pairs[x][1].seal(reply))

    for rnd in range(2):  # every peer known and told, as in a running job
        for x in names:
            answer(x, beat(x, 1 + rnd))
    written = []
    judge = JobJudge(names[0], None, SimpleNamespace(write=lambda *a, **k: written.append(a[0])))
    judge.straggler_rule = stragglers.Rule(0.7, 60.0)
    return names, beat, answer, co, judge, written


def measure(nodes: int, ranks: int, intervals: int, rounds: int = 5) -> str:
    names, beat, answer, co, judge, written = job(nodes, ranks)
    per = intervals // rounds
    beats_cpu, check_cpu = [], []
    t_fake = 1000.0  # the check's clock: one interval a call
    for rnd in range(rounds):
        # Sealed before the clock starts (a frame opens once, in order): the agents' side is not timed.
        frames = [[(x, beat(x, 3 + rnd * per + k)) for x in names] for k in range(per)]
        t0 = time.process_time()
        for interval in frames:
            for x, frame in interval:
                answer(x, frame)
        beats_cpu.append((time.process_time() - t0) / per)
        t0 = time.process_time()
        for _ in range(per):
            judge.check_stragglers(co, JobState.RUNNING, t_fake)
            t_fake += INTERVAL
        check_cpu.append((time.process_time() - t0) / per)
    beats, check = statistics.median(beats_cpu), statistics.median(check_cpu)
    found = judge.straggling
    return (f"{nodes} nodes x {ranks} trainer(s) = {nodes * ranks:>4} ranks: beats {1e6 * beats:8.1f} us CPU an interval "
            f"({1e6 * beats / nodes:.1f} us a beat), check {1e6 * check:7.1f} us CPU an interval "
            f"(min {1e6 * min(check_cpu):.1f}, max {1e6 * max(check_cpu):.1f}); check / beats = {check / beats:.3f}; "
            f"the check at interval {INTERVAL:g} s: {100 * check / INTERVAL:.4f}% of a core; "
            f"straggler events {written.count('straggler')}, standing {[(s['node'], s['name']) for s in found]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--ranks", default="1,8", help="trainers a node, comma-separated")
    ap.add_argument("--intervals", type=int, default=2000)
    args = ap.parse_args()
    for ranks in (int(r) for r in args.ranks.split(",")):
        print(measure(args.nodes, ranks, args.intervals), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
