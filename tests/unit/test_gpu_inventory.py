"""The node's GPU inventory: nvidia-smi's CSV as records, and the STAND-IN inventory tests use without a GPU."""
import getpass
import json
import os
import ctypes
import shutil
import subprocess

from fabtrain.contract import gpus as gpu_words
from fabtrain.node import gpuinv, gpulease
from tests.conftest import require
from tests.support import REPO

SMI_GPUS = """0, GPU-aaa, NVIDIA H100 80GB HBM3, 81559, 1, 0, No, No, 00000000:18:00.0
1, GPU-bbb, NVIDIA H100 80GB HBM3, 81559, 20480, 0, No, No, 00000000:3B:00.0
2, GPU-ccc, NVIDIA H100 80GB HBM3, 81559, 0, 3, [N/A], Yes, 00000000:86:00.0
"""
SMI_APPS = "GPU-bbb, 4242, /usr/bin/python3, 20470\n"


def fake_smi(args, **kwargs):
    text = SMI_GPUS if args[1].startswith("--query-gpu=") else SMI_APPS
    return subprocess.CompletedProcess(args, 0, stdout=text, stderr="")


def test_nvidia_smi_output_becomes_gpus_with_their_processes_and_health():
    gpus = gpuinv.from_smi(run=fake_smi)
    assert [(g["index"], g["mem_used"], g["health"]) for g in gpus] == [
        (0, 1, []), (1, 20480, []), (2, 0, ["uncorrected ECC", "remapped row failure"])]
    assert gpus[1]["processes"] == [{"pid": 4242, "command": "/usr/bin/python3", "mem": 20470}]


def test_without_nvml_the_inventory_asks_nvidia_smi_flags_xids_from_the_kernel_log_or_says_no_driver(tmp_path):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")
    kernel_log = tmp_path / "kmsg"  # the kernel log's records as /dev/kmsg gives them
    kernel_log.write_text("6,1,1,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n"
                          "4,2,9,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
                          "4,3,9,-;NVRM: Xid (PCI:0000:18:00): 13, pid=99, Graphics Exception\n")
    inv = gpuinv.inventory(environ={}, run=fake_smi, loader=no_library, kernel_log=str(kernel_log))
    assert inv["source"] == "nvidia-smi"
    assert [g["health"] for g in inv["gpus"]] == [  # XID 13 is the program's, not the GPU's
        [], ["XID 79 since boot"], ["uncorrected ECC", "remapped row failure"]]

    def missing(args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")
    inv = gpuinv.inventory(environ={}, run=missing, loader=no_library)
    assert inv == {"source": "none", "gpus": [], "error": "no NVIDIA driver"}
    assert gpu_words.describe(inv) == ["GPUs: none (no NVIDIA driver)"]


def test_nvml_through_ctypes_reads_gpus_processes_and_health_from_the_library(tmp_path):
    require(shutil.which("cc") is not None, "cc", "the stand-in NVML library is built with cc (`make system-deps`)")
    library = tmp_path / "libnvidia-ml.so.1"  # a STAND-IN library with nvml.h's signatures (no GPU here)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(REPO / "tests/programs/fake_nvml.c")], check=True)
    kernel_log = tmp_path / "kmsg"
    kernel_log.write_text("4,2,9,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python, DBE (Double Bit Error)\n")
    inv = gpuinv.inventory(environ={gpulease.LEASE_DIR_ENV: str(tmp_path / "leases")}, run=None,
                           loader=lambda name: ctypes.CDLL(str(library)), kernel_log=str(kernel_log))
    assert inv["source"] == "nvml"
    assert [(g["index"], g["uuid"], g["name"], g["mem_total"], g["mem_used"], g["pci"]) for g in inv["gpus"]] == [
        (0, "GPU-aaa", "Stand-in H100", 81559, 30000, "0000:18:00"), (1, "GPU-bbb", "Stand-in H100", 81559, 0, "0000:3b:00")]
    assert [(p["pid"], p["mem"]) for p in inv["gpus"][0]["processes"]] == [(4242, 10000), (4243, 10001)]
    assert inv["gpus"][1]["health"] == ["uncorrected ECC", "remapped row failure", "XID 48 since boot"]
    assert [g["free"] for g in inv["gpus"]] == [False, True]


def test_the_stand_in_names_a_real_holder_from_proc_and_flags_unhealthy_gpus(tmp_path):
    # A STAND-IN inventory: fixed GPUs, one held by this test's own process (user and command from /proc).
    standin = tmp_path / "gpus.json"
    standin.write_text(json.dumps({"gpus": [
        {"index": 0, "name": "stand-in", "mem_total": 1000, "mem_used": 0},
        {"index": 1, "name": "stand-in", "mem_total": 1000, "mem_used": 600,
         "processes": [{"pid": os.getpid(), "mem": 600}]},
        {"index": 2, "name": "stand-in", "mem_total": 1000, "mem_used": 0, "health": ["XID 79 since boot"]}]}))
    inv = gpuinv.inventory(environ={gpuinv.STANDIN_ENV: str(standin)})
    assert inv["source"] == "stand-in" and [g["free"] for g in inv["gpus"]] == [True, False, True]
    lines = gpu_words.describe(inv)
    assert lines[0] == "GPUs: 3, free 1 (stand-in)"  # GPU 2 is unhealthy: not free to choose
    with open("/proc/self/cmdline", "rb") as f:  # this process's command, as /proc has it (pytest, or its worker)
        command = f.read().split(b"\0")[0].decode()
    assert lines[1].startswith(f"  GPU 1: {getpass.getuser()} pid {os.getpid()} {command}"), lines[1]
    assert lines[1].endswith(" 600 MiB")
    assert lines[2] == "  GPU 2 (!) XID 79 since boot"


def test_an_unreadable_stand_in_says_which_file(tmp_path):
    bad = tmp_path / "gpus.json"
    bad.write_text("{not json")
    inv = gpuinv.inventory(environ={gpuinv.STANDIN_ENV: str(bad)})
    assert inv["gpus"] == [] and inv["error"].startswith(f"cannot read the stand-in {bad}: ")


def test_a_gpu_leased_by_a_fabtrain_job_is_not_free_and_names_the_holder(tmp_path):
    standin = tmp_path / "gpus.json"  # STAND-IN: two idle GPUs
    standin.write_text(json.dumps({"gpus": [{"index": 0, "mem_total": 1000, "mem_used": 0},
                                            {"index": 1, "mem_total": 1000, "mem_used": 0}]}))
    environ = {gpuinv.STANDIN_ENV: str(standin), gpulease.LEASE_DIR_ENV: str(tmp_path / "leases")}
    held = gpulease.take([1], 1, environ)
    try:
        inv = gpuinv.inventory(environ=environ)
        assert [g["free"] for g in inv["gpus"]] == [True, False]
        assert gpu_words.describe(inv)[1:] == [f"  GPU 1: leased by a fabtrain job, {getpass.getuser()} pid {os.getpid()}"]
    finally:
        gpulease.release(held)
    assert [g["free"] for g in gpuinv.inventory(environ=environ)["gpus"]] == [True, True]
