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


def test_a_held_lease_whose_file_is_unlinked_still_keeps_its_gpu_from_the_next_taker(tmp_path):
    """A tmp cleaner or the directory's owner removes a held lease file: the next taker makes a new file and
    locks it, yet must see that the removed file's holder still has the GPU."""
    env = {**os.environ, gpulease.LEASE_DIR_ENV: str(tmp_path / "leases")}
    first = subprocess.Popen([sys.executable, "-c", HOLD.replace("take(range(4), 2)", "take([0], 1)")],
                             env={**env, "FABTRAIN_JOB_ID": "20261127-111500-aaaa"}, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "[0]"
        os.unlink(tmp_path / "leases" / "gpu0.lease")  # what a tmp cleaner does to a file idle for days
        assert gpulease.take([0], 1, env) is None  # the new gpu0.lease is lockable, the GPU is not free
        got = gpulease.take([0, 1], 1, env)
        assert sorted(got) == [1]
        gpulease.release(got)
        assert gpulease.leased(0, env)
        assert gpulease.holders(env) == {0: first.pid}
        assert gpulease.holder_job(0, 0, env) == {"pid": first.pid, "job": "20261127-111500-aaaa"}
        first.kill()
        first.wait()
        got = gpulease.take([0], 1, env)  # the holder gone: the GPU is free again
        assert sorted(got) == [0]
        gpulease.release(got)
    finally:
        first.kill()
        first.wait()


@pytest.mark.parametrize("mount, why", [
    ("36 25 0:52 / /mnt/shared rw,relatime - nfs4 fs1:/export/shared rw,vers=4.2",
     "it is on nfs4 (fs1:/export/shared, mounted at /mnt/shared), where a lock is not one machine's"),
    ("36 25 0:53 / /mnt/shared rw,relatime - fuse.sshfs alice@fs1:/x rw",
     "it is on fuse.sshfs (alice@fs1:/x, mounted at /mnt/shared), where a lock is not one machine's"),
    ("36 25 8:1 /tmp/systemd-private-4f2a-slurmd.service-Xq1/tmp /tmp rw - ext4 /dev/sda1 rw",
     "/tmp here is a private copy (/tmp/systemd-private-4f2a-slurmd.service-Xq1/tmp of /dev/sda1)"),
])
def test_a_lease_directory_no_other_job_shares_is_named_with_what_it_is_on(mount, why):
    mountinfo = "24 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n" + mount + "\n"
    path = "/tmp/fabtrain-gpu-leases" if " /tmp " in mount else "/mnt/shared/leases"
    assert gpulease.unshared_reason(path, mountinfo).startswith(why)
    assert gpulease.unshared_reason("/var/lib/leases", mountinfo) is None  # on the local root
    assert gpulease.unshared_reason("/mnt/sharedother", mountinfo) is None  # a prefix is not the mount


def test_a_start_in_a_private_tmp_is_refused_in_one_line_naming_the_lease_directory(tmp_path):
    """A private /tmp made as systemd's PrivateTmp makes it (a sub-folder bind-mounted over /tmp, in a mount
    namespace of its own): a lease there keeps no other job off the GPU, so taking one is refused."""
    private = tmp_path / "private-tmp"
    private.mkdir()
    standin = tmp_path / "gpus.json"
    standin.write_text(json.dumps({"gpus": [{"index": 0, "mem_total": 10, "mem_used": 0}]}))
    program = ("import json, sys; from fabtrain.node import gpustart, gpuinv\n"
               "from fabtrain.contract.replies import UserFacing\n"
               "job = {'job_id': 'J', 'processes': [{'env': {'CUDA_VISIBLE_DEVICES': 'auto:0'}}]}\n"
               "try:\n    gpustart.take(job, None, {gpuinv.STANDIN_ENV: sys.argv[1]})\n"
               "except UserFacing as e:\n    print(e)\nelse:\n    print('leased')\n")
    # The checkout may itself be under /tmp (a CI clone): it is bound at /mnt first (in the namespace only), and
    # the interpreter is the real one (the program needs only the standard library and the checkout).
    script = 'mount --bind "$2" /mnt && mount --bind "$1" /tmp && cd /mnt && exec "$3" -c "$4" "$5"'
    with open(standin) as inventory:  # handed over as a descriptor: its folder is hidden under the private /tmp
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                               str(private), os.getcwd(), os.path.realpath(sys.executable), program,
                               f"/dev/fd/{inventory.fileno()}"],
                              capture_output=True, text=True, timeout=60, pass_fds=[inventory.fileno()])
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert line.startswith("cannot lease GPUs: GPU lease directory /tmp/fabtrain-gpu-leases cannot keep two jobs "
                           "off one GPU: /tmp here is a private copy ("), line
    assert line.endswith("; nothing of job J was started here")
    assert not os.listdir(private)  # nothing was made in the private copy
