"""How fast does fabtrain start and stop a job on N nodes, as a user sees it?

For N real sshd nodes on 127.0.0.x (default N = 1 and 16), for each login
account of bench/nodes.py (plain: /bin/sh and the system python, what a
user's node costs; slow: root, whose .bashrc runs `pyenv init` for every SSH
command), a job of stand-in processes (`sleep 600`, 1 pserver + N trainers),
watchdog ON (one node agent per node, the coordinator on the first), in one
run, --repeat times, interleaved:

  fabtrain  deploy + start-pserver + start-trainers + kill-all, nodes in parallel,
            connections opened inside the timer (what `fab deploy start-pserver
            start-trainers` then `fab kill-all` do, less the ~0.5 s of Python
            start-up of `fab` itself)
  floor     the same number of fan-outs (4) of a no-op `true`, in parallel, over
            connections already open: the least any tool could take
  ssh       4 fan-outs of OpenSSH `ssh node true`, in parallel, a new connection
            each (what a shell loop of ssh, pdsh or rsync pays per fan-out)
  serial    the fabtrain steps with ssh.parallel: 1, node after node (what
            `fab -H a,b,c` and PaddlePaddle's old fabric script do); --serial N,...

Prints, per row, the median and the range (min-max) of each, and of the
ratios fabtrain/floor (target <= 1.5), fabtrain/ssh and serial/fabtrain
(target >= 2 at N=16), each ratio taken within one repeat.

--profile: one start at N=1 per account taken apart: each step's time, SSH
sessions (over the open connection) and OpenSSH connections (rsync), Python
interpreters started on the node, settle waits, and what one round trip
costs with and without an interpreter; and kill-all with the watchdog off.

    .venv/bin/python bench/fanout.py [--nodes 1,16] [--accounts plain,slow] [--repeat 5] [--serial 16] [--profile]
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where a bench/<name>.py would shadow a stdlib module.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from bench import nodes  # noqa: E402
from fabtrain.config.cluster import load_cluster  # noqa: E402
from fabtrain.controller import lifecycle  # noqa: E402
from fabtrain.remote.session import Session  # noqa: E402
from fabtrain.remote.transport import fan_out  # noqa: E402
from tests.support.sshd import SshdCluster  # noqa: E402

FAN_OUTS = 4  # deploy, start-pserver, start-trainers, kill-all: one step per node each


def session(path: Path, parallel: int = 64) -> Session:
    return Session(dataclasses.replace(load_cluster(path), parallel=parallel))


def lifecycle_once(path: Path, parallel: int = 64) -> float:
    s = session(path, parallel)
    t0 = time.perf_counter()
    replies = lifecycle.deploy(s) + lifecycle.start(s, ("pserver",)).replies + lifecycle.start(s, ("trainer",)).replies
    killed = lifecycle.kill_all(s, grace=2)
    elapsed = time.perf_counter() - t0
    s.close()
    for r in replies + killed:
        assert r.ok, r.error
    assert all(not r.value.left for r in killed), [r.value.left for r in killed]
    assert any(k.name == "agent" for k in killed[0].value.killed), "the watchdog agent did not start"
    return elapsed


def floor_once(path: Path) -> float:
    s = session(path)
    for r in s.map(lambda t: t.run("true")):  # open every connection first
        assert r.ok, r.error
    t0 = time.perf_counter()
    for _ in range(FAN_OUTS):
        s.map(lambda t: t.run("true"))
    elapsed = time.perf_counter() - t0
    s.close()
    return elapsed


def ssh_once(path: Path) -> float:
    """4 parallel fan-outs of `ssh node true` with OpenSSH, the settings rsync gets from fabtrain."""
    s = session(path)
    argvs = [[*nodes.openssh_argv(t, path.parent), "true"] for t in (s.transport(n) for n in s.cluster.nodes)]
    t0 = time.perf_counter()
    for _ in range(FAN_OUTS):
        for r in fan_out(argvs, lambda a: subprocess.run(a, check=True, capture_output=True), 64, name=lambda a: a[-2]):
            assert r.ok
    return time.perf_counter() - t0


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """median (min-max): every figure is a range, not the best run."""
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def make_cluster(root: Path, sshd: SshdCluster, account: nodes.Account, watchdog: bool = True) -> Path:
    n = len(sshd.nodes)
    name = f"fanout{n}-{account.key}"
    names = [node.name for node in sshd.nodes]
    return nodes.write_cluster(
        root / f"{name}.yaml", sshd, account, name=name, code=nodes.standin_project(root),
        roles=[(names[0], ["pserver", "trainer"])] + [(x, ["trainer"]) for x in names[1:]],
        job={"mode": "pserver", "pserver": {"command": nodes.STANDIN}, "trainer": {"command": nodes.STANDIN},
             "watchdog": {"enabled": watchdog, "port": nodes.free_port(sshd.nodes[0].address)}})


def measure(root: Path, sshd: SshdCluster, account: nodes.Account, repeat: int, serial: bool) -> None:
    path = make_cluster(root, sshd, account)
    for r in lifecycle.deploy(session(path)):  # the first copy of the code is not timed
        assert r.ok, r.error
    ours, floor, ssh, slow = [], [], [], []
    for _ in range(repeat):  # interleaved: a noisy machine slows all alike
        ours.append(lifecycle_once(path))
        floor.append(floor_once(path))
        ssh.append(ssh_once(path))
        if serial:
            slow.append(lifecycle_once(path, parallel=1))
    ratio = [a / b for a, b in zip(ours, floor)]
    cells = [f"{len(sshd.nodes):>3}", f"{account.key:<5}", f"{spread(ours):>17}", f"{spread(floor):>17}",
             f"{spread(ssh):>17}", f"{spread(ratio):>17}", f"{spread([a / b for a, b in zip(ours, ssh)]):>17}"]
    if serial:
        cells += [f"{spread(slow):>17}", f"{spread([b / a for a, b in zip(ours, slow)]):>17}"]
    print(" ".join(cells), flush=True)
    nodes.remove_workspaces(account, load_cluster(path).name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1,16")
    ap.add_argument("--accounts", default="plain,slow")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--serial", default="16", help="the N at which to time serial too ('' for none)")
    ap.add_argument("--profile", action="store_true", help="take one start at N=1 apart, then stop")
    args = ap.parse_args()
    accounts = [nodes.ACCOUNTS[a] for a in args.accounts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="fanout-"))
    os.environ["FABTRAIN_STATE_DIR"] = str(root / "state")
    try:
        if args.profile:
            from bench.fanout_profile import profile
            sshd = SshdCluster(root / "sshd1", count=1)
            try:
                nodes.ensure_bench_user(sshd.user_key)
                for account in accounts:
                    profile(root, sshd, account, make_cluster, args.repeat)
            finally:
                sshd.close()
            return
        serial_at = {int(x) for x in args.serial.split(",") if x}
        print("seconds: median (min-max) of --repeat", args.repeat, "runs; ratios within each run; watchdog on")
        head = ["N", "account", "fabtrain s", "floor s", "ssh s", "fabtrain/floor", "fabtrain/ssh",
                "serial s", "serial/fabtrain"]
        print(f"{head[0]:>3} {head[1]:<5} " + " ".join(f"{h:>17}" for h in head[2:]), flush=True)
        for n in [int(x) for x in args.nodes.split(",")]:
            sshd = SshdCluster(root / f"sshd{n}", count=n)
            try:
                nodes.ensure_bench_user(sshd.user_key)
                for account in accounts:
                    measure(root, sshd, account, args.repeat, n in serial_at)
            finally:
                sshd.close()
    finally:
        for account in accounts:
            for n in [int(x) for x in args.nodes.split(",")] + [1]:
                nodes.remove_workspaces(account, f"fanout{n}-{account.key}")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
