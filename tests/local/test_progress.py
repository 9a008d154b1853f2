"""Progress from unchanged programs (docs/progress.md): the launcher's hook in real torch programs.

Programs that know nothing of fabtrain, run through the real launcher (and, for
the torchrun job, `fab` on a local node): their records, what the views make
of them (the collector, the dashboard's /api/job, /api/metrics and /metrics,
`fab watch`, the TensorBoard export), and what the hook must never do (change
the output, numerics or RNG; break the program; count a program's own records
twice).
"""
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.controller.export import export_tensorboard
from fabtrain.dashboard import create_app
from fabtrain.remote.session import Session
from fabtrain.contract.states import JobState
from tests.support.local_job import LocalJob  # noqa: F401  (the local_job fixture's jobs)
from tests.support.launched import launched, launched_at_once, read_records, torch_exit_race
from workload.ddp import free_port

TOKEN = "t0k3n-for-progress-0123456789abcdef"
HOST = "127.0.0.1:8265"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Host": HOST}
TIMINGS = ("step_time", "data_time", "compute_time", "comm_time")
OFF = {"FABTRAIN_INSTRUMENT": "0"}  # job.watchdog.instrument: false


@pytest.mark.timeout(600)
def test_the_hook_reports_a_plain_loop_and_changes_nothing_of_it(tmp_path):
    loop = ["tests/programs/torch_loop.py", "40", "0", "600"]  # 40 steps, then 6 s or more of evaluation
    # job.watchdog.instrument: false: the same launcher and sitecustomize, no records. Its evaluation is of one
    # batch: the program draws the same random numbers however long it evaluates (one iterator), so its output
    # is the longer run's, and only a run with the hook has records to make in the evaluation.
    # The three runs (this one, with the hook, with a hook that fails) at once: each its own process and files,
    # their evaluations mostly asleep.
    (tmp_path / "dir.jsonl").mkdir()
    off, on, broken = launched_at_once((tmp_path / "off", loop[:-1] + ["1"], tmp_path / "off.jsonl", OFF),
                                       (tmp_path / "on", loop, tmp_path / "on.jsonl", {}),
                                       (tmp_path / "broken", loop, tmp_path / "dir.jsonl", {}))
    assert off.returncode == 0 and off.stdout.startswith("weights"), off.stderr
    assert not (tmp_path / "off.jsonl").exists()
    assert on.returncode == 0, on.stderr
    # The same output, bit for bit: the weights (numerics) and the next random numbers (RNG).
    assert on.stdout == off.stdout and on.stderr == off.stderr == ""
    everything = read_records(tmp_path / "on.jsonl")
    recs = [r for r in everything if not r.get("between_steps")]
    # Evaluating (batches and forwards, no step): a record each 5 s with the same step, so it reads as busy.
    busy = everything[len(recs):]
    assert busy and all(r["between_steps"] and r["step"] == 40 and "loss" not in r for r in busy), everything[-3:]
    assert recs and all(r["source"] == "auto" and r["framework"] == "torch" and r["rank"] == 0 for r in recs)
    assert recs[0]["step"] == 1 and recs[-1]["step"] == 40, [r["step"] for r in recs]  # the first at once, the last too
    assert [r["step"] for r in recs] == sorted({r["step"] for r in recs})
    assert "child" not in recs[0]  # the launcher's own program
    last = recs[-1]
    assert all(last[k] >= 0 for k in TIMINGS) and last["step_time"] >= 0.005  # it sleeps 5 ms a step
    assert abs(last["step_time"] - (last["data_time"] + last["compute_time"] + last["comm_time"])) < 1e-3
    assert last["lr"] == 0.05 and last["loss"] > 0 and 0 < last["samples_per_s"] < 4 / 0.005
    assert len(recs) < 40  # at most one record each 0.5 s after the first: not a record a step


    # A failure inside the hook (its file cannot be opened): said once in the log, the program goes on.
    assert broken.returncode == 0 and broken.stdout == off.stdout
    said = [line for line in broken.stderr.splitlines() if line.startswith("fabtrain progress:")]
    assert len(said) == 1 and "Is a directory" in said[0] and "the program goes on" in said[0], broken.stderr
    assert len(broken.stderr.splitlines()) == 1, broken.stderr  # no traceback


