"""What a finished job's progress looks like from the controller: the dashboard's trainers table and charts
(its API, through the real Flask app and collector) and the TensorBoard export, read back with TensorBoard."""
from __future__ import annotations

from pathlib import Path

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.controller.export import export_tensorboard
from fabtrain.dashboard import create_app
from fabtrain.remote.session import Session

TOKEN = "t0k3n-for-progress-0123456789abcdef"
HOST = "127.0.0.1:8265"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Host": HOST}


def progress_views(cluster: Path, job_id: str, out: Path) -> tuple[dict, dict, dict]:
    """(the trainers table by name, the charts' series by trainer, {trainer: {tag: [(step, value)]}} exported)."""
    session = Session(load_cluster(str(cluster)))
    try:
        collector = Collector(session, job_id=job_id)
        collector.poll()
        client = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                             "TESTING": True}).test_client()
        rows = {t["name"]: t for t in client.get("/api/job", headers=AUTH).get_json()["trainers"]}
        series = client.get("/api/metrics", headers=AUTH).get_json()["trainers"]
        export_tensorboard(session, str(out / "tb"), job_id)
    finally:
        session.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = {}
    for name in rows:
        acc = EventAccumulator(str(out / "tb" / job_id / name))
        acc.Reload()
        scalars[name] = {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return rows, series, scalars
