"""Stragglers in synchronous training, on real gloo jobs (torchrun, CPU): every rank steps at the slowest one's
pace, so the rank the others wait for is named from its timings, with its cause: a slow Dataset, or less CPU
(busy processes pinned to its core). A job whose ranks are equally slow has none."""
import os
import subprocess
import sys

import pytest

from tests.conftest import require_import
from tests.support.procscan import wait_for
from tests.support.sshd import free_port

WINDOW = 3


def start(local_job, per_node, args):
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    job = local_job([("n0", ["trainer"])], mode="collective", master_port="auto",
                    trainer={"per_node": per_node,
                             "command": f"torchrun --max-restarts=0 tests/programs/sync_ranks.py {args}"},
                    watchdog={"interval": 0.5, "hang_timeout": 60, "grace": 1, "startup_timeout": 300,
                              "port": free_port(["127.0.0.1"]), "straggler": {"share": 0.7, "window": WINDOW}})
    job.fab("deploy", "start-trainers", check=True)
    return job


def stragglers(job):
    return [e for e in job.events("n0") if e["kind"] == "straggler"]


def test_a_rank_with_a_slow_dataset_is_named_for_its_data_loading(local_job):
    job = start(local_job, 3, "--width 64 --slow-data 1:0.004")
    found = wait_for(lambda: stragglers(job), timeout=150, interval=0.5)
    assert found, (job.events("n0"), job.health("n0"))
    ev = found[0]
    assert ev["rank"] == 1 and ev["cause"] == "data loading" and ev["ratio"] >= 2, ev
    assert ev["reason"].startswith("rank 1 on n0: data loading "), ev
    out = job.fab("status")
    assert "STRAGGLER rank 1: data loading" in out.stdout, out.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin ranks apart")
def test_a_rank_with_less_cpu_is_named_for_its_compute_and_equal_ranks_name_none(local_job):
    cores = sorted(os.sched_getaffinity(0))
    # Ranks 0 and 1 each on a core of their own (--pin); three busy processes share rank 1's.
    busy = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cores[1]}}})\nwhile 1: pass"])
            for _ in range(3)]
    try:
        job = start(local_job, 2, "--pin --width 1024")
        found = wait_for(lambda: stragglers(job), timeout=150, interval=0.5)
        assert found, (job.events("n0"), job.health("n0"))
        assert found[0]["rank"] == 1 and found[0]["cause"] == "compute", found[0]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    job.fab("kill-all", "--grace", "1")
    # The same job without the competing processes: ranks equally fast, nobody named.
    equal = local_job([("n0", ["trainer"])], folder="equal", mode="collective", master_port="auto",
                      trainer={"per_node": 2, "command": "torchrun --max-restarts=0 tests/programs/sync_ranks.py "
                                                         "--width 1024"},
                      watchdog={"interval": 0.5, "hang_timeout": 60, "grace": 1, "startup_timeout": 300,
                                "port": free_port(["127.0.0.1"]), "straggler": {"share": 0.7, "window": WINDOW}})
    equal.fab("deploy", "start-trainers", check=True)
    assert wait_for(lambda: any((p.get("step_rate") or 0) > 0 for p in (equal.health("n0") or {}).get("processes", [])),
                    timeout=150, interval=0.5), equal.health("n0")
    assert not wait_for(lambda: stragglers(equal), timeout=4 * WINDOW, interval=0.5), stragglers(equal)