@pytest.mark.timeout(300)
def test_a_ddp_job_of_three_ranks_computes_the_same_with_the_hook_and_its_all_reduce_wait_is_comm_time(tmp_path):
    """DDP's gradient all-reduce runs in its C++ reducer at the end of backward(): the hook marks where the
    backward's computation ends (an end-of-backward callback ahead of DDP's) and counts the rest as comm_time.
    Three ranks, so DDP averages by a factor that is not a power of two: any change to the arithmetic shows."""
    def run(tag, **env):
        out_dir = tmp_path / tag / "out"
        out_dir.mkdir(parents=True)
        argv = ["-m", "torch.distributed.run", "--nproc-per-node=3", "--master-port", str(free_port()),
                "tests/programs/ddp_min.py", str(out_dir)]
        # unbuffered, as a job's plan runs trainers: a rank that torchrun stops after another's abort has its lines out
        done = launched(tmp_path / tag, argv, tmp_path / f"{tag}.jsonl", PYTHONUNBUFFERED="1", **env)
        # Without the hook, torch's own race at a rank's exit may abort it after its last line and its weights
        # (both compared below, so a rank cut short still fails): the baseline's, not fabtrain's.
        assert done.returncode == 0 or tag == "off" and torch_exit_race(done), done.stderr[-3000:]
        lines = sorted(re.findall(r"rank (\d)/3 step (\d+) loss (\S+?)(?=rank|\n|$)", done.stdout))  # 3 ranks, 1 stdout
        assert len(lines) == 3 * 20, done.stdout
        return lines, [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(3)]

    with ThreadPoolExecutor(2) as pool:  # the two jobs at once: their own ports, folders and files
        off, on = (f.result() for f in [pool.submit(run, "off", **OFF), pool.submit(run, "on")])
    assert on == off  # every rank's losses and final weights, bit for bit (json floats round-trip exactly)
    assert not (tmp_path / "off.jsonl").exists()
    recs = [r for r in read_records(tmp_path / "on.jsonl") if not r.get("between_steps")]
    assert {r["rank"] for r in recs} == {0, 1, 2} and all(r["child"] for r in recs), recs[:3]
    for r in recs:
        assert all(r[k] >= 0 for k in TIMINGS) and r["comm_time"] > 0, r  # every step waits for the all-reduce
        assert abs(r["step_time"] - (r["data_time"] + r["compute_time"] + r["comm_time"])) < 1e-3, r
    assert max(r["step"] for r in recs) == 20


