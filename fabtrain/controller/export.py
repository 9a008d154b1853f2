"""`fab export --tensorboard DIR`: every trainer's metrics as TensorBoard event files.

One run directory per job and trainer (DIR/<job id>/<trainer>), so
TensorBoard's run selector compares jobs and trainers side by side. The
files are written with the `tensorboard` package's own writer and protos
(no torch: the controller does not have it); the metrics come from the
nodes through the run history's `job` op. Each trainer's checkpoint saves and loads (the launcher's hook's,
generation by generation) go to DIR/<job id>/checkpoints.json, and each save into the trainer's run as the
scalars checkpoint/bytes and checkpoint/save_seconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fabtrain.controller import history, records
from fabtrain.controller.lifecycle import no_job
from fabtrain.errors import UserError
from fabtrain.contract import jobid
from fabtrain.remote.session import Session

# metrics record field -> TensorBoard tag
TAGS = {"loss": "train/loss", "samples_per_s": "train/samples_per_s", "eval_loss": "eval/loss", "lr": "train/lr",
        # the launcher's hook's per-step timings (docs/progress.md), seconds
        "step_time": "time/step", "data_time": "time/data", "compute_time": "time/compute", "comm_time": "time/comm"}
ALL_POINTS = 1 << 40  # the `job` op thins a long series for the page; an export wants every point


@dataclass
class Exported:
    runs: list[str] = field(default_factory=list)  # "<job>/<trainer>: N points"
    checkpoints: list[str] = field(default_factory=list)  # "<job>/checkpoints.json: N saves, M loads"
    unreachable: list[str] = field(default_factory=list)


def _writer_parts():
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise UserError("the tensorboard package is not installed here: pip install 'fabtrain[tensorboard]' "
                        "(or pip install tensorboard)") from None
    return EventFileWriter, event_pb2, summary_pb2


def write_run(run_dir: Path, points: list[dict]) -> int:
    """One trainer's records as scalars in run_dir; returns how many records had a step."""
    EventFileWriter, event_pb2, summary_pb2 = _writer_parts()
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(run_dir))
    written = 0
    try:
        for p in points:
            step = p.get("step")
            if not records.finite(step):
                continue
            values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(p[key]))
                      for key, tag in TAGS.items() if records.finite(p.get(key))]
            if not values:
                continue
            wall = float(p["ts"]) if records.finite(p.get("ts")) else 0.0
            writer.add_event(event_pb2.Event(wall_time=wall, step=int(step), summary=summary_pb2.Summary(value=values)))
            written += 1
    finally:
        writer.close()
    return written


def _points(columns: dict) -> list[dict]:
    keys = [k for k in columns if isinstance(columns.get(k), list)]
    n = max((len(columns[k]) for k in keys), default=0)
    return [{k: columns[k][i] for k in keys if i < len(columns[k])} for i in range(n)]


def export_tensorboard(session: Session, out_dir: str, job_id: str | None = None) -> Exported:
    _writer_parts()  # say it is missing before asking any node
    jobid.checked(job_id, UserError, optional=True)
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--tensorboard {out_dir}: exists and is not a directory")
    if job_id:
        ids = [job_id]
    else:
        listed = history.list_jobs(session)
        ids = [j["job_id"] for j in listed["jobs"]]
    result = Exported()
    for jid in ids:
        detail = history.job_detail(session, jid, max_points=ALL_POINTS)
        if detail is None or detail.get("found") is None:
            if job_id:
                raise no_job(jid) if detail is None else UserError(f"--job {jid}: no node could be reached")
            continue
        result.unreachable += [f"{u['node']}: {u['error']}" for u in detail.get("unreachable") or []
                               if f"{u['node']}: {u['error']}" not in result.unreachable]
        for trainer, columns in sorted(detail["series"].items()):
            if not trainer.startswith("trainer"):
                continue
            n = write_run(out / jid / trainer, _points(columns))
            result.runs.append(f"{jid}/{trainer}: {n} points")
        saved = {t: gens for t, gens in (detail.get("checkpoints") or {}).items() if t.startswith("trainer")}
        if any(g["saves"] or g["loaded"] for gens in saved.values() for g in gens):
            result.checkpoints.append(write_checkpoints(out / jid, saved))
    return result


def write_checkpoints(job_dir: Path, saved: dict[str, list[dict]]) -> str:
    """Each trainer's checkpoint saves and loads, generation by generation: checkpoints.json in the job's folder,
    and each save as scalars of the trainer's run (checkpoint/bytes, checkpoint/save_seconds, at its step)."""
    EventFileWriter, event_pb2, summary_pb2 = _writer_parts()
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "checkpoints.json").write_text(json.dumps(
        {"trainers": saved, "about": "each trainer's checkpoint saves (step, at, path, bytes, seconds) and the "
                                     "checkpoint each generation loaded, as the launcher's hook saw them"}, indent=1))
    for trainer, gens in saved.items():
        saves = [c for g in gens for c in g["saves"]]
        if not saves:
            continue
        run = job_dir / trainer
        run.mkdir(parents=True, exist_ok=True)
        writer = EventFileWriter(str(run), filename_suffix=".checkpoints")
        try:
            for c in saves:
                values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(c[key]))
                          for key, tag in (("bytes", "checkpoint/bytes"), ("seconds", "checkpoint/save_seconds"))
                          if records.finite(c.get(key))]
                if values:
                    writer.add_event(event_pb2.Event(wall_time=float(c.get("at") or 0.0), step=int(c["step"]),
                                                     summary=summary_pb2.Summary(value=values)))
        finally:
            writer.close()
    saves = sum(len(g["saves"]) for gens in saved.values() for g in gens)
    loads = sum(1 for gens in saved.values() for g in gens if g["loaded"])
    return f"{job_dir.name}/checkpoints.json: {saves} saves, {loads} loads"
