"""The `fabtrain` command: what is not a Fabric task.

    fabtrain init [DIR]     a fabfile.py, a commented cluster.yaml and (if there is none) a stand-in
                            train.py to start a project from

Everything else is a `fab` task, run in the project: `fab --list`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fabtrain.errors import reader_gone

FABFILE = '''"""This project's fabtrain tasks: `fab --list`."""
from fabtrain.tasks import *  # noqa: F401,F403
'''

CLUSTER = '''# fabtrain's description of where and how this project trains. `fab plan` shows
# exactly what each node would run; `fab check` checks every node first.
#
#   fab check deploy start-trainers     # ship this folder's code and start training
#   fab status | fab watch | fab logs --follow
#   fab kill-all                        # stop everything, on every node
cluster:
  name: {name}
  workspace: ~/.fabtrain/{name}       # on each node; each node works in <workspace>/<node name>
  # python: ~/venvs/torch/bin/python   # the nodes' interpreter (default python3; local nodes: this one)
  # ssh:
  #   user: ubuntu
  #   key: ~/.ssh/id_ed25519           # or ssh-agent / ~/.ssh/config
  #   known_hosts: ~/.ssh/known_hosts
  #   host_key_policy: accept-new      # strict | accept-new; a changed key is always refused
nodes:
  # Two "nodes" on this machine, to try it out. On servers: {{name: gpu1, host: gpu1.lab, roles: [trainer]}}
  - {{name: node0, host: local, roles: [trainer]}}
  - {{name: node1, host: local, roles: [trainer]}}
job:
  mode: collective                     # torch.distributed / torchrun; `pserver` for parameter servers
  master_port: 29500
  # code: .                            # what `fab deploy` ships (default: this folder, minus .git,
  #                                    # virtualenvs, caches, the data dir and .fabtrainignore's patterns)
  trainer:
    per_node: 1                        # processes per node (torchrun's --nproc-per-node)
    command: python train.py           # runs in a snapshot of the code; RANK, WORLD_SIZE, MASTER_ADDR... are set
  # env: {{NCCL_DEBUG: WARN}}           # extra environment for every process
  watchdog: {{hang_timeout: 300}}        # no metrics record (FABTRAIN_METRICS) for this long: the job is hung
'''


TRAIN = '''"""A stand-in for your training program, written by `fabtrain init`: replace it with yours.

It does what fabtrain looks for in any program: reads its rank from the
environment the plan sets (RANK, WORLD_SIZE, ...) and appends one JSON line of
progress per step to $FABTRAIN_METRICS, which `fab watch`, the dashboard and
the watchdog's hang rule read. Standard library only, so it runs on any node.

    fab check deploy start-trainers     # runs `python train.py` on every node
"""
import json
import math
import os
import time

rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
metrics = os.environ.get("FABTRAIN_METRICS", os.devnull)
print(f"rank {rank} of {world}: starting", flush=True)
for step in range(60):
    time.sleep(0.5)  # your forward and backward pass
    loss = 2.0 * math.exp(-step / 20) + 0.1
    with open(metrics, "a") as f:
        f.write(json.dumps({"ts": time.time(), "role": "trainer", "rank": rank, "step": step, "loss": loss}) + "\\n")
print(f"rank {rank}: done", flush=True)
'''


def init(directory: Path, name: str | None) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    files = {directory / "fabfile.py": FABFILE,
             directory / "cluster.yaml": CLUSTER.format(name=name or _cluster_name(directory))}
    present = [str(p) for p in files if p.exists()]
    if present:
        print(f"fabtrain init: {', '.join(present)} already exist(s); nothing written", file=sys.stderr)
        return 2
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path}")
    train = directory / "train.py"
    if train.exists():
        print(f"kept {train}: cluster.yaml runs it as `python train.py`")
    else:
        train.write_text(TRAIN)
        print(f"wrote {train}: a stand-in that writes progress records; cluster.yaml runs it, replace it with yours")
    print("next: edit cluster.yaml, then `fab plan` and `fab check deploy start-trainers`")
    return 0


def _cluster_name(directory: Path) -> str:
    """A cluster name from the folder's name, in the characters a name may have."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in directory.resolve().name).strip("-")
    return name or "project"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fabtrain", description="fabtrain: distributed training over SSH. "
                                     "Tasks run with `fab` in a project: `fab --list`.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="write a fabfile.py, a commented cluster.yaml and a stand-in train.py "
                                    "(unless there is one) to start a project")
    p.add_argument("directory", nargs="?", default=".", type=Path)
    p.add_argument("--name", help="the cluster's name (default: the folder's)")
    args = parser.parse_args(argv)
    try:
        code = init(args.directory, args.name)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return reader_gone()


if __name__ == "__main__":
    sys.exit(main())
