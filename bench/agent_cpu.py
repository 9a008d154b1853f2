"""What does one node agent cost when its machine runs many processes?

An agent follows its job's processes every step (interval 1 s here) through
their children files, and lists /proc every 5 s to notice a stray of an
earlier job; a process it does not lead to is read once it has lived through
a listing. On a real node that is a few hundred processes; on one machine
that runs many `host: local` nodes (the issue's 200-node job) it is every
node's processes, listed by every agent.

A one-node local job (a trainer that prints a line every 10 s) runs; for each
--extra count, that many `sleep` processes are started beside it and the
agent's CPU (utime + stime from /proc, over --window s) is measured, --repeat
times, interleaved. Prints ms of CPU per second and the ratio to the same
agent with no extra processes (the baseline, measured in the same run).

    .venv/bin/python bench/agent_cpu.py [--extra 0,600,1200] [--repeat 3] [--window 20]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import yaml  # noqa: E402

from bench.fanout import spread  # noqa: E402
from fabtrain.node.agent import loop  # noqa: E402

# An agent reads a new process once it has lived through one listing of /proc, at the next: within
# two periods (the code before this setting listed every step: 0.5 s of margin is as fair to it).
SETTLE = 2 * getattr(loop, "LIST_PERIOD", 0.5) + 2
from tests.support.sshd import free_port  # noqa: E402

TRAINER = "sh -c 'while :; do echo tick; sleep 10; done'"


def fab(env: dict, *args: str) -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "fab"), *args], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"fab {' '.join(args)} failed: {out.stdout[-500:]}{out.stderr[-500:]}")


def agent_pid(workspace: Path) -> int:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[1:3] == [b"-m", b"fabtrain.node.agent"] and argv[3].decode().startswith(str(workspace)):
                return int(name)
    raise SystemExit("no agent found")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(pid: int, extra: int, window: float) -> float:
    """The agent's CPU in ms a second with `extra` sleeping processes beside it."""
    sleepers = [subprocess.Popen(["sleep", str(int(window) + 30)]) for _ in range(extra)]
    try:
        time.sleep(SETTLE)  # the agent reads each new process once: not the steady cost
        c0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(window)
        return 1000 * (cpu_s(pid) - c0) / (time.monotonic() - t0)
    finally:
        for p in sleepers:
            p.kill()
        for p in sleepers:
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", default="0,600,1200")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--window", type=float, default=20.0)
    args = ap.parse_args()
    counts = [int(x) for x in args.extra.split(",")]
    if counts[0] != 0:
        counts.insert(0, 0)
    root = Path(tempfile.mkdtemp(prefix="agent-cpu-"))
    (root / "code").mkdir()
    (root / "code" / "README").write_text("a stand-in project\n")
    cluster = {"cluster": {"name": "agentcpu", "workspace": str(root / "ws")},
               "nodes": [{"name": "a0", "host": "local", "roles": ["trainer"]}],
               "job": {"mode": "collective", "code": str(root / "code"), "trainer": {"command": TRAINER},
                       "watchdog": {"interval": 1, "port": free_port(["127.0.0.1"])}}}
    (root / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    env = {**os.environ, "FABTRAIN_CLUSTER": str(root / "cluster.yaml"), "FABTRAIN_STATE_DIR": str(root / "state")}
    fab(env, "deploy")
    fab(env, "start-trainers")
    try:
        pid = agent_pid(root / "ws")
        print(f"agent pid {pid}; {len(os.listdir('/proc'))} /proc entries before; interval 1 s", flush=True)
        rows: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.repeat):  # interleaved
            for n in counts:
                rows[n].append(measure(pid, n, args.window))
                print(f"  {n:5} extra processes: {rows[n][-1]:.1f} ms CPU a second", flush=True)
        print(f"{'extra processes':>16} {'agent ms CPU a second':>24} {'/ with none':>18}")
        for n in counts:
            ratio = [v / b for v, b in zip(rows[n], rows[0])]
            print(f"{n:>16} {spread(rows[n], '{:.1f}'):>24} {spread(ratio):>18}")
    finally:
        fab(env, "kill-all")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
