"""How fast does the watchdog bring a broken job down, and what does the agent cost?

For N = 3 and 16 real sshd nodes on 127.0.0.x (one pserver node, N-1 trainer
nodes, tests/programs/fakejob.py writing a metrics record every 0.2 s), with
the node agents at watchdog.interval 1 s:

  crash      SIGKILL one trainer's program -> the last job process gone on
             every node (agents aside; they leave right after)   target <= 2 s
  hang       SIGSTOP one trainer's program -> the last job process gone
                                               target <= hang_timeout + 0.5 s
  agent      each agent's CPU (share of one core, from /proc utime+stime over
             a --window of steady training) and RSS
                                      targets <= 2% of a core, <= 40 MB RSS

"Gone" is watched by polling every job pid found at the start (a process is
gone once it has no /proc entry, or is a zombie whose parent is PID 1), then
confirmed by a full /proc scan for the job marker. Prints figures and the
ratio of each to its target (<= 1.0 meets it).

    .venv/bin/python bench/teardown.py [--nodes 3,16] [--trials 3] [--hang-timeout 3] [--window 10]
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where bench/copy.py would shadow the stdlib's copy.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import re
import signal
import statistics
import tempfile
import time

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.sshd_job import SshdJob  # noqa: E402
from tests.support.procscan import live_marked, stat  # noqa: E402

FAKE = "python tests/programs/fakejob.py"


def rss(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gone(pid: int, start: int) -> bool:
    st = stat(pid)
    return st is None or st[3] != start or (st[0] in "ZX" and st[1] == 1)


class Bench(SshdJob):
    def __init__(self, root: Path, n: int, interval: float, hang_timeout: float):
        self.n = n
        super().__init__(root, n, lambda names: [(names[0], ["pserver"])] + [(name, ["trainer"]) for name in names[1:]],
                         {"name": "bench", "pserver": {"port": 7600, "command": FAKE}, "trainer": {"command": FAKE},
                          "watchdog": {"interval": interval, "hang_timeout": hang_timeout, "grace": 2}})
        self.fab("deploy")

    def health(self, name: str) -> dict:
        try:
            return json.loads((self.jd(name) / "health.json").read_text())
        except (OSError, ValueError):
            return {}

    def start(self) -> None:
        out = self.fab("start-pserver", "start-trainers")
        self.job_id = re.search(r"job (\S+): trainer started", out).group(1)
        deadline = time.time() + 60
        while time.time() < deadline:
            if all(set(self.health(n).get("peers") or {}) == set(self.names) for n in self.names):
                return
            time.sleep(0.2)
        raise SystemExit("the agents did not all meet the coordinator within 60 s")

    def program(self, name: str, proc: str) -> int:
        wrapper = json.loads((self.jd(name) / "run" / f"{proc}.json").read_text())["pid"]
        for p in os.listdir("/proc"):
            if p.isdigit():
                st = stat(int(p))
                if st and st[1] == wrapper:
                    return int(p)
        raise SystemExit(f"{proc} on {name}: no program")

    def job_pids(self) -> dict[int, int]:
        """Every live job process (agents aside) -> its start time, found by the job marker."""
        pids = {}
        for pid, desc in live_marked(self.ws.values()):
            if "fabtrain.node.agent" in desc or "fabtrain-keeper" in desc:
                continue
            st = stat(pid)
            if st:
                pids[pid] = st[3]
        return pids

    def agents(self) -> dict[str, int]:
        return {n: self.program(n, "agent") for n in self.names}

    def fault(self, sig: int, timeout: float) -> tuple[float, float]:
        """Send sig to the last node's trainer; seconds until every job process is gone, and the agents too."""
        victim = self.program(self.names[-1], f"trainer-{self.n - 2}")
        watched = self.job_pids()
        t0 = time.perf_counter()
        os.kill(victim, sig)
        while watched and time.perf_counter() - t0 < timeout:
            watched = {p: s for p, s in watched.items() if not gone(p, s)}
            time.sleep(0.005)
        took = time.perf_counter() - t0
        if watched:
            raise SystemExit(f"still alive after {timeout} s: {sorted(watched)}")
        left = [p for p in live_marked(self.ws.values()) if "fabtrain.node.agent" not in p[1] and "keeper" not in p[1]]
        if left:
            raise SystemExit(f"job processes the pid watch missed: {left}")
        while live_marked(self.ws.values()) and time.perf_counter() - t0 < timeout + 30:
            time.sleep(0.05)
        return took, time.perf_counter() - t0

    def agent_cost(self, window: float) -> dict:
        agents = self.agents()
        first = {n: stat(p)[2] for n, p in agents.items()}
        t0 = time.perf_counter()
        time.sleep(window)
        dt = time.perf_counter() - t0
        cpu = {n: (stat(p)[2] - first[n]) / dt for n, p in agents.items()}
        mem = {n: rss(p) for n, p in agents.items()}
        return {"cpu": cpu, "rss": mem, "coordinator": self.names[0]}


