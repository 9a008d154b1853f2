"""What `fab check`'s probe of one node costs, now that torch is asked about CUDA only when it was built for a GPU.

Each trial is a fresh interpreter on this machine running the node side of the probe op
(`fabtrain.node.probe.op_probe`), as a node runs it for `fab check`:

  probe     the probe as it is: a CPU build of torch is read from its version.py, not imported
  baseline  the same probe, then torch imported in a child to ask for CUDA (`torch_cuda_by_import`), as every
            probe did before

Both in the same run, alternated, best and median of --repeat; prints their wall seconds, the CPU seconds of
the interpreter and its children, and the ratio probe/baseline (wall, median). With torch built for CUDA the
two are the same work: the bench says so and measures nothing.

    .venv/bin/python bench/probe.py [--repeat 5]
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fabtrain.node import probe  # noqa: E402

CODE = """import sys
from fabtrain.node import probe
reply = probe.op_probe({"cluster": "bench", "node": "n1", "workspace": sys.argv[1]})
if sys.argv[2] == "baseline":
    probe.torch_cuda_by_import()
"""


def trial(kind: str, workspace: str) -> tuple[float, float]:
    """Wall and CPU seconds (the interpreter and its children) of one probe."""
    before = os.times()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CODE, workspace, kind], cwd=REPO, check=True)
    wall = time.perf_counter() - t0
    after = os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print("load average before: %s" % " ".join(Path("/proc/loadavg").read_text().split()[:3]))
    if probe.torch_has_gpu_build():
        print("torch here was built for a GPU: the probe imports it as the baseline does; nothing to measure")
        return
    got: dict = {"probe": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="fabtrain-probe-") as ws:
        for _ in range(args.repeat):
            for kind in got:
                got[kind].append(trial(kind, os.path.join(ws, "w")))
    print(f"{'':<9} {'wall best s':>11} {'wall median s':>13} {'cpu median s':>12}")
    for kind, rows in got.items():
        walls, cpus = [w for w, _ in rows], [c for _, c in rows]
        print(f"{kind:<9} {min(walls):>11.3f} {statistics.median(walls):>13.3f} {statistics.median(cpus):>12.3f}")
    ratio = statistics.median(w for w, _ in got["probe"]) / statistics.median(w for w, _ in got["baseline"])
    print(f"probe/baseline (wall, median): {ratio:.3f}")
    print("load average after: %s" % " ".join(Path("/proc/loadavg").read_text().split()[:3]))


if __name__ == "__main__":
    main()
