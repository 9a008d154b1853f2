"""Progress from unchanged Lightning, Hugging Face Trainer, accelerate and paddle programs (docs/progress.md):
the framework's own step, what it logs, its total steps, in the records and the views; the same results with the
hook as without it."""
import importlib.util
import json

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.controller.export import export_tensorboard
from fabtrain.dashboard import create_app
from fabtrain.remote.session import Session
from tests.conftest import require
from tests.support.launched import launched, read_records
from workload.ddp import free_port

pytestmark = pytest.mark.timeout(900)
TOKEN = "t0k3n-for-progress-0123456789abcdef"
HOST = "127.0.0.1:8265"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Host": HOST}


def installed(module):
    """Asked of the import system, not imported: the job's processes import it, this one need not."""
    require(importlib.util.find_spec(module) is not None, module, "installed by `make test` (requirements-test.txt)")


def finished_job(local_job, command, per_node=1):
    job = local_job([("n0", ["trainer"])], mode="collective", master_port=free_port(),
                    trainer={"per_node": per_node, "command": command}, watchdog={"interval": 0.5, "port": free_port()})
    job.fab("deploy", "start-trainers", check=True)
    watch = job.fab("watch", "--timeout", "800", timeout=840)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    recs = [json.loads(x) for x in (job.jd("n0") / "metrics" / "trainer-0.jsonl").read_text().splitlines()]
    return job, watch.stdout, recs


def views(job, tmp_path):
    session = Session(load_cluster(str(job.path)))
    try:
        collector = Collector(session, job_id=job.job_id)
        collector.poll()
        client = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                             "TESTING": True}).test_client()
        rows = {t["name"]: t for t in client.get("/api/job", headers=AUTH).get_json()["trainers"]}
        series = client.get("/api/metrics", headers=AUTH).get_json()["trainers"]
        export_tensorboard(session, str(tmp_path / "tb"), job.job_id)
    finally:
        session.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = {}
    for name in rows:
        acc = EventAccumulator(str(tmp_path / "tb" / job.job_id / name))
        acc.Reload()
        scalars[name] = {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return rows, series, scalars


def test_a_lightning_ddp_script_reports_its_steps_logs_and_total(local_job, tmp_path):
    installed("pytorch_lightning")
    job, watch, recs = finished_job(local_job, "torchrun --max-restarts=0 tests/programs/lightning_ddp.py 40", 2)
    for rank in (0, 1):
        mine = [r for r in recs if r["rank"] == rank]
        assert mine[-1]["step"] == 40 and mine[-1]["total_steps"] == 40, mine[-1]  # max_steps, as Lightning knows it
        assert all(r["framework"] == "lightning" and r["source"] == "auto" for r in mine)
        assert mine[-1]["train_loss"] > 0 and mine[-1]["loss"] == mine[-1]["train_loss"] and mine[-1]["epoch"] == 1
        assert [r["step"] for r in mine] == sorted(r["step"] for r in mine)
    assert "40/40" in watch and "trainer-0.rank1" in watch
    rows, series, scalars = views(job, tmp_path)
    assert set(rows) == {"trainer-0", "trainer-0.rank1"}
    assert all(t["step"] == 40 and t["total_steps"] == 40 and t["framework"] == "lightning" for t in rows.values())
    assert series["trainer-0"]["loss"]["x"][-1] == 40
    assert scalars["trainer-0.rank1"]["train/loss"][-1][0] == 40 and "time/step" in scalars["trainer-0"]


def test_a_hugging_face_trainer_reports_its_steps_logs_and_total(local_job, tmp_path):
    installed("transformers")
    job, watch, recs = finished_job(local_job, f"python tests/programs/hf_trainer.py {tmp_path / 'out'} 20")
    assert all(r["framework"] == "transformers" and r["rank"] == 0 for r in recs)
    last = recs[-1]
    assert last["step"] == 20 and last["total_steps"] == 20 and 0 < last["epoch"] <= 1, last
    assert last["loss"] > 0 and "grad_norm" in last and last["learning_rate"] > 0  # what it logs, its names
    assert "20/20" in watch
    rows, series, scalars = views(job, tmp_path)
    (t,) = rows.values()
    assert t["step"] == 20 and t["total_steps"] == 20 and t["loss"] > 0
    assert series["trainer-0"]["loss"]["x"][-1] == 20 and scalars["trainer-0"]["train/loss"][-1][0] == 20


def test_an_accelerate_loop_reports_its_steps_loss_and_what_it_logs_and_computes_the_same(tmp_path):
    installed("accelerate")
    loop = ["tests/programs/accelerate_loop.py", "30"]
    off = launched(tmp_path / "off", loop, tmp_path / "off.jsonl", FABTRAIN_INSTRUMENT="0")
    on = launched(tmp_path / "on", loop, tmp_path / "on.jsonl")
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout and on.stdout.startswith("weights")  # its weights, bit for bit
    recs = read_records(tmp_path / "on.jsonl")
    assert recs and all(r["framework"] == "accelerate" and r["source"] == "auto" for r in recs), recs[:2]
    last = recs[-1]
    assert last["step"] == 30 and last["lr"] == 0.05 and last["samples_per_s"] > 0, last
    # what it logs, under its own names; the loss is the last step's (the tensor backward() ran on)
    assert last["loss"] == pytest.approx(last["train_loss"], rel=1e-6) and last["abs_weight"] > 0, last
    assert all(k in last for k in ("data_time", "compute_time", "comm_time", "backward_time")), last


def test_a_paddle_loop_reports_its_steps_loss_and_lr_and_computes_the_same(tmp_path):
    installed("paddle")
    # paddle_dp.py alone is a world of one (init_parallel_env does nothing without a cluster's environment)
    run = ["tests/programs/paddle_dp.py", str(tmp_path)]
    off = launched(tmp_path / "off", run, tmp_path / "off.jsonl", FABTRAIN_INSTRUMENT="0")
    weights_off = (tmp_path / "paddle-rank-0.json").read_text()
    on = launched(tmp_path / "on", run, tmp_path / "on.jsonl")
    assert on.returncode == off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    assert on.stdout == off.stdout and (tmp_path / "paddle-rank-0.json").read_text() == weights_off
    recs = read_records(tmp_path / "on.jsonl")
    assert recs and all(r["framework"] == "paddle" and r["source"] == "auto" for r in recs), recs[:2]
    last = recs[-1]
    printed = float(on.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])  # "paddle rank 0/1 step 9 loss 0.1331"
    assert last["step"] == 10 and last["lr"] == 0.1 and round(last["loss"], 4) == printed, (last, printed)
    assert last["backward_time"] > 0 and last["optimizer_time"] > 0, last