def fmt_ratio(value: float, target: float) -> str:
    return f"{value:.3f} (ratio {value / target:.2f})"


def run(n: int, args) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"fabtrain-teardown-{n}-"))
    b = Bench(root, n, args.interval, args.hang_timeout)
    results = {"crash": [], "crash_agents": [], "hang": [], "hang_agents": []}
    try:
        cost = None
        for trial in range(args.trials):
            b.start()
            if cost is None:
                cost = b.agent_cost(args.window)
            took, agents = b.fault(signal.SIGKILL, timeout=30)
            results["crash"].append(took)
            results["crash_agents"].append(agents)
            print(f"N={n} crash trial {trial + 1}: job gone in {took:.3f} s, agents gone in {agents:.3f} s", flush=True)
        for trial in range(args.trials):
            b.start()
            took, agents = b.fault(signal.SIGSTOP, timeout=args.hang_timeout + 30)
            results["hang"].append(took)
            results["hang_agents"].append(agents)
            print(f"N={n} hang trial {trial + 1}: job gone in {took:.3f} s, agents gone in {agents:.3f} s", flush=True)
    finally:
        b.close()
    results["cost"] = cost
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="3,16")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--hang-timeout", type=float, default=3.0)
    ap.add_argument("--window", type=float, default=10.0, help="seconds of steady training to measure the agents over")
    args = ap.parse_args()
    print(f"watchdog.interval {args.interval:g} s, hang_timeout {args.hang_timeout:g} s, grace 2 s; "
          f"{os.cpu_count()} CPUs; {args.trials} trials each")
    summary = []
    for n in [int(x) for x in args.nodes.split(",")]:
        r = run(n, args)
        cost = r["cost"]
        cpus = sorted(cost["cpu"].values())
        rsss = sorted(v for v in cost["rss"].values() if v)
        co = cost["coordinator"]
        summary.append((n, r, cpus, rsss, cost["cpu"][co], cost["rss"][co]))
    print()
    hang_target = args.hang_timeout + 0.5
    for n, r, cpus, rsss, co_cpu, co_rss in summary:
        print(f"== N = {n} nodes ({n - 1} trainers, 1 pserver)")
        print(f"  SIGKILL trainer -> job gone   median {fmt_ratio(statistics.median(r['crash']), 2.0)} s, "
              f"max {max(r['crash']):.3f} s  [target <= 2 s]  (agents gone: max {max(r['crash_agents']):.3f} s)")
        print(f"  SIGSTOP trainer -> job gone   median {fmt_ratio(statistics.median(r['hang']), hang_target)} s, "
              f"max {max(r['hang']):.3f} s  [target <= hang_timeout + 0.5 = {hang_target:g} s]"
              f"  (agents gone: max {max(r['hang_agents']):.3f} s)")
        print(f"  agent CPU  median {statistics.median(cpus) * 100:.2f}% of a core, max {cpus[-1] * 100:.2f}% "
              f"(coordinator's agent {co_cpu * 100:.2f}%)  ratio to 2%: {cpus[-1] / 0.02:.2f}")
        print(f"  agent RSS  median {statistics.median(rsss) / 2**20:.1f} MiB, max {rsss[-1] / 2**20:.1f} MiB "
              f"(coordinator's agent {co_rss / 2**20:.1f} MiB)  ratio to 40 MB: {rsss[-1] / 40e6:.2f}")


if __name__ == "__main__":
    main()