@pytest.mark.timeout(300)
def test_a_program_that_writes_its_own_records_keeps_them_alone(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = launched(tmp_path, ["tests/programs/torch_loop.py", "60", "30"], metrics)  # its own records from step 30
    assert out.returncode == 0, out.stderr
    recs = read_records(metrics)
    own = [r for r in recs if r.get("source") != "auto"]
    assert [r["step"] for r in own] == list(range(30, 61))
    auto_after = [r for r in recs[recs.index(own[0]):] if r.get("source") == "auto"]
    assert len(auto_after) <= 1, auto_after  # the hook stops at its next record once it has seen the program's
    # The views count the program's records only, from its first one.
    from fabtrain.node import history
    rows = history.by_row("trainer-0", metrics.read_text().splitlines())
    assert list(rows) == ["trainer-0"] and all(r.get("source") != "auto" for r in rows["trainer-0"])


def test_a_program_that_only_prints_is_running_and_shows_its_last_line(local_job):
    """Before any record, what a program prints is its sign of life: fab status and the dashboard say
    running, nothing is stale, no startup failure is threatened; its last line is in the trainers table
    and in fab watch."""
    job = local_job([("n0", ["trainer"])], mode="collective", master_port=free_port(),
                    trainer={"command": "python tests/programs/talker.py 25"},
                    watchdog={"interval": 0.5, "startup_timeout": 300, "port": free_port()})
    job.fab("deploy", "start-trainers", check=True)
    session = Session(load_cluster(str(job.path)))
    collector = Collector(session, job_id=job.job_id)
    app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST], "TESTING": True,
                      "STALE_AFTER": 2.0})
    client = app.test_client()
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            collector.poll()
            snap = collector.snapshot()
            if snap.verdict.state == JobState.RUNNING and (snap.node("n0").health or {}).get("processes"):
                break
            time.sleep(0.5)
        time.sleep(3)  # longer than STALE_AFTER: the log moves, so it is not stale
        collector.poll()
        view = client.get("/api/job", headers=AUTH).get_json()
        assert view["state"] == "running" and view["sentence"].startswith("job running"), view["sentence"]
        assert "startup_timeout" not in view["sentence"] and view["startup_deadline"] is None
        (t,) = view["trainers"]
        assert t["name"] == "trainer-0" and t["records"] == 0 and not t["stale"] and view["stale"] == []
        assert t["last_line"].startswith("loading shard ")
        status = job.fab("status").stdout
        assert status.startswith(f"job {job.job_id}: running") and "fails the start" not in status, status
        watch = job.fab("watch", "--timeout", "2").stdout
        assert "none yet; log: loading shard " in watch and "starting" not in watch, watch
    finally:
        session.close()
        job.fab("kill-all", "--grace", "1")


@pytest.mark.timeout(600)
def test_a_torchrun_ddp_job_shows_every_rank_in_every_view(local_job, tmp_path):
    """The tutorial's DDP script under torchrun (2 workers on one node, gloo), unchanged: every rank's
    records, a trainer row for each rank in the dashboard, fab watch and /metrics, the charts' series
    and the TensorBoard scalars."""
    job = local_job([("n0", ["trainer"])], mode="collective", master_port=free_port(),
                    trainer={"per_node": 2, "command": "torchrun --max-restarts=0 tests/programs/ddp_tutorial.py 60 0.001"},
                    watchdog={"interval": 0.5, "port": free_port()})
    job.fab("deploy", "start-trainers", check=True)
    watch = job.fab("watch", "--timeout", "500", timeout=540)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    assert "trainer-0.rank1" in watch.stdout
    jd = job.jd("n0")
    recs = read_records(jd / "metrics" / "trainer-0.jsonl")  # torchrun's workers share their process's file
    assert {r["rank"] for r in recs} == {0, 1} and {r["local_rank"] for r in recs} == {0, 1}
    for rank in (0, 1):
        mine = [r for r in recs if r["rank"] == rank and not r.get("between_steps")]  # (busy, exiting: no step)
        assert mine[0]["step"] == 1 and mine[-1]["step"] == 64, [r["step"] for r in mine]  # 4 epochs of 16 batches
        assert all(r["child"] and r["framework"] == "torch" and r["source"] == "auto" for r in mine)
        assert all(r[k] >= 0 for r in mine for k in TIMINGS)
        assert mine[-1]["data_time"] > 0 and mine[-1]["samples_per_s"] > 0 and mine[-1]["loss"] > 0
    log = (jd / "logs" / "trainer-0.log").read_text()
    assert "epoch 3 | batches 16 | loss" in log and "fabtrain progress:" not in log

    session = Session(load_cluster(str(job.path)))
    try:
        collector = Collector(session, job_id=job.job_id)
        collector.poll()
        app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST], "TESTING": True})
        client = app.test_client()
        view = client.get("/api/job", headers=AUTH).get_json()
        rows = {t["name"]: t for t in view["trainers"]}
        assert set(rows) == {"trainer-0", "trainer-0.rank1"}, rows
        assert rows["trainer-0"]["step"] == 64 and rows["trainer-0.rank1"]["step"] == 64
        assert rows["trainer-0.rank1"]["rank"] == 1 and rows["trainer-0.rank1"]["process"] == "trainer-0"
        assert rows["trainer-0"]["step_time"] > 0 and rows["trainer-0.rank1"]["label"] == rows["trainer-0"]["label"]
        series = client.get("/api/metrics", headers=AUTH).get_json()["trainers"]
        # The loss at the steps it was read (docs/progress.md): the last point is the last sampled step's.
        sampled = {name: max(r["step"] for r in recs if r["rank"] == rank and "loss" in r and "loss_step" not in r
                             and not r.get("between_steps")) for rank, name in enumerate(sorted(rows))}
        for name in rows:
            assert len(series[name]["loss"]["x"]) >= 2 and series[name]["loss"]["x"][-1] == sampled[name], sampled
            assert series[name]["samples_per_s"]["y"][-1] > 0
        prom = client.get("/metrics", headers=AUTH).get_data(as_text=True)
        assert 'process="trainer-0.rank1"} 64' in prom and "fabtrain_trainer_data_time_seconds" in prom

        exported = export_tensorboard(session, str(tmp_path / "tb"), job.job_id)
        assert sorted(r.split(":")[0] for r in exported.runs) == [f"{job.job_id}/trainer-0", f"{job.job_id}/trainer-0.rank1"]
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        for run in ("trainer-0", "trainer-0.rank1"):
            acc = EventAccumulator(str(tmp_path / "tb" / job.job_id / run))
            acc.Reload()
            tags = set(acc.Tags()["scalars"])
            assert {"train/loss", "train/samples_per_s", "time/step", "time/data", "time/compute"} <= tags, tags
            assert acc.Scalars("train/loss")[-1].step == sampled[run] and acc.Scalars("time/step")[-1].step == 64
    finally:
        session.close()


