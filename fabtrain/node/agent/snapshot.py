"""health.json and the heartbeat: what the agent tells the controller and the other agents.

health.json's contract (docs/architecture.md, docs/watchdog.md): ``ts node
job_id interval host gpus processes agent peers`` plus ``job``,
``coordinator``, ``orphans``, ``zombies`` and the last five ``events``.
"""
from __future__ import annotations

import os
import time

from fabtrain.node import atomic, procfs
from fabtrain.node.states import signame

from .policy import FINAL


def process_view(ctx, ledger, procs: dict, gpu_pids: dict) -> dict:
    live_tree = [p for p in ctx.tree if p in procs and not procs[p].dead]
    progress = ctx.progress
    last = None
    if progress is not None:
        last = progress.last_record if progress.last_record is not None else progress.last_activity
    return {"name": ctx.name, "role": ctx.role, "rank": ctx.rank, "pid": ctx.pid,
            "launcher_pid": ctx.launcher, "state": str(ctx.state), "exit_code": ctx.exit_code,
            "signal": signame(ctx.signal) if ctx.signal else None,
            "cpu_percent": progress.cpu_percent if progress and ctx.live else 0.0, "rss": ctx.rss,
            "children": max(0, len(live_tree) - 1) if ctx.live else 0, "zombies": len(ctx.zombies),
            "last_progress": round(last, 3) if last else None,
            "last_record": round(progress.last_record, 3) if progress and progress.last_record else None,
            "hung": ctx.name in ledger.hung, "killed_by_agent": ctx.close_reason,
            "gpu_mem": sum(gpu_pids.get(p, 0) for p in live_tree) if gpu_pids else None}


class Health:
    """Writes health.json; measures the agent's own CPU between two snapshots."""

    def __init__(self, path: str):
        self.path = path
        me = procfs.stat(os.getpid())
        self.own_cpu, self.own_t = (me.cpu if me else 0.0), time.monotonic()

    def _own_cpu_percent(self) -> float:
        me = procfs.stat(os.getpid())
        cpu, mono = (me.cpu if me else 0.0), time.monotonic()
        percent = round(100.0 * (cpu - self.own_cpu) / max(1e-3, mono - self.own_t), 2)
        self.own_cpu, self.own_t = cpu, mono
        return percent

    def write(self, agent, now: float) -> None:
        ledger, c, co = agent.ledger, agent.client, agent.coordinator
        me = agent.procs.get(agent.pid)
        view = agent.coord_view
        processes = [process_view(ctx, ledger, agent.procs, agent.gpu_pids) for ctx in agent.contexts]
        snapshot = {
            "ts": round(now, 3), "node": agent.node, "job_id": agent.job_id, "interval": agent.cfg.interval,
            "host": agent.host.sample(), "gpus": agent.gpus.sample(), "processes": processes,
            "agent": {"pid": agent.pid, "rss": me.rss if me else None, "cpu_percent": self._own_cpu_percent(),
                      "started": round(agent.started, 3), "restarted": agent.restarted,
                      "keeper_pid": agent.life.keeper_pid, "launcher_pid": agent.life.launcher},
            "peers": view.get("peers") or {},
            "job": {"status": ledger.status.status, "reason": ledger.status.reason, "origin": ledger.status.origin,
                    "on_failure": agent.cfg.on_failure, "generation": ledger.generation,
                    "restarts_left": view.get("restarts_left"), "pending": ledger.pending,
                    "kept": agent.cfg.on_failure == "keep" and ledger.status.status == "failed",
                    # when startup_timeout fails a start that has not come together (the controller's
                    # "starting: ... left"); none once that check is done or cannot fire any more
                    "startup_deadline": None if ledger.startup_failed else round(agent.startup_deadline, 3)},
            "coordinator": {"host": agent.coord_host, "port": agent.coord_port, "hosted_here": co is not None,
                            "connected": bool(c and c.connected),
                            "last_contact": round(c.last_contact_epoch, 3) if c and c.last_contact_epoch else None,
                            "error": (c.error if c else None) or (co.bind_error if co else None),
                            "lost": view.get("lost") or [], "done": view.get("done") or []},
            "orphans": [{"pid": o.pid, "name": o.name, "job_id": o.job or agent.job_id, "reason": o.reason}
                        for o in ledger.orphans],
            "zombies": sum(p["zombies"] for p in processes),
            "events": agent.events.recent,
        }
        if agent.gpus.error and agent.gpus.error != "no NVIDIA driver":
            snapshot["gpu_error"] = agent.gpus.error
        try:
            atomic.write_json(self.path, snapshot)
        except OSError:
            pass  # a full disk: events.jsonl says why


def beat(agent) -> dict:
    """The heartbeat the coordinator gets (coordination.py's protocol)."""
    ledger = agent.ledger
    procs = {ctx.name: {"role": ctx.role, "rank": ctx.rank, "state": str(ctx.state), "exit_code": ctx.exit_code}
             for ctx in agent.contexts}
    status = ledger.status
    final = {"status": status.status, "reason": status.reason, "node": status.origin} \
        if status.status in FINAL else None
    return {"op": "beat", "job_id": agent.job_id, "node": agent.node,
            "ts": time.time(), "procs": procs, "done": agent.is_done,
            "failure": {"reason": ledger.failure, "kind": ledger.failure_kind, "exit_code": ledger.failure_code,
                        "generation": ledger.generation} if ledger.failure else None, "final": final,
            "generation": agent.started_generation,
            "trainers_expected": agent.job.get("trainers")}
