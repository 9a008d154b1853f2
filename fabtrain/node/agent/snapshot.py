"""health.json and the heartbeat: what the agent tells the controller and the other agents.

health.json's contract is fabtrain/contract/records.py's HEALTH (docs/architecture.md, docs/watchdog.md):
``ts node job_id interval host gpus processes agent peers`` plus ``job``,
``coordinator``, ``orphans``, ``zombies``, the last five ``events`` and, on the
coordinator's node, ``stragglers`` (the ranks reported behind and still behind).
Every part of it is built here through that table's `record`: a field the table does not name raises.
"""
from __future__ import annotations

import os
import time

from fabtrain.node import atomic, procfs
from fabtrain.contract.records import (HEALTH, HEALTH_AGENT, HEALTH_BLAME, HEALTH_GPU, HEALTH_HOST, HEALTH_JOB,
                                       HEALTH_ORPHAN, HEALTH_PROCESS, HEALTH_STRAGGLER, record)
from fabtrain.contract.states import FINAL, JobState, signal_name
from fabtrain.node.coordination import blame

from . import checkpoints


def process_view(ctx, ledger, procs: dict, gpu_pids: dict) -> dict:
    live_tree = [p for p in ctx.tree if p in procs and not procs[p].dead]
    progress = ctx.progress
    last = None
    if progress is not None:
        last = progress.last_record if progress.last_record is not None else progress.last_activity
    rate = progress.steps.rate() if progress is not None and ctx.live else None
    return record(HEALTH_PROCESS, name=ctx.name, role=ctx.role, rank=ctx.rank, pid=ctx.pid,
                  launcher_pid=ctx.launcher, state=str(ctx.state), exit_code=ctx.exit_code,
                  signal=signal_name(ctx.signal),
                  cpu_percent=progress.cpu_percent if progress and ctx.live else 0.0, rss=ctx.rss,
                  children=max(0, len(live_tree) - 1) if ctx.live else 0,
                  zombies=sum((z[0], z[2]) in ledger.zombies_seen for z in ctx.zombies),  # reported ones
                  last_progress=round(last, 3) if last else None,
                  last_record=round(progress.last_record, 3) if progress and progress.last_record else None,
                  step_rate=round(rate, 3) if rate is not None else None,
                  hung=ctx.name in ledger.hung, killed_by_agent=ctx.close_reason,
                  gpu_mem=sum(gpu_pids.get(p, 0) for p in live_tree) if gpu_pids else None,
                  **checkpoints.health_fields(ctx))


class Health:
    """Writes health.json; measures the agent's own CPU between two snapshots.

    Given once what stays for the agent's life (its settings, samplers, event
    log, keeper); each `write` is given what changes: the ledger, the process
    contexts, the /proc table, GPU memory by pid, and the coordinator link."""

    def __init__(self, path: str, cfg, host, gpus, events, life, started: float, restarted: bool):
        self.path, self.cfg, self.host, self.gpus, self.events, self.life = path, cfg, host, gpus, events, life
        self.started, self.restarted, self.pid = started, restarted, os.getpid()
        me = procfs.stat(self.pid)
        self.own_cpu, self.own_t = (me.cpu if me else 0.0), time.monotonic()

    def _own_cpu_percent(self) -> float:
        me = procfs.stat(self.pid)
        cpu, mono = (me.cpu if me else 0.0), time.monotonic()
        percent = round(100.0 * (cpu - self.own_cpu) / max(1e-3, mono - self.own_t), 2)
        self.own_cpu, self.own_t = cpu, mono
        return percent

    def write(self, now: float, ledger, contexts, procs: dict, gpu_pids: dict, link, startup_deadline: float,
              straggling: list = (), blame: dict | None = None) -> None:
        cfg, me, view = self.cfg, procs.get(self.pid), link.view
        processes = [process_view(ctx, ledger, procs, gpu_pids) for ctx in contexts]
        snapshot = record(
            HEALTH, ts=round(now, 3), node=cfg.node, job_id=cfg.job_id, interval=cfg.interval,
            host=record(HEALTH_HOST, **self.host.sample()), gpus=[record(HEALTH_GPU, **g) for g in self.gpus.sample()],
            gpu_error=self.gpus.error if self.gpus.error != "no NVIDIA driver" else None, processes=processes,
            agent=record(HEALTH_AGENT, pid=self.pid, rss=me.rss if me else None,
                         cpu_percent=self._own_cpu_percent(), started=round(self.started, 3),
                         restarted=self.restarted, keeper_pid=self.life.keeper_pid,
                         launcher_pid=self.life.launcher),
            peers=view.get("peers") or {},
            job=record(HEALTH_JOB, status=ledger.status.status, reason=ledger.status.reason,
                       origin=ledger.status.origin, on_failure=cfg.on_failure, generation=ledger.generation,
                       restarts_left=view.get("restarts_left"), pending=ledger.pending,
                       # min_nodes: the nodes that left the job and the trainers of the smaller world
                       out=view.get("out") or [], world_size=view.get("world_size"), back=view.get("back"),
                       spare=cfg.spare or None, slot=(view.get("stand_in") or {}).get(cfg.node) if cfg.spare else None,
                       kept=cfg.on_failure == "keep" and ledger.status.status == JobState.FAILED,
                       # when startup_timeout fails a start that has not come together (the controller's
                       # "starting: ... left"); none once that check is done or cannot fire any more
                       startup_deadline=None if ledger.startup_checked else round(startup_deadline, 3)),
            coordinator=link.health(),
            orphans=[record(HEALTH_ORPHAN, pid=o.pid, name=o.name, job_id=o.job or cfg.job_id, reason=o.reason)
                     for o in ledger.orphans],
            zombies=sum(p["zombies"] for p in processes),
            events=self.events.recent,
            stragglers=[record(HEALTH_STRAGGLER, **s) for s in straggling],
            # after a hang: the rank(s) the others wait for; job: every node's ranks (the coordinator's node)
            blame=record(HEALTH_BLAME, **blame) if blame else None)
        try:
            atomic.write_json(self.path, snapshot, durable=False)  # rewritten every interval
        except OSError:
            pass  # a full disk: events.jsonl says why


