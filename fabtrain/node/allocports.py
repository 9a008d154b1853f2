"""`auto` ports drawn inside a Slurm allocation, before the job's step starts.

    python -m fabtrain.node.allocports busy <job folder>   a Slurm step, one task a node: this node's
                                                           busy ports, one JSON line on stdout
    python -m fabtrain.node.allocports draw <job folder>   the batch shell: reads those lines
                                                           (busy-ports), writes ports.json

The batch script (fabtrain/slurm/script.py) runs both when its plan has
tokens where an `auto` port goes (fabtrain/slurm/allocports.py made them at
submit, when no node was known). Each node says which ports in the window a
socket holds or another fabtrain job on it has claimed; the batch shell then
draws each setting's port free on every node it is used on (contract/
portdraw.py, the draw an SSH job's controller uses) and leaves them in the
job folder, where each node's task (allocation.py) reads them to fill the
tokens in. Each Slurm attempt draws again: its nodes may be others.
Standard library only.
"""
import json
import os
import random
import sys

from fabtrain.contract import portdraw
from fabtrain.contract import slurm as slurm_output
from fabtrain.node import atomic
from fabtrain.node.netcheck import busy_ports, claimed_ports

PLAN = "plan.json"  # every node's job.json, as the batch shell wrote it (slurm/script.py)
BUSY = "busy-ports"  # what the busy step printed: a JSON line a node
DRAWN = slurm_output.DRAWN_PORTS_FILE  # {"ports": {setting: port}}: what every node's task fills the tokens with


def _template(folder):
    template = atomic.read_json(os.path.join(folder, PLAN))
    if not isinstance(template, dict) or not isinstance(template.get("ports"), dict):
        raise SystemExit("fabtrain: %s: no plan with ports to draw" % os.path.join(folder, PLAN))
    return template


def busy(folder, environ):
    """This node's line: {"node": its index in the allocation, "busy": the ports in the window held here}."""
    template = _template(folder)
    index = int(environ["SLURM_NODEID"])
    lo, hi = template["ports"]["window"]
    workspace = os.path.abspath(os.path.expanduser(template["nodes"][index]["job"]["workspace"]))
    held = set(busy_ports(lo, hi))
    for claim in claimed_ports(workspace, template.get("job_id")):
        held.update(range(claim["port"], claim["port"] + claim["count"]))
    return {"node": index, "busy": sorted(p for p in held if lo <= p <= hi)}


def draw(folder, rng=None):
    """The ports of the job's `auto` settings, free on every node each is used on, from the busy lines."""
    template = _template(folder)
    spec, nodes = template["ports"], len(template["nodes"])
    reported = {}
    try:
        with open(os.path.join(folder, BUSY)) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SystemExit("fabtrain: cannot read the nodes' busy ports (%s): %s" % (BUSY, e.strerror))
    for line in lines:
        try:
            entry = json.loads(line)
            reported[int(entry["node"])] = set(int(p) for p in entry["busy"])
        except (ValueError, KeyError, TypeError):
            continue  # not a node's line (a message srun added): the node missing below says which
    missing = [str(i) for i in range(nodes) if i not in reported]
    if missing:
        raise SystemExit("fabtrain: node %s of the allocation did not say which ports it has busy: "
                         "auto ports cannot be drawn" % ", ".join(missing))
    held = {}
    for where, port, count in spec["held"]:
        held.setdefault(where, set()).update(range(port, port + count))
    wanted = [(setting, [tuple(u) for u in uses]) for setting, uses in spec["auto"]]
    try:
        return portdraw.draw(wanted, held, reported, tuple(spec["window"]), rng or random.SystemRandom())
    except LookupError as e:
        raise SystemExit("fabtrain: auto port %s: no port in %d-%d is free on every node that uses it; "
                         "give a port in cluster.yaml" % (e.args[0], spec["window"][0], spec["window"][1]))


def drawn(folder, template):
    """The ports the batch shell drew for this attempt ({} for a plan without auto ports)."""
    if "ports" not in template:
        return {}
    ports = atomic.read_json(os.path.join(folder, DRAWN))
    if not isinstance(ports, dict) or not isinstance(ports.get("ports"), dict):
        raise SystemExit("fabtrain: no auto ports drawn in %s: the batch script draws them before the job's step"
                         % os.path.join(folder, DRAWN))
    return ports["ports"]


def main(argv):
    if len(argv) != 2 or argv[0] not in ("busy", "draw"):
        print("usage: python -m fabtrain.node.allocports busy|draw <job folder>", file=sys.stderr)
        return 2
    folder = argv[1]
    if argv[0] == "busy":
        print(json.dumps(busy(folder, os.environ), separators=(",", ":")), flush=True)
        return 0
    ports = draw(folder)
    atomic.write_json(os.path.join(folder, DRAWN), {"ports": ports})
    print("fabtrain: auto ports drawn in the allocation: %s" % ", ".join(
        "%s %d" % (k, v) for k, v in sorted(ports.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
