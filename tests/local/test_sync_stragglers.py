"""Stragglers in synchronous training, on real DDP jobs (torchrun, gloo, CPU) of a script that knows nothing of
fabtrain: every rank steps at the slowest one's pace, so the rank the others wait for is named from the timings
the launcher's progress hook reports (DDP's gradient all-reduce waits at the end of backward(): the hook counts
that wait as comm_time), with its cause: a slow Dataset, or less CPU (a cgroup's CPU quota). A job whose ranks
are equally slow has none."""
import json
import os
from pathlib import Path

import pytest

from tests.conftest import require, require_import
from tests.support.procscan import wait_for
from tests.support.sshd import free_port

WINDOW = 3


def start(local_job, per_node, args, folder=None):
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    job = local_job([("n0", ["trainer"])], folder=folder, mode="collective", master_port="auto",
                    trainer={"per_node": per_node,
                             "command": f"torchrun --max-restarts=0 tests/programs/sync_ranks.py {args}"},
                    watchdog={"interval": 0.5, "hang_timeout": 60, "grace": 1, "startup_timeout": 300,
                              "port": free_port(["127.0.0.1"]), "straggler": {"share": 0.7, "window": WINDOW}})
    job.fab("deploy", "start-trainers", check=True)
    return job


def hook_records(job):
    """The trainer's records: every one the hook's (the script writes none), of both ranks, with timings."""
    recs = [json.loads(x) for x in (job.jd("n0") / "metrics" / "trainer-0.jsonl").read_text().splitlines()]
    assert recs and all(r["source"] == "auto" and r["framework"] == "torch" for r in recs), recs[:3]
    timed = [r for r in recs if "comm_time" in r]
    assert {r["rank"] for r in timed} == {0, 1}, recs[:3]
    return timed


def stragglers(job):
    return [e for e in job.events("n0") if e["kind"] == "straggler"]


def test_a_rank_with_a_slow_dataset_is_named_for_its_data_loading(local_job):
    job = start(local_job, 2, "--ddp --width 64 --slow-data 1:0.004")
    found = wait_for(lambda: stragglers(job), timeout=150, interval=0.5)
    assert found, (job.events("n0"), job.health("n0"))
    ev = found[0]
    assert ev["rank"] == 1 and ev["cause"] == "data loading" and ev["ratio"] >= 2, ev
    assert ev["reason"].startswith("rank 1 on n0: data loading "), ev
    # What named it: rank 0 waits for rank 1 in DDP's all-reduce, rank 1 waits for its batches.
    last = {r["rank"]: r for r in hook_records(job)}
    assert last[1]["data_time"] > 2 * last[0]["data_time"] and last[0]["comm_time"] > last[1]["comm_time"], last
    out = job.fab("status")
    assert "STRAGGLER rank 1: data loading" in out.stdout, out.stdout


def test_a_rank_with_less_cpu_is_named_for_its_compute(local_job):
    """Rank 1 moves itself into a cgroup capped at 10% of a core (cgroup v1's cpu controller)."""
    root = Path("/sys/fs/cgroup/cpu")
    require(os.access(root / "cgroup.procs", os.W_OK), "a writable cgroup cpu controller",
            "the test caps one rank's CPU with a cgroup (run as root where /sys/fs/cgroup/cpu is writable)")
    cgroup = root / f"fabtrain-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "cpu.cfs_period_us").write_text("100000")
        (cgroup / "cpu.cfs_quota_us").write_text("10000")
        job = start(local_job, 2, f"--ddp --width 512 --cgroup 1:{cgroup}")
        found = wait_for(lambda: stragglers(job), timeout=150, interval=0.5)
        assert found, (job.events("n0"), job.health("n0"))
        assert found[0]["rank"] == 1 and found[0]["cause"] == "compute" and found[0]["ratio"] >= 1.5, found[0]
        out = job.fab("status")
        assert "STRAGGLER rank 1: compute" in out.stdout, out.stdout
        job.fab("kill-all", "--grace", "1")
    finally:
        wait_for(lambda: not (cgroup / "cgroup.procs").read_text().strip(), timeout=10)
        cgroup.rmdir()


@pytest.mark.alone
def test_equal_ranks_name_no_straggler(local_job):
    """The same job without the cap: ranks equally fast, nobody named. Alone on the machine: beside another
    test file's processes on these 2 cores one rank may really get less CPU for seconds (seen in a CI
    rehearsal), and then naming it is right."""
    equal = start(local_job, 2, "--ddp --width 512", folder="equal")
    assert wait_for(lambda: any((p.get("step_rate") or 0) > 0 for p in (equal.health("n0") or {}).get("processes", [])),
                    timeout=150, interval=0.5), equal.health("n0")
    assert not wait_for(lambda: stragglers(equal), timeout=4 * WINDOW, interval=0.5), stragglers(equal)
