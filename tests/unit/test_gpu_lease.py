"""GPU leases: real flocks taken by real processes; a SIGKILLed holder's GPUs are free again."""
import ast
import os
import signal
import subprocess
import sys

from fabtrain.node import gpulease

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
