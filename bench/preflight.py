"""What does the network preflight cost, against one no-op fan-out?

For N real sshd nodes on 127.0.0.x, in one run, connections opened once,
best of --repeat (and the median):

  noop      one fan-out of a node-ops call that does nothing (`status` of an
            empty workspace): the interpreter on each node, the op, the reply
  check     `fab check`'s network section with fixed ports: ONE fan-out in
            which every node listens on its ports and connects to the others'
  check+    the same with `auto` ports, picked blind (a second fan-out only if one was taken)
  start     the probe a start runs before anything starts (one fan-out, binds only)
  shell     one fan-out of `true` (no interpreter): the floor under everything

Prints seconds and the ratios check/noop (target <= 1.5), check+/noop and
start/noop, with the commit and the load average at the top.

    .venv/bin/python bench/preflight.py [--nodes 3,8] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fabtrain.config.cluster import load_cluster  # noqa: E402
from fabtrain.controller import preflight  # noqa: E402
from fabtrain.remote import rpc  # noqa: E402
from fabtrain.remote.session import Session  # noqa: E402
from tests.support.sshd import SshdCluster, free_port, write_cluster  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def all_ok(replies):
    for r in replies:
        assert r.ok, r.error


def measure(path: Path, repeat: int) -> dict[str, list[float]]:
    s = Session(load_cluster(path))
    all_ok(s.map(lambda t: rpc.call(t, "status", {"job_id": None})))  # open every connection first
    auto = Session(load_cluster(path.parent.parent / "auto" / "cluster.yaml"))
    all_ok(auto.map(lambda t: rpc.call(t, "status", {"job_id": None})))
    runs = {"shell": [], "noop": [], "check": [], "check+": [], "start": []}
    for _ in range(repeat):
        # Interleaved, so a burst of load on the shared machine hits every kind alike.
        runs["shell"].append(timed(lambda: all_ok(s.map(lambda t: t.run("true")))))
        runs["noop"].append(timed(lambda: all_ok(s.map(lambda t: rpc.call(t, "status", {"job_id": None})))))

        def check():
            found = preflight.network_check(s)
            assert found.ok, found.problems
        runs["check"].append(timed(check))

        def check_auto():
            found = preflight.network_check(auto)
            assert found.ok, found.problems
        runs["check+"].append(timed(check_auto))
        runs["start"].append(timed(lambda: preflight.prepare_start(s, "bench", ("pserver",))))
    s.close()
    auto.close()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="3,8")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(f"commit {commit}  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}  cpus {os.cpu_count()}")
    root = Path(tempfile.mkdtemp(prefix="preflight-"))
    os.environ["FABTRAIN_STATE_DIR"] = str(root / "state")
    print(f"{'N':>3} {'kind':>7} {'best s':>7} {'median s':>9} {'best/noop':>10} {'median/noop':>12}")
    for n in [int(x) for x in args.nodes.split(",")]:
        sshd = SshdCluster(root / f"sshd{n}", count=n)
        try:
            nodes = [(node.name, ["pserver", "trainer"] if i == 0 else ["trainer"]) for i, node in enumerate(sshd.nodes)]
            base = free_port([node.address for node in sshd.nodes])
            fixed = {"mode": "pserver", "pserver": {"port": base}, "watchdog": {"port": base + 10}}
            for sub in ("fixed", "auto"):
                (root / f"c{n}" / sub).mkdir(parents=True)
            path = write_cluster(root / f"c{n}" / "fixed" / "cluster.yaml", sshd, ssh_nodes=nodes, job=fixed, name=f"pf{n}")
            auto = {"mode": "pserver", "pserver": {"port": "auto"}, "watchdog": {"port": "auto"}}
            write_cluster(root / f"c{n}" / "auto" / "cluster.yaml", sshd, ssh_nodes=nodes, job=auto, name=f"pfa{n}")
            runs = measure(path, args.repeat)
            noop_best, noop_median = min(runs["noop"]), statistics.median(runs["noop"])
            for kind, times in runs.items():
                best, median = min(times), statistics.median(times)
                print(f"{n:>3} {kind:>7} {best:7.3f} {median:9.3f} {best / noop_best:10.2f} {median / noop_median:12.2f}")
        finally:
            sshd.close()
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("target: check/noop <= 1.5 (one fan-out; every node listens and connects within it)")


if __name__ == "__main__":
    main()
