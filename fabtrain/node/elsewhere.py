"""A job whose node runs on another machine than the one reading its folder: a Slurm node's records,
read on the login node (`fab status`, `fab logs`, a start's check that nothing runs), where /proc
knows nothing of its pids and its agent's health.json is the word on its processes.

Slurm's step task writes the machine into job.json (fabtrain/node/allocation.py); node ops read it here.
"""
import time

from fabtrain.contract.clock import boot_id
from fabtrain.contract.records import STATUS_PROCESS, record
from fabtrain.contract.states import LIVE
from fabtrain.contract.jobfolder import JobFolder
from fabtrain.node import atomic


def elsewhere(job):
    """True when job.json was written by a node on another machine than this one."""
    machine = job.get("machine") if isinstance(job, dict) else None
    return isinstance(machine, dict) and bool(machine.get("boot_id")) and machine["boot_id"] != boot_id()


def states_from_health(job, health):
    """The processes' states as the node's agent last wrote them (health.json), for a reader on another machine."""
    seen = {p.get("name"): p for p in (health or {}).get("processes", []) if isinstance(p, dict)}
    out = []
    for proc in job.get("processes", []):
        p = seen.get(proc["name"])
        info = {k: p.get(k) for k in ("state", "pid", "exit_code", "signal")} if p else {"state": "not started"}
        out.append(record(STATUS_PROCESS, name=proc["name"], reported_by="agent", **info))
    return out


def running_elsewhere(jd):
    """The job in jd runs on another machine and its agent said, lately, that something of it still runs."""
    job = atomic.read_json(JobFolder(jd).job_json, {})
    if not elsewhere(job):
        return False
    health = atomic.read_json(JobFolder(jd).health)
    if not isinstance(health, dict) or not isinstance(health.get("ts"), (int, float)):
        return False
    fresh = time.time() - health["ts"] < max(10.0, 10 * float(health.get("interval") or 1.0))
    return fresh and any(p.get("state") in {str(s) for s in LIVE} for p in states_from_health(job, health))