@pytest.mark.timeout(300)
def test_the_hook_keeps_no_graph_alive_a_program_that_swaps_a_leafs_data_between_steps_runs_as_without_it(tmp_path):
    """A program that gives a leaf new data of another shape each step (the reference pserver trainer's sparse
    rows) fails its backward if anything keeps the last step's graph alive: autograd then reuses the leaf's
    cached gradient accumulator, with the old shape."""
    program = ["tests/programs/swapped_leaf.py"]
    off, on = launched_at_once((tmp_path / "off", program, tmp_path / "off.jsonl", OFF),
                               (tmp_path / "on", program, tmp_path / "on.jsonl", {}))
    assert off.returncode == 0 and off.stdout.startswith("grad sum"), off.stderr
    assert on.returncode == 0, on.stderr
    assert on.stdout == off.stdout and on.stderr == ""
    recs = [r for r in read_records(tmp_path / "on.jsonl") if not r.get("between_steps")]
    assert recs and recs[-1]["step"] == 30 and recs[-1]["loss"] > 0, recs[-1:]


@pytest.mark.timeout(300)
def test_a_loop_under_the_torch_profiler_with_python_stacks_runs_as_without_the_hook_and_its_steps_count(tmp_path):
    """The hook counts steps where torch's step wrapper calls Optimizer._optimizer_step_code, which the profiler
    also hooks with its Python tracer: a closure there crashed the profiled program (SIGSEGV)."""
    program = ["tests/programs/profiled_loop.py", "7"]
    off = launched(tmp_path / "off", program, tmp_path / "off.jsonl", FABTRAIN_INSTRUMENT="0")
    on = launched(tmp_path / "on", program, tmp_path / "on.jsonl")
    assert off.returncode == 0 and on.returncode == 0, on.stderr[-2000:]
    assert on.stdout == off.stdout and "adam's steps 7" in on.stdout, on.stdout
    recs = [r for r in read_records(tmp_path / "on.jsonl") if not r.get("between_steps")]
    assert recs and recs[-1]["step"] == 7, recs[-1:]
