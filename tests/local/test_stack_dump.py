"""The agent's stack dump on real processes under the launcher's hook: every Python process answers into a
file of its own (a forked child too), and a stopped one costs the dump nothing (it is not waited for)."""
import os
import signal
import subprocess
import sys
import time

from fabtrain.node import launch, procfs
from fabtrain.node.agent import stacks
from tests.support.procscan import wait_for

CHILD = """
import os, time
def work_forever():
    while True:
        time.sleep(0.01)
if os.fork() == 0:  # a forked worker (a DataLoader's): its own file too
    work_forever()
open(os.environ["READY"], "w").close()
work_forever()
"""


def start(tmp_path, name):
    job_dir = tmp_path / "job"
    hook = job_dir / "stacks" / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(launch.STACK_HOOK)
    ready = tmp_path / f"{name}.ready"
    env = {**os.environ, "PYTHONPATH": str(hook), "FABTRAIN_STACKS": launch.stacks_prefix(str(job_dir), name),
           "READY": str(ready), "RANK": "0"}
    p = subprocess.Popen([sys.executable, "-c", CHILD], env=env)
    assert wait_for(ready.exists, timeout=30), "the program never started"
    kids = wait_for(lambda: procfs.children(p.pid), timeout=10)
    return p, kids, str(job_dir)


def test_every_python_process_answers_into_its_own_file_and_a_stopped_one_is_not_waited_for(tmp_path):
    run, run_kids, job_dir = start(tmp_path, "trainer-0")
    stopped, stopped_kids, _ = start(tmp_path, "trainer-1")
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_for(lambda: procfs.stat(stopped.pid).state == "T", timeout=5)
        # A cap far above what an answer takes: had the stopped program been waited for, the dump would take all of it.
        cap = 10
        t0 = time.monotonic()
        out = stacks.dump([("trainer-0", [run.pid] + run_kids), ("trainer-1", [stopped.pid] + stopped_kids)], job_dir,
                          wait=cap)
        took = time.monotonic() - t0
        assert took < cap / 2, took  # the stopped program cost nothing beyond the running ones' answers
        assert out["trainer-1"]["why"] == f"no stack: pid {stopped.pid} is stopped (SIGSTOP) and cannot answer", out
        assert out["trainer-0"]["frame"].endswith("in work_forever"), out
        # the program and its forked child each wrote its own file, under its own first line
        for pid in [run.pid] + run_kids:
            text = open(launch.stacks_path(job_dir, "trainer-0", pid)).read()
            assert text.startswith(f"fabtrain: trainer-0 pid {pid}") and "in work_forever" in text, text
        assert not os.path.getsize(launch.stacks_path(job_dir, "trainer-1", stopped.pid))
        # nothing was waited for when every process is stopped
        os.kill(run.pid, signal.SIGSTOP)
        for k in run_kids:
            os.kill(k, signal.SIGSTOP)
        # SIGSTOP reaches each process on its own: every one must be stopped before the dump looks
        assert wait_for(lambda: all(procfs.stat(p).state == "T" for p in [run.pid] + run_kids), timeout=5)
        t0 = time.monotonic()
        out = stacks.dump([("trainer-0", [run.pid] + run_kids)], job_dir, wait=cap)
        assert time.monotonic() - t0 < cap / 2
        assert out["trainer-0"]["why"] == f"no stack: pid {run.pid} is stopped (SIGSTOP) and cannot answer", out
    finally:
        for p, kids in ((run, run_kids), (stopped, stopped_kids)):
            for pid in [p.pid] + kids:
                os.kill(pid, signal.SIGKILL)
            p.wait()
