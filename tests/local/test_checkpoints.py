"""Checkpoints seen (issue 57), with real parts: an unchanged raw PyTorch loop (tests/programs/ckpt_loop.py)
that saves with torch.save every 10 steps, on a local node with its real agent, under on_failure restart.
Its saves show in fab status, fab watch, the dashboard's trainers table and /metrics; a restart says what it
resumed from and the steps it lost; a checkpoint truncated between two generations stops the restart loop
after two, with its cause; the history and the export carry each generation's saves and loads."""
import json
import os
import re
import sys

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.controller.export import export_tensorboard
from fabtrain.dashboard import create_app
from fabtrain.remote.session import Session
from tests.support.local_job import LocalJob  # noqa: F401  (the local_job fixture's jobs)
from tests.support.procscan import wait_for
from workload.ddp import free_port

TOKEN = "t0k3n-for-checkpoints-0123456789abcdef"
HOST = "127.0.0.1:8265"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Host": HOST}


def loop_job(local_job, tmp_path, *args, **watchdog):
    """ckpt_loop.py OUT 60 10 0.05 25 [LINGER]: 60 steps in all, a save every 10, the first run crashes at 25."""
    out = tmp_path / "out"
    job = local_job([("n0", ["trainer"])], mode="collective", master_port=free_port(),
                    trainer={"command": f"python tests/programs/ckpt_loop.py {out} 60 10 0.05 25 {' '.join(args)}"},
                    watchdog={"interval": 0.5, "hang_timeout": 30, "port": free_port(), "on_failure": "restart",
                              "restart_backoff": 1, **watchdog})
    return job, out / "ckpt.pt"


def event(job, kind):
    return next((e for e in job.events("n0") if e["kind"] == kind), None)


@pytest.mark.timeout(300)
def status_saying(job, pattern):
    """`fab status`'s output where `pattern` is found in it, else None."""
    out = job.fab("status").stdout
    return out if pattern.search(out) else None


def test_a_raw_loops_saves_show_in_every_view_and_a_restart_says_what_it_resumed_from_and_lost(local_job, tmp_path):
    alerts = tmp_path / "alerts.jsonl"
    notify = {"command": [sys.executable, "-c", f"import sys; open({str(alerts)!r}, 'a').write(sys.stdin.read() + '\\n')"]}
    job, ckpt = loop_job(local_job, tmp_path, "6", max_restarts=2, no_checkpoint=3, notify=notify)
    job.fab("deploy", "start-trainers", check=True)
    # Generation 0 saved at steps 10 and 20 and crashed at 25; generation 1 loaded the step-20 checkpoint.
    resumed = wait_for(lambda: event(job, "resumed"), 120)
    assert resumed, [e["kind"] for e in job.events("n0")]
    said = f"generation 1 resumed from {ckpt} (step 20, saved "
    assert resumed["reason"].startswith(said) and resumed["reason"].endswith(" before the failure): 5 steps lost"), resumed
    assert (resumed["steps_lost"], resumed["ckpt_step"], resumed["generation"]) == (5, 20, 1)
    # While it lingers after its last save (6 s): fab status says what it resumed from and its last checkpoint.
    wait_for(lambda: "done at step 60" in (job.jd("n0") / "logs" / "trainer-0.log").read_text(), 60)
    last = re.compile(rf"checkpoint: trainer-0 on n0: step 40, [\d.]+ m?s ago, [\d.]+ KiB in [\d.]+ m?s \({ckpt}\); "
                      r"a failure now loses 0 steps, ")
    # Its last steps reach the records within about 0.6 s of its last step, and the agent's view a moment later.
    status = wait_for(lambda: status_saying(job, last), 4)
    assert status, job.fab("status").stdout
    assert f"trainer-0 on n0: {resumed['reason']}" in status, status
    watch = job.fab("watch", "--timeout", "120", timeout=150)
    assert watch.returncode == 0, watch.stdout[-3000:]
    assert "last checkpoint" in watch.stdout and f"trainer-0 on n0: {resumed['reason']}" in watch.stdout
    assert re.search(r"trainer-0\s+n0\s+40 .* 40 \([\d.]+ m?s ago, [\d.]+ KiB, in [\d.]+ m?s\), \+0 steps", watch.stdout), \
        watch.stdout[-2000:]
    # Its 6 s without a save, over job.watchdog.no_checkpoint (3 s): one event, and its alert.
    late = [e for e in job.events("n0") if e["kind"] == "no_checkpoint"][-1:]  # (a slow machine may say one earlier)
    late = late[0] if late else None
    assert late and late["reason"].startswith("no checkpoint for ") and f"step 40 ({ckpt})" in late["reason"], late
    sent = wait_for(lambda: alerts.exists() and [json.loads(x) for x in alerts.read_text().splitlines() if x], 10)
    assert any(a["kind"] == "no_checkpoint" for a in sent), sent

    session = Session(load_cluster(str(job.path)))
    try:
        collector = Collector(session, job_id=job.job_id)
        collector.poll()
        client = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                             "TESTING": True}).test_client()
        view = client.get("/api/job", headers=AUTH).get_json()
        (row,) = view["trainers"]
        assert (row["checkpoint"]["step"], row["checkpoint"]["steps_since"], row["checkpoint"]["path"]) == \
            (40, 0, str(ckpt)) and row["resumed_from"] == str(ckpt)
        assert view["resumed"] == [f"trainer-0 on n0: {resumed['reason']}"]
        prom = client.get("/metrics", headers=AUTH).get_data(as_text=True)
        assert re.search(r'fabtrain_trainer_checkpoint_step\{[^}]*process="trainer-0"\} 40\b', prom), prom[-1500:]
        assert re.search(r'fabtrain_trainer_steps_since_checkpoint\{[^}]*\} 0\b', prom)
        assert "fabtrain_trainer_checkpoint_age_seconds" in prom and "fabtrain_trainer_checkpoint_bytes" in prom
        # The history and the export: each generation's saves (each in its own step count) and loads.
        exported = export_tensorboard(session, str(tmp_path / "tb"), job.job_id)
        assert exported.checkpoints == [f"{job.job_id}/checkpoints.json: 6 saves, 1 loads"]
        gens = json.loads((tmp_path / "tb" / job.job_id / "checkpoints.json").read_text())["trainers"]["trainer-0"]
        assert [(g["generation"], g["loaded"], [s["step"] for s in g["saves"]]) for g in gens] == \
            [(0, None, [10, 20]), (1, str(ckpt), [10, 20, 30, 40])]
    finally:
        session.close()


