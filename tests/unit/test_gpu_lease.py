"""GPU leases: real flocks taken by real processes; a SIGKILLed holder's GPUs are free again; what a start takes."""
import ast
import json
import os
import signal
import subprocess
import sys

import pytest

from fabtrain.node import gpuinv, gpulease, gpustart
from fabtrain.contract.replies import UserFacing

HOLD = ("import os, sys, time; from fabtrain.node import gpulease\n"
        "held = gpulease.take(range(4), 2)\n"
        "print(sorted(held) if held else None, flush=True)\n"
        "time.sleep(60)\n")


def holder(env):
    return subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True)


def test_two_takers_at_once_get_disjoint_gpus_and_a_killed_one_frees_its_own(tmp_path):
    env = {**os.environ, gpulease.LEASE_DIR_ENV: str(tmp_path / "leases")}
    a, b = holder(env), holder(env)  # both start before either has taken anything
    try:
        got = [ast.literal_eval(a.stdout.readline()), ast.literal_eval(b.stdout.readline())]
        assert len(got[0]) == len(got[1]) == 2 and sorted(got[0] + got[1]) == [0, 1, 2, 3], got
        third = holder(env)
        assert third.stdout.readline().strip() == "None"  # all four leased: refused, holds nothing
        third.kill()
        third.wait()
        a.send_signal(signal.SIGKILL)
        a.wait()
        assert [gpulease.leased(i, env) for i in range(4)] == [i not in got[0] for i in range(4)]
        assert gpulease.holders(env) == {i: b.pid for i in got[1]}  # from /proc/locks
        assert (os.stat(tmp_path / "leases").st_mode & 0o7777) == 0o1777
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_start_naming_a_flagged_gpu_warns_and_leases_it_and_auto_without_an_inventory_is_refused(tmp_path):
    standin = tmp_path / "gpus.json"  # STAND-IN inventory
    standin.write_text(json.dumps({"gpus": [{"index": 0, "mem_total": 10, "mem_used": 0},
                                            {"index": 1, "mem_total": 10, "mem_used": 0, "health": ["uncorrected ECC"]}]}))
    env = {gpuinv.STANDIN_ENV: str(standin), gpulease.LEASE_DIR_ENV: str(tmp_path / "leases")}
    job = {"job_id": "J", "processes": [{"env": {"CUDA_VISIBLE_DEVICES": "1"}}, {"env": {}}]}
    held, warnings = gpustart.take(job, None, env)
    try:
        assert sorted(held) == [1] and job["gpu_leases"] == [1]
        assert warnings == ["the job names GPU 1: (!) uncorrected ECC"]
    finally:
        gpulease.release(held)
    auto = {"job_id": "J", "processes": [{"env": {"CUDA_VISIBLE_DEVICES": "auto:0"}}]}
    with pytest.raises(UserFacing) as e:
        gpustart.take(auto, None, {gpuinv.STANDIN_ENV: str(tmp_path / "absent.json")})
    assert str(e.value).startswith("gpus: auto cannot tell which GPUs are free: cannot read the stand-in ")
