"""What job.watchdog.min_nodes costs when a node leaves the job and when it comes back, against the job's
own cold start.

Three sshd nodes, all trainers, collective mode, the reference workload (`python -m workload.ddp --model
word2vec`, checkpoint every 10 steps; `--program workload`) or tests/programs/allreduce.py (`--program
fake`), with `on_failure: restart` and `min_nodes: 2`. Each node has its own network namespace
(tests/support/netns.py) where this machine can make them (root, ip, nft, tc); else they are 127.0.0.x
and the cut and the heal are not measured (the bench says why). One job, these faults in turn, each timed
from the fault to every rank's first metrics record of the next generation (no `fab` runs meanwhile):

  cut       every packet of node3 dropped (nft): node3 fences itself, the coordinator loses it; the
            survivors' first records of the smaller generation
  back      node3 healed: its agent (which fenced itself and waits) is heard again and taken into the
            next generation at full size (job.watchdog.max_rejoins); the `node_back` event says
            `node3 back in generation N (WORLD_SIZE 3)`; every rank's first record of that generation
  lost      node3's machine lost (its sshd stopped; its keeper, agent and trainer SIGKILLed at once);
            the survivors' first records of the smaller generation

and measures in the same run

  cold      the job's own cold start: its first process's start -> every trainer's first metrics
            record (generation 0)
  gen cold  the same for each new generation: what of a fault's time is the program's own start

target: time <= backoff + 1.2 x cold, backoff being the one the job's settings give the restart
(restart_backoff, doubled for each restart after the first; one restart_backoff for a node back), counted
from the fault. A lost node's generation starts no earlier than its last beat + fence_wait
(docs/partitions.md), which the header line gives.

With --spare the job has a fourth node, node4, marked `spare: true` (its agent runs, its trainer does not),
and one fault is timed instead:

  spare     node3's machine lost, as `lost` above; node4 takes its slot: every rank's first record of the
            next generation, node4's included, in a world of 3 still

With --first (nodes with their own networks only) the fault is the first node's, where the coordinator
lives; node2 and node3 elect one of them (docs/partitions.md, Majority election):

  first     every packet of node1 dropped (nft): node1's lease runs out, it steps down and fences itself;
            node2 and node3 elect node2 (term 2), which restarts the job without node1: the survivors'
            first records of the smaller generation (the restart read from node2's events)
  first back  node1 healed: it learns who coordinates term 2 and is taken into the next generation at
            full size; every rank's first record of that generation

    .venv/bin/python bench/elastic.py [--backoff 12] [--program workload|fake] [--spare | --first]
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where bench/copy.py would shadow the stdlib's copy.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.sshd_job import SshdJob  # noqa: E402
from fabtrain.node import procfs  # noqa: E402
from fabtrain.node.coordination import fence  # noqa: E402
from fabtrain.node.coordination.restart import RestartPolicy  # noqa: E402
from tests.support import netns  # noqa: E402
from tests.support.sshd import SshdCluster  # noqa: E402

PROGRAMS = {"workload": "python -m workload.ddp --model word2vec --num_passes 200 --checkpoint_every 10",
            "fake": "python tests/programs/allreduce.py --steps 100000 --period 0.2"}
INTERVAL, GRACE = 1.0, 3.0
SPARE = "node4"


class Bench(SshdJob):
    def __init__(self, root: Path, program: str, backoff: float, own_networks: bool, spare: bool = False):
        job = {"name": "elastic", "mode": "collective", "trainer": {"per_node": 1, "command": PROGRAMS[program]},
               "watchdog": {"interval": INTERVAL, "hang_timeout": 60, "grace": GRACE, "on_failure": "restart",
                            "restart_backoff": backoff, "max_restarts": 3, "min_nodes": 2}}
        self.backoff = backoff
        if own_networks:
            job["watchdog"]["port"] = 7180  # each node has its own network: no other job's port is in the way
        if program == "workload":
            job["data"] = {"dir": str(root / "data"), "input": "sample"}
        super().__init__(root, 4 if spare else 3, lambda names: [(n, ["trainer"]) for n in names], job,
                         cluster=netns.NetnsCluster if own_networks else SshdCluster,
                         node_fields={SPARE: {"spare": True}} if spare else None)
        self.prepare = ("split-data", "deploy", "copy-data") if program == "workload" else ("deploy",)
        self.sshd_by_name = {n.name: n for n in self.sshd.nodes}

    def generation_up(self, trainers: list, after: float, timeout: float = 120) -> tuple[float, float, list]:
        """Wait until each of `trainers` ([(node, name)]) runs a process started after `after` and wrote its
        first record; (the last first record's ts, the generation's first start, the first records)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                starts = {t: self.run_record(*t)["started_at"] for t in trainers}
            except (OSError, ValueError, KeyError):
                starts = {}
            if starts and all(s > after for s in starts.values()):
                firsts = [self.first_record(n, name, starts[(n, name)]) for n, name in trainers]
                if all(firsts):
                    return max(r["ts"] for r in firsts), min(starts.values()), firsts
            time.sleep(0.02)
        told = []
        for node in self.names:  # what each node's agent said meanwhile: why no generation came
            try:
                lines = (self.jd(node) / "events.jsonl").read_text().splitlines()
            except OSError as e:
                told.append(f"{node}: no events ({e.strerror})")
                continue
            told += [f"{node} {e['kind']}: {e.get('reason', '')}" for e in map(json.loads, filter(str.strip, lines))
                     if e["ts"] >= after]
        for node, name in trainers:  # and what the programs said last
            for log in sorted(self.jd(node).rglob(f"{name}*.log")):
                told += [f"{node} {log.name}: {line}" for line in log.read_text(errors="replace").splitlines()[-6:]]
        raise SystemExit(f"no new generation of {trainers} within {timeout} s; events since the fault:\n"
                         + "\n".join(told[-60:]))

    def lose(self, node: str, name: str) -> float:
        """The node's machine gone: its sshd stopped, its keeper, agent and trainer killed at once."""
        health = json.loads((self.jd(node) / "health.json").read_text())
        pids = [health["agent"].get("keeper_pid"), self.run_record(node, "agent")["program_pid"],
                self.run_record(node, name)["program_pid"]]
        self.sshd.stop(self.sshd_by_name[node])
        t0 = time.time()
        for pid in pids:
            if pid:
                os.kill(pid, signal.SIGKILL)
        return t0

    def events(self, kind: str, after: float = 0.0, node: str | None = None) -> list[dict]:
        """The events of `kind` on the coordinator's node (node_left, node_back, restarting): the first node,
        or `node` once another one coordinates."""
        lines = (self.jd(node or self.names[0]) / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, filter(str.strip, lines)) if e["kind"] == kind and e["ts"] >= after]

    def environ(self, node: str, name: str) -> dict:
        return {k.decode(): v.decode() for k, v in procfs.environ(self.run_record(node, name)["program_pid"]).items()}


