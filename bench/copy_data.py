"""How fast does `fab copy-data` put the shards on the nodes?

On 3 real sshd nodes, with a generated corpus of --size-mb split into one
shard per trainer, in one run, --repeat times each, interleaved, both from
cold (no connection open before the timer starts, as `fab copy-data` runs):

  copy-data (first)   verify, rsync the missing files, verify again (sha256 on the node)
  plain rsync         `rsync -a` of the same files to the same nodes, in parallel, no checks
  copy-data (again)   nothing changed: one verify command per node, no rsync, no bytes sent

Prints every run's throughput (MB/s of shard data) and the ratio copy-data /
plain rsync of each pair (target >= 0.8), median and range, the CPU time the whole machine spent on each (from
/proc/stat: on one small machine that hosts the controller and every node,
both are CPU-bound, and copy-data's extra work -- sha256 of every byte on
the nodes, a second login shell per node for the verify loop -- shows up
one for one), and for the second copy the remote commands and bytes sent.
--bwlimit KB/s (per node, given to both) makes the copy network-bound
instead, as on a real cluster: 40000 is about a 1 GbE link shared by three
nodes.

    .venv/bin/python bench/copy_data.py [--size-mb 300] [--repeat 3] [--bwlimit KBPS] [--account plain|slow]

(Not bench/copy.py: a script of that name shadows the standard library's copy module
for every script run from bench/.)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import nodes  # noqa: E402
from fabtrain.controller import datacopy  # noqa: E402
from fabtrain.config.cluster import load_cluster  # noqa: E402
from fabtrain.data import load_manifest  # noqa: E402
from fabtrain.remote.session import Session  # noqa: E402
from fabtrain.remote.rsync import Rsync  # noqa: E402
from fabtrain.remote.transport import Transport  # noqa: E402
from tests.support.sshd import SshdCluster  # noqa: E402


def make_corpus(path: Path, size_mb: int) -> None:
    words = [f"word{i}" for i in range(5000)]
    line_block = "\n".join(" ".join(words[(i * 31 + k * 17) % 5000] for k in range(12)) for i in range(2000)) + "\n"
    block = line_block.encode()
    with path.open("wb") as f:
        for _ in range(size_mb * (1 << 20) // len(block) + 1):
            f.write(block)


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def busy_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy (all CPUs), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def second_copy(cluster) -> tuple[float, list[str], int]:
    """The second, unchanged copy: its time, what it started on the nodes, the bytes it sent."""
    s = Session(cluster)
    datacopy.copy_data(s)
    calls = []
    originals = datacopy.Channel.__init__, datacopy.RsyncPush.__init__

    def counting(kind, original):
        def init(self, *a, **kw):
            calls.append(kind)
            original(self, *a, **kw)
        return init
    datacopy.Channel.__init__ = counting("node_ops verify loop", originals[0])
    datacopy.RsyncPush.__init__ = counting("rsync", originals[1])
    try:
        t0 = time.perf_counter()
        replies = datacopy.copy_data(s)
        again = time.perf_counter() - t0
    finally:
        datacopy.Channel.__init__, datacopy.RsyncPush.__init__ = originals
        s.close()
    return again, calls, sum(r.value.bytes_sent for r in replies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bwlimit", type=int, default=None, help="KB/s per node, for both tools")
    ap.add_argument("--account", choices=sorted(nodes.ACCOUNTS), default="plain",
                    help="the nodes' login (bench/nodes.py): plain /bin/sh, or root whose .bashrc runs pyenv init")
    args = ap.parse_args()
    account = nodes.ACCOUNTS[args.account]
    root = Path(tempfile.mkdtemp(prefix="copybench-"))
    os.environ["FABTRAIN_STATE_DIR"] = str(root / "state")  # copy-data's hints, wiped with the nodes
    sshd = SshdCluster(root / "sshd", count=3)
    try:
        corpus = root / "corpus.txt"
        make_corpus(corpus, args.size_mb)
        nodes.ensure_bench_user(sshd.user_key)
        path = nodes.write_cluster(root / "c.yaml", sshd, account, name="copybench", code=nodes.standin_project(root),
                                   roles=[(n.name, ["trainer"]) for n in sshd.nodes],
                                   job={"mode": "collective", "trainer": {"command": "true"},
                                        "data": {"dir": str(root / "prepared"), "input": str(corpus)}})
        cluster = load_cluster(path)
        datacopy.split_data(cluster)
        manifest = load_manifest(str(root / "prepared"))
        needed = datacopy.files_per_node(cluster, manifest)
        total = sum(manifest["files"][n]["bytes"] for names in needed.values() for n in names if n in manifest["files"])
        mb = total / 1e6

        def wipe():
            nodes.remove_workspaces(account, "copybench")
            shutil.rmtree(root / "state", ignore_errors=True)  # a first copy: no hint that nodes hold data

        def ours() -> float:
            wipe()
            c0, t0 = busy_cpu_seconds(), time.perf_counter()
            s = Session(cluster)  # connections open inside the timer, as for plain rsync's ssh
            replies = datacopy.copy_data(s, bwlimit=args.bwlimit)
            elapsed, cpu = time.perf_counter() - t0, busy_cpu_seconds() - c0
            assert all(r.ok for r in replies), [r.error for r in replies]
            s.close()
            return elapsed, cpu

        def plain() -> float:
            wipe()
            s = Session(cluster)

            def one(t: Transport):
                limit = [f"--bwlimit={args.bwlimit}"] if args.bwlimit else []
                with Rsync(t, [f"{root / 'prepared'}/"], t.node.workspace + "/plain",
                           [*limit, "--files-from=-", "--from0"], files_from_stdin=True) as run:
                    run.give_files(needed[t.node.name])
                    run.finish()
            c0, t0 = busy_cpu_seconds(), time.perf_counter()
            with ThreadPoolExecutor(len(sshd.nodes)) as pool:
                list(pool.map(one, [s.transport(n) for n in cluster.nodes]))
            return time.perf_counter() - t0, busy_cpu_seconds() - c0

        runs = []
        for _ in range(args.repeat):  # interleaved: a noisy machine slows both alike
            runs.append((ours(), plain()))
        again, calls, sent = second_copy(cluster)
        print(f"shard data to 3 nodes: {mb:.0f} MB")
        print(f"nodes' account: {account.label}; bwlimit per node: {f'{args.bwlimit} KB/s' if args.bwlimit else 'none'}; "
              f"{os.cpu_count()} CPUs; CPU = busy CPU-seconds of the whole machine during the run")
        for i, ((first, first_cpu), (base, base_cpu)) in enumerate(runs, 1):
            print(f"run {i}: copy-data first {first:.2f} s = {mb / first:.0f} MB/s, CPU {first_cpu:.1f} s; "
                  f"plain rsync {base:.2f} s = {mb / base:.0f} MB/s, CPU {base_cpu:.1f} s; "
                  f"ratio {base / first:.2f}")
        ratios = [b / f for (f, _), (b, _) in runs]
        print(f"copy-data first: {spread([mb / f for (f, _), _ in runs])} MB/s (median (min-max))")
        print(f"plain rsync:     {spread([mb / b for _, (b, _) in runs])} MB/s")
        print(f"ratio copy-data/rsync throughput: {spread(ratios, '{:.2f}')} (target >= 0.8)")
        print(f"copy-data again: {again:.2f} s, remote commands {len(calls)} ({', '.join(sorted(set(calls)))}) "
              f"for {len(sshd.nodes)} nodes (one fan-out), bytes sent {sent}")
    finally:
        sshd.close()
        nodes.remove_workspaces(account, "copybench")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
