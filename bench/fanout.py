"""How fast does fabtrain start and stop a job on N nodes?

For N = 1, 4, 16 real sshd nodes on 127.0.0.x, in one run, best of --repeat:

  fabtrain  deploy + start-pserver + start-trainers + kill-all, nodes in parallel,
            connections opened once (what `fab deploy start-pserver start-trainers`
            then `fab kill-all` do, without the ~0.5 s of Python start-up of `fab`)
  floor     the same number of fan-outs (4) of a no-op `true`, in parallel, over
            connections that are already open: the least any tool could take
  serial    the same fabtrain steps with ssh.parallel: 1, node after node (what
            `fab -H a,b,c` and PaddlePaddle's old fabric script do)

Prints seconds and the ratios fabtrain/floor (target <= 1.5 at N=16) and
serial/fabtrain (target >= 2 at N=16).

    .venv/bin/python bench/fanout.py [--nodes 1,4,16] [--repeat 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fabtrain.controller import lifecycle  # noqa: E402
from fabtrain.config.cluster import load_cluster  # noqa: E402
from fabtrain.remote.session import Session  # noqa: E402
from tests.sshd import SshdCluster, write_cluster  # noqa: E402

FAN_OUTS = 4  # deploy, start-pserver, start-trainers, kill-all: one remote command per node each


def session(path: Path, parallel: int) -> Session:
    cluster = load_cluster(path)
    return Session(dataclasses.replace(cluster, parallel=parallel))


def lifecycle_once(path: Path, parallel: int) -> float:
    s = session(path, parallel)
    t0 = time.perf_counter()
    for r in lifecycle.deploy(s) + lifecycle.start(s, ("pserver",)).replies + \
            lifecycle.start(s, ("trainer",)).replies:
        assert r.ok, r.error
    killed = lifecycle.kill_all(s, grace=2)
    elapsed = time.perf_counter() - t0
    assert all(r.ok and not r.value["left"] for r in killed)
    s.close()
    return elapsed


def floor_once(path: Path) -> float:
    s = session(path, 64)
    for r in s.map(lambda t: t.run("true")):  # open every connection first
        assert r.ok, r.error
    t0 = time.perf_counter()
    for _ in range(FAN_OUTS):
        s.map(lambda t: t.run("true"))
    elapsed = time.perf_counter() - t0
    s.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1,4,16")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fanout-"))
    os.environ["FABTRAIN_STATE_DIR"] = str(root / "state")
    print(f"{'N':>3} {'fabtrain s':>11} {'floor s':>8} {'serial s':>9} {'fabtrain/floor':>15} {'serial/fabtrain':>16}")
    for n in [int(x) for x in args.nodes.split(",")]:
        sshd = SshdCluster(root / f"sshd{n}", count=n)
        try:
            names = [node.name for node in sshd.nodes]
            path = write_cluster(root / f"c{n}.yaml", sshd, name=f"fanout{n}",
                                 ssh_nodes=[(names[0], ["pserver", "trainer"])] + [(x, ["trainer"]) for x in names[1:]],
                                 job={"mode": "pserver", "pserver": {"command": "sleep 600"},
                                      "trainer": {"command": "sleep 600"}, "watchdog": {"enabled": False}})
            for r in lifecycle.deploy(session(path, 64)):  # first copy of the code, not timed
                assert r.ok, r.error
            ours = min(lifecycle_once(path, 64) for _ in range(args.repeat))
            floor = min(floor_once(path) for _ in range(args.repeat))
            serial = min(lifecycle_once(path, 1) for _ in range(args.repeat))
            print(f"{n:>3} {ours:>11.2f} {floor:>8.2f} {serial:>9.2f} {ours / floor:>15.2f} {serial / ours:>16.2f}", flush=True)
        finally:
            sshd.close()


if __name__ == "__main__":
    main()