@pytest.mark.timeout(300)
def test_a_checkpoint_truncated_between_two_generations_stops_the_restarts_after_two(local_job, tmp_path):
    job, ckpt = loop_job(local_job, tmp_path, max_restarts=5)
    job.fab("deploy", "start-trainers", check=True)
    assert wait_for(lambda: event(job, "restarting"), 120), [e["kind"] for e in job.events("n0")]
    os.truncate(ckpt, ckpt.stat().st_size // 2)  # torn on disk before generation 1 loads it (backoff 1 s)
    failed = wait_for(lambda: event(job, "job_failed"), 120, interval=0.3)
    kinds = [e["kind"] for e in job.events("n0")]
    assert failed, kinds
    assert failed["reason"] == ("trainer-0 on n0 exited with code 1; generation 1 and 2 failed loading "
                                f"{ckpt} (step 20): the checkpoint may be damaged; not restarted"), failed
    assert kinds.count("restarted") == 2  # not max_restarts (5): the loop stopped after two
    status = job.fab("status").stdout
    assert "the checkpoint may be damaged; not restarted" in status, status


@pytest.mark.timeout(300)
def test_on_bad_checkpoint_previous_resumes_from_the_checkpoint_before_the_damaged_one_and_runs_to_the_end(
        local_job, tmp_path):
    """ckpt_steps.py: a save every 10 steps to ckpt-<step>.pt, the first run tears ckpt-20.pt and crashes at 25;
    generations 1 and 2 get FABTRAIN_RESUME_FROM=ckpt-20.pt and fail loading it; generation 3 gets ckpt-10.pt."""
    out = tmp_path / "out"
    job = local_job([("n0", ["trainer"])], mode="collective", master_port=free_port(),
                    trainer={"command": f"python tests/programs/ckpt_steps.py {out} 40 10 0.02 25 4"},
                    watchdog={"interval": 0.5, "hang_timeout": 30, "port": free_port(), "on_failure": "restart",
                              "restart_backoff": 0.1, "max_restarts": 5, "on_bad_checkpoint": "previous"})
    job.fab("deploy", "start-trainers", check=True)
    log = job.jd("n0") / "logs" / "trainer-0.log"
    assert wait_for(lambda: log.exists() and "done at step 40" in log.read_text(), 150), \
        (log.read_text()[-3000:] if log.exists() else None, [e["kind"] for e in job.events("n0")])
    torn, before = out / "ckpt-20.pt", out / "ckpt-10.pt"
    said = (f"generation 3 resumes from {before}, the checkpoint before {torn}, which generation 1 and 2 failed "
            "loading")
    events = job.events("n0")
    restarting = [e for e in events if e["kind"] == "restarting"]
    assert [e["generation"] for e in restarting] == [1, 2, 3] and said in restarting[-1]["reason"], restarting
    assert restarting[-1]["resume_from"]["path"] == str(before)
    restarted = [e for e in events if e["kind"] == "restarted"]
    assert restarted[-1]["reason"] == f"generation 3: started trainer-0; {said}", restarted
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert resumed and resumed[-1]["generation"] == 3 and resumed[-1]["reason"].startswith(
        f"generation 3 resumed from {before} (step 10, saved ") and resumed[-1]["reason"].endswith(
        f"), the checkpoint before {torn}, which generation 1 and 2 failed loading"), resumed
    text = log.read_text()
    assert text.count(f"resumed from {before} at step 10") == 1 and f"resumed from {torn}" not in text
    # The hook's word on generation 3's load (each generation's own file), and fab status says the fallback.
    loads = [json.loads(x) for x in (job.jd("n0") / "metrics" / "trainer-0.jsonl.load").read_text().splitlines()]
    assert [(x["load"], x["path"]) for x in loads] == [("loaded", str(before))]
    status = job.fab("status").stdout
    assert f"trainer-0 on n0: {resumed[-1]['reason']}" in status, status
    assert wait_for(lambda: event(job, "finished"), 60), [e["kind"] for e in job.events("n0")]
