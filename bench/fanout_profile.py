"""bench/fanout.py --profile: where one start-and-stop on one node spends its time.

Each step of `deploy start-pserver start-trainers` + `kill-all` timed apart,
--repeat times; what each step starts (SSH sessions over the open
connection, OpenSSH connections for rsync, Python interpreters on the node,
processes, settle waits); and the unit costs those are made of, measured in
the same run: one round trip of `true`, of `python -c pass`, of a node-ops
call that does nothing, an OpenSSH connection with the default key exchange
and with curve25519 (what the open connection uses), and kill-all with the
watchdog off against on.
"""
from __future__ import annotations

import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

from bench import nodes
from fabtrain.controller import lifecycle
from fabtrain.remote import rpc
from fabtrain.remote.rsync import Rsync
from fabtrain.remote.transport import Transport

SETTLE = 0.1  # node ops' start waits this long for a program that dies at once (ops.py, payload "settle")


class Tally:
    """Counts what fabtrain starts, by wrapping the three ways it reaches a node."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.times: dict[str, list[float]] = {}
        self._saved = (Transport.call, Transport.run, Rsync.__init__, Rsync.finish)
        tally = self

        def call(t, op, payload, **kw):
            tally.counts[f"node-ops {op} (SSH session + python)"] += 1
            return tally._saved[0](t, op, payload, **kw)

        def run(t, command, **kw):
            tally.counts["shell command (SSH session)"] += 1
            return tally._saved[1](t, command, **kw)

        def rsync_init(r, t, sources, remote_dir, *a, **kw):
            r.what = "rsync runtime" if "/runtime/" in remote_dir else "rsync code"
            tally.counts[f"{r.what} (OpenSSH connection + remote rsync)"] += 1
            r.began = time.perf_counter()
            tally._saved[2](r, t, sources, remote_dir, *a, **kw)

        def rsync_finish(r, *a, **kw):
            try:
                return tally._saved[3](r, *a, **kw)
            finally:
                tally.add(f"  {r.what} (start to end)", time.perf_counter() - r.began)
        Transport.call, Transport.run, Rsync.__init__, Rsync.finish = call, run, rsync_init, rsync_finish

    def add(self, step: str, seconds: float) -> None:
        self.times.setdefault(step, []).append(seconds)

    def timed(self, step: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.add(step, time.perf_counter() - t0)
        return out

    def restore(self) -> None:
        Transport.call, Transport.run, Rsync.__init__, Rsync.finish = self._saved


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f} s ({min(values):.3f}-{max(values):.3f})"


def one_start(tally: Tally, path: Path) -> tuple[float, dict]:
    from bench.fanout import session
    s = session(path)
    t0 = time.perf_counter()
    tally.timed("connect (paramiko, curve25519)", lambda: s.map(lambda t: t.open()))
    tally.timed("  code identity (local git/hash)", lifecycle.code_identity, s.cluster.code_dir())
    deployed = tally.timed("deploy", lifecycle.deploy, s)
    ps = tally.timed("start-pserver", lifecycle.start, s, ("pserver",))
    tr = tally.timed("start-trainers", lifecycle.start, s, ("trainer",))
    killed = tally.timed("kill-all", lifecycle.kill_all, s, grace=2)
    tally.add("total", time.perf_counter() - t0)
    s.close()
    for r in deployed + ps.replies + tr.replies + killed:
        assert r.ok, r.error
    started = [p.name for r in ps.replies + tr.replies for p in r.value.started]
    return started, killed[0].value


def unit_costs(path: Path, repeat: int, python: str) -> dict[str, list[float]]:
    from bench.fanout import session
    s = session(path)
    t = s.transport(s.cluster.nodes[0])
    t.open()
    costs: dict[str, list[float]] = {}

    def timed(label, fn):
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            costs.setdefault(label, []).append(time.perf_counter() - t0)
    timed("round trip `true` (open connection)", lambda: t.run("true"))
    timed(f"round trip `{python} -c pass`", lambda: t.run(f"{python} -c pass"))
    timed("round trip node-ops call (status, no job)", lambda: rpc.call(t, "status", {"job_id": None}))
    ssh = [*nodes.openssh_argv(t, path.parent), "true"]
    timed("OpenSSH `ssh node true`, default kex (sntrup761x25519)", lambda: subprocess.run(ssh, check=True))
    fast = ssh[:1] + ["-o", "KexAlgorithms=curve25519-sha256"] + ssh[1:]
    timed("OpenSSH `ssh node true`, curve25519-sha256", lambda: subprocess.run(fast, check=True))
    s.close()
    return costs


def kill_costs(root: Path, sshd, account, make_cluster, repeat: int) -> dict[str, list[float]]:
    from bench.fanout import session
    costs: dict[str, list[float]] = {}
    for watchdog in (False, True):
        path = make_cluster(root, sshd, account, watchdog=watchdog)
        s = session(path)
        lifecycle.deploy(s)
        for _ in range(repeat):
            lifecycle.start(s, ("pserver",))
            lifecycle.start(s, ("trainer",))
            time.sleep(0.5)  # the agent is up and beating, as it would be
            t0 = time.perf_counter()
            assert all(r.ok and not r.value.left for r in lifecycle.kill_all(s, grace=2))
            costs.setdefault(f"kill-all of a running job, watchdog {'on' if watchdog else 'off'}", []).append(
                time.perf_counter() - t0)
        s.close()
    return costs


def profile(root: Path, sshd, account, make_cluster, repeat: int) -> None:
    path = make_cluster(root, sshd, account)
    from bench.fanout import session
    for r in lifecycle.deploy(session(path)):
        assert r.ok, r.error
    tally = Tally()
    try:
        for _ in range(repeat):
            started, kill = one_start(tally, path)
    finally:
        tally.restore()
    print(f"\n== N=1, account {account.label}: one start-and-stop, {repeat} times ==")
    for step, values in tally.times.items():
        print(f"  {step:<58} {fmt(values)}")
    print(f"  what one start-and-stop starts ({repeat} runs counted, per run):")
    for what, count in sorted(tally.counts.items()):
        print(f"    {count / repeat:4.0f}  {what}")
    print(f"    {len(started):4d}  processes started by start ({', '.join(started)}), "
          f"{sum(1 for n in started if n == 'agent')} of them a Python (the agent)")
    print(f"    {2:4d}  settle waits of {SETTLE:g} s on the node (one per start)")
    print(f"    {len(kill.killed):4d}  pids signalled by kill-all "
          f"({', '.join(sorted({k.name for k in kill.killed}))})")
    print("  unit costs, same run:")
    costs = unit_costs(path, repeat, account.python)
    costs.update(kill_costs(root, sshd, account, make_cluster, repeat))
    for label, values in costs.items():
        print(f"  {label:<58} {fmt(values)}")
    nodes.remove_workspaces(account, "fanout1-" + account.key)
