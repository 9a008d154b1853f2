"""How long does job.watchdog.min_nodes take to bring a job back without a lost node, against the
job's own cold start?

Three real sshd nodes on 127.0.0.x, all trainers, collective mode, the
reference workload (`python -m workload.ddp --model word2vec`, checkpoint every
10 steps; `--program workload`) or tests/programs/allreduce.py (`--program
fake`), with `on_failure: restart` and `min_nodes: 2`. The run loses node3 as a
machine is lost (its sshd stopped; its keeper, agent and trainer SIGKILLed at
once) and measures

  elastic   the loss -> both survivors' first metrics record of the smaller
            generation (no `fab` runs meanwhile)
  cold      the job's own cold start in the same run: its first process's
            start -> every trainer's first metrics record (generation 0)
  gen cold  the same for the smaller generation: what of `elastic` is the
            program's own start

target: elastic <= backoff + 1.2 x cold (the loss is noticed within the
backoff: peer_timeout is 5 s, so keep the backoff above 6 s). Also prints the
smaller generation's first step (the reference workload resumes from rank 0's
checkpoint) and its WORLD_SIZE.

    .venv/bin/python bench/elastic.py [--backoff 8] [--program workload|fake]
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

PROGRAMS = {"workload": "python -m workload.ddp --model word2vec --num_passes 200 --checkpoint_every 10",
            "fake": "python tests/programs/allreduce.py --steps 100000 --period 0.2"}


class Bench(SshdJob):
    def __init__(self, root: Path, program: str, backoff: float):
        job = {"name": "elastic", "mode": "collective", "trainer": {"per_node": 1, "command": PROGRAMS[program]},
               "watchdog": {"interval": 1, "hang_timeout": 60, "grace": 3, "on_failure": "restart",
                            "restart_backoff": backoff, "max_restarts": 3, "min_nodes": 2}}
        if program == "workload":
            job["data"] = {"dir": str(root / "data"), "input": "sample"}
        super().__init__(root, 3, lambda names: [(n, ["trainer"]) for n in names], job)
        self.prepare = ("split-data", "deploy", "copy-data") if program == "workload" else ("deploy",)
        self.sshd_by_name = {n.name: n for n in self.sshd.nodes}

    def generation_up(self, trainers: list, after: float, timeout: float = 300) -> tuple[float, float, list]:
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
        raise SystemExit(f"no new generation of {trainers} within {timeout} s")

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backoff", type=float, default=8.0)
    ap.add_argument("--program", choices=sorted(PROGRAMS), default="workload")
    args = ap.parse_args()
    b = Bench(Path(tempfile.mkdtemp(prefix="fabtrain-elastic-")), args.program, args.backoff)
    full = [(n, f"trainer-{i}") for i, n in enumerate(b.names)]
    try:
        b.fab(*b.prepare)
        t_start = time.time()
        out = b.fab("start-trainers")
        b.job_id = re.search(r"job (\S+): trainer started", out).group(1)
        up, began, _ = b.generation_up(full, t_start - 60)
        cold = up - began
        print(f"program {args.program}; 3 trainer nodes, min_nodes 2; restart_backoff {args.backoff:g} s, grace 3 s, "
              f"interval 1 s")
        print(f"cold start (generation 0): {cold:.3f} s  (first process start -> every trainer's first record)")
        time.sleep(15.0)  # into training, past a checkpoint or two
        last = b.first_record(*full[0], since=time.time() - 2) or {}
        t0 = b.lose(*full[2])
        up, began, firsts = b.generation_up(full[:2], t0)
        took, gen_cold, target = up - t0, up - began, args.backoff + 1.2 * cold
        env = {k.decode(): v.decode() for k, v in procfs.environ(b.run_record(*full[1])["program_pid"]).items()}
        print(f"{'backoff':>7}  {'elastic s':>9}  {'gen cold s':>10}  {'target s':>8}  {'elastic/target':>14}  "
              f"{'overhead s':>10}")
        print(f"{args.backoff:>7.1f}  {took:>9.3f}  {gen_cold:>10.3f}  {target:>8.3f}  {took / target:>14.2f}  "
              f"{took - args.backoff - gen_cold:>10.3f}")
        print("overhead = elastic - backoff - gen cold: the loss seen, teardown, the coordinator's decision, relaunch")
        print(f"smaller generation: WORLD_SIZE {env.get('WORLD_SIZE')}, RANK of {full[1][0]}'s trainer "
              f"{env.get('RANK')}; step before the loss ~{last.get('step')}, first steps after it "
              f"{[r.get('step') for r in firsts]}")
        left = [json.loads(x) for x in (b.jd(full[0][0]) / "events.jsonl").read_text().splitlines()
                if '"node_left"' in x]
        print(f"node_left: {left[0]['reason'] if left else 'none'}")
    finally:
        for node in b.sshd.nodes:
            if node.process is None or node.process.poll() is not None:
                b.sshd.start(node)
        b.close()


if __name__ == "__main__":
    main()
