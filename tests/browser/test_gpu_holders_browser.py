"""The dashboard's cluster table names who holds each busy GPU of a node, in a real browser (Chromium).

The node's inventory is a STAND-IN (no GPU here): GPU 0 used by a real process outside fabtrain, GPU 1
leased (a real flock) by a process carrying a fabtrain job id, GPU 2 free. The node ops' `collect` reads
it as for a real node; the page shows it through /api/cluster.
"""
import json
import os
import subprocess
import sys

from fabtrain.node import gpuinv, gpulease
from tests.support.synthetic import dashboard, local_cluster

TOKEN = "gpu-holders-browser-token-0123456789"
JOB = "20261124-070000-9a9a"
LEASE = ("import time; from fabtrain.node import gpulease\n"
         "held = gpulease.take([1], 1)\n"
         "print(sorted(held), flush=True)\n"
         "time.sleep(120)\n")


def test_the_cluster_table_names_the_fabtrain_job_or_user_and_pid_holding_each_gpu(tmp_path, monkeypatch, browser):
    monkeypatch.setenv(gpulease.LEASE_DIR_ENV, str(tmp_path / "leases"))
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "colleagues-training"])
    leaser = subprocess.Popen([sys.executable, "-c", LEASE], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "FABTRAIN_JOB_ID": JOB})
    try:
        assert leaser.stdout.readline().strip() == "[1]"
        standin = tmp_path / "gpus.json"  # STAND-IN inventory
        standin.write_text(json.dumps({"gpus": [
            {"index": 0, "mem_total": 1000, "mem_used": 600, "processes": [{"pid": outsider.pid, "mem": 600}]},
            {"index": 1, "mem_total": 1000, "mem_used": 0}, {"index": 2, "mem_total": 1000, "mem_used": 0}]}))
        monkeypatch.setenv(gpuinv.STANDIN_ENV, str(standin))
        with dashboard(local_cluster(tmp_path, {"n0": ["pserver", "trainer"]}), TOKEN) as url:
            page = browser.new_page()
            page.goto(f"{url}/?token={TOKEN}")
            page.wait_for_selector("#nodes tr[data-node='n0'] .gpu-holder[data-gpu='1']", timeout=30000)
            cell = page.locator("#nodes tr[data-node='n0']")
            assert cell.locator(".gpu-free").inner_text() == "1/3 GPUs free (stand-in)"
            outside = cell.locator(".gpu-holder[data-gpu='0']").inner_text()
            assert outside.startswith("GPU 0: ") and f" pid {outsider.pid} " in outside and "colleagues-training" in outside
            assert cell.locator(".gpu-holder[data-gpu='1']").inner_text() == (
                f"GPU 1: leased by fabtrain job {JOB}, {gpuinv._owner(leaser.pid)} pid {leaser.pid}")
            assert cell.locator(".gpu-holder").count() == 2  # GPU 2 is free
    finally:
        for p in (outsider, leaser):
            p.kill()
            p.wait()
