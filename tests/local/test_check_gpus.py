"""fab check over real node ops on a local node lists its GPUs and who holds them (a STAND-IN inventory)."""
import getpass
import json
import subprocess
import sys

from fabtrain.config.cluster import parse_cluster
from fabtrain.controller import lifecycle
from fabtrain.controller.report import check_text
from fabtrain.node import gpuinv
from fabtrain.remote.session import Session


def test_check_shows_total_free_and_each_holder_with_health_flags(tmp_path, monkeypatch):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train-on-gpu-1"])
    try:
        standin = tmp_path / "gpus.json"  # STAND-IN: no GPU on this machine
        standin.write_text(json.dumps({"gpus": [
            {"index": 0, "name": "stand-in", "mem_total": 1000, "mem_used": 0},
            {"index": 1, "name": "stand-in", "mem_total": 1000, "mem_used": 500,
             "processes": [{"pid": holder.pid, "mem": 500}]},
            {"index": 2, "name": "stand-in", "mem_total": 1000, "mem_used": 0, "health": ["uncorrected ECC"]}]}))
        monkeypatch.setenv(gpuinv.STANDIN_ENV, str(standin))
        session = Session(parse_cluster({"cluster": {"name": "g", "workspace": str(tmp_path / "ws")},
                                         "nodes": [{"name": "n0", "host": "local", "roles": ["trainer"]}],
                                         "job": {"mode": "collective", "trainer": {"command": "true"}}}, "c.yaml"))
        try:
            [c] = lifecycle.check(session)
        finally:
            session.close()
    finally:
        holder.kill()
        holder.wait()
    lines = check_text([c]).splitlines()
    gpu_lines = [line for line in lines if line.startswith("n0: ")]
    assert gpu_lines[0] == "n0: GPUs: 3, free 1 (stand-in)"
    assert gpu_lines[1].startswith(f"n0:   GPU 1: {getpass.getuser()} pid {holder.pid} ")
    assert "train-on-gpu-1" in gpu_lines[1] and gpu_lines[1].endswith(" 500 MiB")
    assert gpu_lines[2] == "n0:   GPU 2 (!) uncorrected ECC"