def measure(b: Bench, fault: str, t0: float, trainers: list, cold: float, coordinator: str | None = None) -> str:
    """Print the fault's row of the table: from t0 to every one of `trainers`' first record of the next
    generation; returns a line of what that generation is (its world, its first steps)."""
    up, began, firsts = b.generation_up(trainers, t0)
    took, gen_cold = up - t0, up - began
    # Its backoff: the one the job's settings give this restart (restart_backoff, doubled for each failure after
    # the first; one restart_backoff for a node back), not the `restarting` event's, which is what was left of it
    # once the coordinator found the fault out (a lost node's backoff counts from its last beat).
    restart = next(e for e in b.events("restarting", after=t0, node=coordinator) if "generation" in e)
    policy = RestartPolicy(True, 3, b.backoff, None, GRACE)
    backoff = policy.backoff if "back" in fault else policy.backoff_for(int(restart["generation"]))
    target = backoff + 1.2 * cold
    env = b.environ(*trainers[-1])
    print(f"{fault:<10}  {restart['generation']:>3}  {env.get('WORLD_SIZE', '?'):>5}  {backoff:>9.1f}  {took:>7.3f}  "
          f"{gen_cold:>10.3f}  {target:>8.3f}  {took / target:>11.2f}  {took - backoff - gen_cold:>10.3f}")
    return (f"{fault}: generation {restart['generation']}, RANK of {trainers[-1][0]}'s trainer {env.get('RANK')} "
            f"of WORLD_SIZE {env.get('WORLD_SIZE')}; first steps {[r.get('step') for r in firsts]}")


