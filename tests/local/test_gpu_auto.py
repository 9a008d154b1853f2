"""`gpus: auto` through `fab` on local nodes, with a STAND-IN GPU inventory (this machine has no GPU).

The stand-in lists four GPUs: GPU 0 busy with a real process outside fabtrain, GPU 3 flagged unhealthy,
GPUs 1 and 2 free. The leases are real flocks, held by the jobs' real processes.
"""
import getpass
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import yaml

from fabtrain.node import gpuinv, gpulease, procfs
from tests.support.procscan import live_marked, wait_for

FAKE = "python tests/programs/fakejob.py --steps 0 --period 0.5"


def auto_job(local_job, folder):
    job = local_job([("n0", ["trainer"])], folder=folder, mode="collective", master_port="auto",
                    trainer={"command": FAKE, "use_gpu": True}, watchdog={"port": "auto", "interval": 0.5})
    doc = yaml.safe_load(job.path.read_text())
    doc["cluster"]["gpus"] = "auto"
    job.path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return job


def has_open(pid, path):
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def visible_devices(job):
    """CUDA_VISIBLE_DEVICES as the running trainer's own /proc/<pid>/environ has it."""
    env = procfs.environ(job.program("n0", "trainer-0"))
    return env[b"CUDA_VISIBLE_DEVICES"].decode()


def test_auto_jobs_get_disjoint_free_gpus_a_third_is_refused_and_sigkill_frees_them(local_job, tmp_path, monkeypatch):
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "colleagues-training"])
    try:
        standin = tmp_path / "gpus.json"  # STAND-IN inventory
        standin.write_text(json.dumps({"gpus": [
            {"index": 0, "mem_total": 1000, "mem_used": 700, "processes": [{"pid": outsider.pid, "mem": 700}]},
            {"index": 1, "mem_total": 1000, "mem_used": 0},
            {"index": 2, "mem_total": 1000, "mem_used": 0},
            {"index": 3, "mem_total": 1000, "mem_used": 0, "health": ["uncorrected ECC"]}]}))
        monkeypatch.setenv(gpuinv.STANDIN_ENV, str(standin))
        monkeypatch.setenv(gpulease.LEASE_DIR_ENV, str(tmp_path / "leases"))
        a, b, c = (auto_job(local_job, name) for name in "abc")
        for j in (a, b, c):
            j.fab("deploy", check=True)
        with ThreadPoolExecutor(2) as pool:  # two starts at once
            list(pool.map(lambda j: j.fab("start-trainers", check=True), (a, b)))
        got = {visible_devices(a), visible_devices(b)}
        assert got == {"1", "2"}, got  # disjoint, never the busy GPU 0 nor the flagged GPU 3
        # Held by the agent (which hands it on to a restart) and by the trainer's launcher, not by `fab`.
        lease = os.path.realpath(tmp_path / "leases" / f"gpu{visible_devices(a)}.lease")
        holders = {pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if has_open(pid, lease)}
        run = json.loads((a.jd("n0") / "run" / "trainer-0.json").read_text())
        assert {a.program("n0", "agent"), run["pid"]} <= holders
        assert holders <= {pid for pid, _ in live_marked([a.ws["n0"]])}

        refused = c.fab("start-trainers", check=False)
        assert refused.returncode == 1
        [line] = [x for x in refused.stdout.splitlines() if "gpus: auto" in x]
        assert line.startswith("n0: FAILED: gpus: auto needs 1 free GPU, 0 of 4 are free (GPU 0: ")
        assert f"{getpass.getuser()} pid {outsider.pid} " in line and "colleagues-training" in line
        owner = {visible_devices(a): a.job_id, visible_devices(b): b.job_id}
        for index, job_id in owner.items():
            assert f"GPU {index}: leased by fabtrain job {job_id}, " in line
        assert "GPU 3: (!) uncorrected ECC" in line
        assert not live_marked([c.ws["n0"]])  # the refused start ran nothing

        # SIGKILL every process of job a (agent, keeper, launchers, programs): nobody cleans up.
        freed = visible_devices(a)
        for pid, _ in live_marked([a.ws["n0"]]):
            os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not live_marked([a.ws["n0"]])), live_marked([a.ws["n0"]])
        c.fab("start-trainers", check=True)
        assert visible_devices(c) == freed
        assert json.loads((c.jd("n0") / "job.json").read_text())["gpu_leases"] == [int(freed)]
    finally:
        outsider.kill()
        outsider.wait()


def test_a_rank_names_its_leased_gpu_in_the_pci_order_that_the_lease_uses(local_job, tmp_path, monkeypatch):
    """Two GPU models whose orders differ: NVML's index (the lease's) is the PCI order, CUDA's default is fastest
    first (here the A100 at index 1 would be CUDA's 0). The rank runs with CUDA_DEVICE_ORDER=PCI_BUS_ID, so its
    CUDA_VISIBLE_DEVICES names the GPU it leased."""
    standin = tmp_path / "gpus.json"  # STAND-IN inventory
    standin.write_text(json.dumps({"gpus": [
        {"index": 0, "name": "Tesla T4", "pci": "00000000:18:00.0", "mem_total": 15360, "mem_used": 0},
        {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "pci": "00000000:3B:00.0", "mem_total": 81920, "mem_used": 0}]}))
    monkeypatch.setenv(gpuinv.STANDIN_ENV, str(standin))
    monkeypatch.setenv(gpulease.LEASE_DIR_ENV, str(tmp_path / "leases"))
    other = gpulease.take([0], 1)  # another job holds the T4
    try:
        job = auto_job(local_job, "order")
        job.fab("deploy", "start-trainers", check=True)
        env = procfs.environ(job.program("n0", "trainer-0"))
        assert env[b"CUDA_VISIBLE_DEVICES"] == b"1"
        assert env[b"CUDA_DEVICE_ORDER"] == b"PCI_BUS_ID"
        assert json.loads((job.jd("n0") / "job.json").read_text())["gpu_leases"] == [1]
        job.fab("kill-all", check=True)
    finally:
        gpulease.release(other)