def timing_rows(ctx) -> list:
    """[rank, data, compute, comm, step time] of each watched rank of a process whose records carry the
    three timings (means a step over the last seconds): the synchronous straggler rule's input."""
    rows = []
    for rank, r in sorted(ctx.progress.ranks.items() if ctx.progress else (), key=lambda kr: str(kr[0])):
        if r not in ctx.progress.watched():
            continue
        t = r.mean_timings()
        if all(k in t for k in ("data_time", "compute_time", "comm_time")):
            rows.append([rank, round(t["data_time"], 5), round(t["compute_time"], 5), round(t["comm_time"], 5),
                         round(t["step_time"], 5) if "step_time" in t else None])
    return rows


def send_rows(ctx) -> list:
    """[rank, share of samples with its sends backed up, mean send backlog in bytes, share of samples with bytes
    received and unread] of each watched rank whose sockets the agent sampled (supervisor's sample_sends: while
    it spends time in collectives): the communication straggler's input. A beat field of its own, `sendq`,
    beside the 5-element `timing` rows: an agent that reads only `timing` is unchanged, one that reads a beat
    without `sendq` has no backlog to judge by, and a 3-element row (an older agent's) has no unread share."""
    rows = []
    for rank, r in sorted(ctx.progress.ranks.items() if ctx.progress else (), key=lambda kr: str(kr[0])):
        b = r.send_backlog() if isinstance(rank, int) and r in ctx.progress.watched() else None
        if b is not None:
            rows.append([rank, round(b[0], 3), round(b[1]), round(b[2], 3)])
    return rows


def failure(ledger) -> dict | None:
    """This node's failure as its beats carry it; `before`: its earlier part's (the coordinator counts the node
    that says it as there, not done)."""
    if not ledger.failure:
        return None
    said = {"reason": ledger.failure, "kind": ledger.failure_kind, "exit_code": ledger.failure_code,
            "generation": ledger.generation, "loaded": checkpoints.as_beat(ledger.failure_loaded)}
    if ledger.failure_before:
        said["before"] = True
    return said


def beat(job: dict, ledger, contexts, done: bool, generation: int, rank_views=()) -> dict:
    """The heartbeat the coordinator gets, whole (coordination/protocol.py: a connection carries what
    changed): `generation` is the one this node last started; `done`: nothing of the job is left here;
    `rank_views`: each rank's last step and stack at this node's dump of stacks (a hang's), per process."""
    procs = {ctx.name: {"role": ctx.role, "rank": ctx.rank, "state": str(ctx.state), "exit_code": ctx.exit_code,
                        "rate": ctx.progress.steps.rate() if ctx.progress and ctx.live else None}
             for ctx in contexts}
    for ctx in contexts:
        rows = timing_rows(ctx) if ctx.live and ctx.role == "trainer" else []
        if rows:
            procs[ctx.name]["timing"] = rows
            sends = send_rows(ctx)
            if sends:
                procs[ctx.name]["sendq"] = sends
    for ctx in contexts:
        if ctx.role == "trainer" and ctx.live:  # the coordinator's node's no_checkpoint rule (checkpoints.py)
            procs[ctx.name].update(checkpoints.beat_fields(ctx))
    for v in rank_views:
        if v.name in procs:
            procs[v.name].setdefault("ranks", []).extend(blame.to_beat([v]))
    status = ledger.status
    final = {"status": status.status, "reason": status.reason, "node": status.origin} \
        if status.status in FINAL else None
    return {"op": "beat", "job_id": job["job_id"], "node": job["node"],
            "procs": procs, "done": done,
            "failure": failure(ledger), "final": final,
            "generation": generation, "trainers_expected": job.get("trainers"), "part": job.get("part")}