def faults(b: Bench, full: list, cold: float, own_networks: bool, spare: bool, first: bool) -> list[str]:
    """node3 cut off and healed (nodes with their own networks only), then node3's machine lost; or, with a
    spare, node3's machine lost and the spare in its slot; or node1 cut off and healed: the table's rows;
    returns the lines that follow it."""
    print(f"{'fault':<10}  {'gen':>3}  {'world':>5}  {'backoff s':>9}  {'took s':>7}  {'gen cold s':>10}  "
          f"{'target s':>8}  {'took/target':>11}  {'overhead s':>10}")
    said = []
    if first:  # node2, the lowest-indexed node left, stands first and coordinates term 2
        time.sleep(15.0)
        said.append(measure(b, "first", b.sshd.cut("node1", "drop"), full[1:], cold, coordinator="node2"))
        time.sleep(5.0)
        said.append(measure(b, "first back", b.sshd.heal("node1"), full, cold, coordinator="node2"))
        return said
    if spare:  # the spare's trainer is numbered after the world (trainer-3); it takes node3's slot
        time.sleep(15.0)
        return [measure(b, "spare", b.lose(*full[2]), full[:2] + [(SPARE, f"trainer-{len(full)}")], cold)]
    if own_networks:
        time.sleep(15.0)  # into training, past a checkpoint or two
        said.append(measure(b, "cut", b.sshd.cut("node3", "drop"), full[:2], cold))
        time.sleep(5.0)
        said.append(measure(b, "back", b.sshd.heal("node3"), full, cold))
    else:
        why = netns.available()
        said += [f"cut: not measured: nodes with their own networks cannot be made here ({why})",
                 f"back: not measured: nodes with their own networks cannot be made here ({why})"]
    time.sleep(15.0)
    said.append(measure(b, "lost", b.lose(*full[2]), full[:2], cold))
    return said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # restart_backoff: by default fence_wait at this bench's interval and grace (12 s), the shortest backoff
    # a lost node's fence lets a smaller world keep (docs/watchdog.md: keep restart_backoff above fence_wait)
    ap.add_argument("--backoff", type=float, default=fence.fence_wait(INTERVAL, GRACE))
    ap.add_argument("--program", choices=sorted(PROGRAMS), default="workload")
    ap.add_argument("--spare", action="store_true", help="a fourth node, a spare; time it taking node3's slot")
    ap.add_argument("--first", action="store_true", help="time node1's loss (the coordinator's node) and return")
    args = ap.parse_args()
    own_networks = netns.available() is None
    if args.first and (args.spare or not own_networks):
        raise SystemExit("--first needs nodes with their own networks and no --spare: "
                         + (netns.available() or "the job with a spare does not elect"))
    b = Bench(Path(tempfile.mkdtemp(prefix="fabtrain-elastic-")), args.program, args.backoff, own_networks, args.spare)
    full = [(n, f"trainer-{i}") for i, n in enumerate(b.names) if n != SPARE or not args.spare]
    try:
        b.fab(*b.prepare)
        t_start = time.time()
        out = b.fab("start-trainers")
        b.job_id = re.search(r"job (\S+): trainer started", out).group(1)
        up, began, _ = b.generation_up(full, t_start - 60)
        cold = up - began
        print(f"program {args.program}; 3 trainer nodes{' and a spare' if args.spare else ''}"
              f"{', each its own network' if own_networks else ''}, "
              f"min_nodes 2; restart_backoff {args.backoff:g} s, grace {GRACE:g} s, interval {INTERVAL:g} s, "
              f"fence_wait {fence.fence_wait(INTERVAL, GRACE):g} s")
        print(f"cold start (generation 0): {cold:.3f} s  (first process start -> every trainer's first record)")
        said = faults(b, full, cold, own_networks, args.spare, args.first)
        print("overhead = took - backoff - gen cold: the fault seen, the fence, teardown, the coordinator's "
              "decision, relaunch")
        told = [e for node in dict.fromkeys([b.names[0]] + (["node2"] if args.first else []))
                for kind in ("coordinator", "node_left", "node_back", "stand_in") for e in b.events(kind, node=node)]
        for line in said + [f"{e['kind']}: {e['reason']}" for e in sorted(told, key=lambda e: e["ts"])]:
            print(line)
    finally:
        if own_networks:
            b.sshd.heal("node1")
            b.sshd.heal("node3")
        for node in b.sshd.nodes:
            if node.process is None or node.process.poll() is not None:
                b.sshd.start(node)
        b.close()


if __name__ == "__main__":
    main()
