"""`auto` ports drawn inside a Slurm allocation, by the job's own step, before anything of the job starts.

The batch script's plan (fabtrain/slurm/script.py) holds tokens where an
`auto` port goes (fabtrain/slurm/allocports.py made them at submit, when no
node was known). Each node's step task (allocation.py) first says which ports
in the window a socket holds on its node or another fabtrain job there has
claimed (``busy-<K>.json`` in the shared job folder, K its index in the
allocation); node 0's task waits for every node's file, draws each setting's
port free on every node it is used on (contract/portdraw.py, the draw an SSH
job's controller uses) and leaves the result in ``ports.json``, which every
task waits for and fills its tokens in from. No step of its own: the draw
costs the start a few file reads, not another srun and two Python starts.
Each Slurm attempt draws again (the batch shell removes the last attempt's
files): its nodes may be others. Standard library only.
"""
import json
import os
import random
import time

from fabtrain.contract import portdraw
# The Slurm folder's files (contract/jobfolder.py's SlurmFolder), by the names its tests read them here.
from fabtrain.contract.jobfolder import BUSY, DRAWN_PORTS as DRAWN, PLAN, SlurmFolder  # noqa: F401
from fabtrain.node import atomic
from fabtrain.node.netcheck import busy_ports, claimed_ports

WAIT = 120  # seconds a task waits for the other nodes' reports (node 0) or the draw (the others)
POLL = 0.01


def busy(template, environ):
    """This node's report: {"node": its index in the allocation, "busy": the ports in the window held here}."""
    index = int(environ["SLURM_NODEID"])
    lo, hi = template["ports"]["window"]
    workspace = os.path.abspath(os.path.expanduser(template["nodes"][index]["job"]["workspace"]))
    held = set(busy_ports(lo, hi))
    for claim in claimed_ports(workspace, template.get("job_id")):
        held.update(range(claim["port"], claim["port"] + claim["count"]))
    return {"node": index, "busy": sorted(p for p in held if lo <= p <= hi)}


def reports(folder, nodes):
    """{node index: its busy ports} of every node that has reported (a malformed file is not a report)."""
    got = {}
    for index in range(nodes):
        entry = atomic.read_json(SlurmFolder(folder).busy(index))
        try:
            if int(entry["node"]) == index:
                got[index] = set(int(p) for p in entry["busy"])
        except (ValueError, KeyError, TypeError):
            continue
    return got


def draw(template, reported, rng=None):
    """The ports of the job's `auto` settings, free on every node each is used on, from the nodes' reports
    ({node index: its busy ports})."""
    spec, nodes = template["ports"], len(template["nodes"])
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


def _wait(ready, seconds):
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL)
    return True


def report_and_draw(folder, environ, template, wait=WAIT):
    """This node's part of the draw, in its step task before its part starts: its report, then (node 0)
    the draw once every node reported, or (the others) the draw's result. Returns {setting: port}."""
    if "ports" not in template:
        return {}
    index, nodes = int(environ["SLURM_NODEID"]), len(template["nodes"])
    atomic.write_json(SlurmFolder(folder).busy(index), busy(template, environ))
    result = SlurmFolder(folder).drawn_ports
    if index == 0:
        _wait(lambda: len(reports(folder, nodes)) == nodes, wait)
        try:
            ports = draw(template, reports(folder, nodes))
        except SystemExit as e:  # said to every node: each task's output names why the job did not start
            atomic.write_json(result, {"error": str(e)})
            raise
        atomic.write_json(result, {"ports": ports})
        print("fabtrain: auto ports drawn in the allocation: %s" % ", ".join(
            "%s %d" % (k, v) for k, v in sorted(ports.items())), flush=True)
    elif not _wait(lambda: os.path.exists(result), wait):
        raise SystemExit("fabtrain: node 0 of the allocation drew no auto ports within %g s (%s)" % (wait, result))
    return drawn(folder, template)


def drawn(folder, template):
    """The ports node 0 drew for this attempt ({} for a plan without auto ports)."""
    if "ports" not in template:
        return {}
    ports = atomic.read_json(SlurmFolder(folder).drawn_ports)
    if isinstance(ports, dict) and isinstance(ports.get("error"), str):
        raise SystemExit(ports["error"])
    if not isinstance(ports, dict) or not isinstance(ports.get("ports"), dict):
        raise SystemExit("fabtrain: no auto ports drawn in %s: node 0's step task draws them before the job starts"
                         % SlurmFolder(folder).drawn_ports)
    return ports["ports"]
