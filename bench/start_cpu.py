"""Where the CPU of a 64-node `fab start-trainers` goes, on one machine: the profile of a start.

bench/scale.py times `fab start-trainers` against 64 parallel `ssh node true`
on the same 64 real sshd nodes (127.0.0.2-65, the plain account of
bench/nodes.py, a stand-in collective job: one `sleep 600` trainer a node,
watchdog on, interval 1 s). Both are bound by CPU here: 64 nodes share 2
cores. This says whose CPU it is, --repeat times, interleaved, with no
sampler running beside them (each figure is a difference of two readings):

  controller       this process and its children (paramiko, or the OpenSSH clients)
  sshd sessions    every process the node's sshd started and reaped during the
                   command (its session processes and all they ran: for a start,
                   node ops' Python), read as the growth of each listener's
                   cutime + cstime
  agents / launchers / trainers
                   the processes the start left running, whole (they are new)

    .venv/bin/python bench/start_cpu.py [--nodes 64] [--repeat 3]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from bench import nodes  # noqa: E402
from bench.scale import ACCOUNT, cpu_now, do_kill, do_start, ssh_true, standin_job, with_session  # noqa: E402
from fabtrain.controller import lifecycle  # noqa: E402
from fabtrain.contract.launcher import is_launcher  # noqa: E402
from tests.support.sshd import SshdCluster  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def reaped(listeners: list[int]) -> float:
    """CPU seconds of everything the sshd listeners have reaped so far (cutime + cstime)."""
    total = 0
    for pid in listeners:
        st = proc_stat(pid)
        if st:
            total += int(st[13]) + int(st[14])
    return total / TICK


def children(pid: int) -> bool:
    """Whether process `pid` has a child (an sshd listener: a session still open)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return bool(f.read().strip())
    except OSError:
        return False


def kind(argv: list[str]) -> str:
    if is_launcher(argv):
        return "launchers"
    if "fabtrain.node.agent" in argv:
        return "agents"
    if argv[:1] == ["sleep"]:
        return "trainers"
    return ""


def live(before: set) -> dict[str, tuple[int, float]]:
    """{kind: (count, CPU seconds)} of the processes of a kind not in `before` (pids)."""
    out: dict[str, list] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in before:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        k, st = kind(argv), proc_stat(int(d))
        if k and st:
            entry = out.setdefault(k, [0, 0.0])
            entry[0] += 1
            entry[1] += (int(st[11]) + int(st[12])) / TICK
    return {k: (v[0], v[1]) for k, v in out.items()}


def pids() -> set:
    return {int(d) for d in os.listdir("/proc") if d.isdigit()}


def settled(listeners: list[int]) -> None:
    """Until every listener has reaped its closed sessions (they close a moment after the client does)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(children(pid) for pid in listeners):
        time.sleep(0.1)


def measure(fn, listeners: list[int]) -> dict[str, float]:
    settled(listeners)  # what ran before (a kill-all) is not this command's
    before, r0 = pids(), reaped(listeners)
    c0, t0 = cpu_now(), time.perf_counter()
    fn()
    wall, controller = time.perf_counter() - t0, cpu_now() - c0
    settled(listeners)
    row = {"wall": wall, "controller": controller, "sshd sessions": reaped(listeners) - r0}
    for k, (_, cpu) in live(before).items():
        row[k] = cpu
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.nodes
    root = Path(tempfile.mkdtemp(prefix="start-cpu-"))
    os.environ["FABTRAIN_STATE_DIR"] = str(root / "state")
    sshd = SshdCluster(root / "sshd", count=n)
    name = "startcpu"
    try:
        nodes.ensure_bench_user(sshd.user_key)
        listeners = [x.process.pid for x in sshd.nodes[:n]]
        path = standin_job(root, sshd, name, [x.name for x in sshd.nodes[:n]])
        with_session(lifecycle.deploy)()
        rows: dict[str, list[dict]] = {"ssh": [], "start": []}
        for _ in range(args.repeat):  # interleaved
            rows["ssh"].append(measure(lambda: ssh_true(path), listeners))
            rows["start"].append(measure(with_session(do_start), listeners))
            with_session(do_kill)()
        print(f"== {n} sshd nodes ({ACCOUNT.label}), {args.repeat} runs each, medians; CPU in ms a node ==")
        keys = ["wall", "controller", "sshd sessions", "agents", "launchers", "trainers"]
        print(f"{'':<8}" + "".join(f"{k:>16}" for k in keys) + f"{'all CPU':>16}")
        for what, runs in rows.items():
            cells = []
            for k in keys:
                values = [r.get(k, 0.0) for r in runs]
                med = statistics.median(values)
                cells.append(f"{med:>14.2f} s" if k == "wall" else f"{1000 * med / n:>16.1f}")
            total = statistics.median(sum(v for k, v in r.items() if k != "wall") for r in runs)
            print(f"{what:<8}" + "".join(cells) + f"{1000 * total / n:>16.1f}")
        walls = [s["wall"] / r["wall"] for s, r in zip(rows["start"], rows["ssh"])]
        print(f"start / ssh (wall): {statistics.median(walls):.2f}x ({min(walls):.2f}-{max(walls):.2f}); "
              f"CPU of the 2 cores the start used: {statistics.median(sum(v for k, v in r.items() if k != 'wall') / r['wall'] for r in rows['start']) * 100:.0f}%")
    finally:
        sshd.close()
        nodes.remove_workspaces(ACCOUNT, name)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
