"""The GPUs of this node and who holds each: NVML (fabtrain/node/nvml.py, ctypes), else `nvidia-smi`
queries, or a STAND-IN for tests; XID errors since boot from the kernel log, where this user may read it.

The stand-in: where the environment names a JSON file in FABTRAIN_GPU_STANDIN, the inventory is read from
it instead of the driver (tests on machines without a GPU; every reading says `"source": "stand-in"`):
    {"gpus": [{"index": 0, "name": "...", "mem_total": 81920, "mem_used": 0,
               "health": ["uncorrected ECC"],
               "processes": [{"pid": 123, "mem": 2048, "user": "alice", "command": "python train.py"}]}]}
A process's user and command, where not given, are read from /proc as for a real one. Memory in MiB.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import pwd
import re
import subprocess

from fabtrain.node import gpulease, nvml, procfs

STANDIN_ENV = "FABTRAIN_GPU_STANDIN"
GPU_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "ecc.errors.uncorrected.volatile.total",
              "retired_pages.pending", "remapped_rows.failure", "pci.bus_id")
APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")


def _number(text: str):
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_smi_gpus(text: str) -> list:
    """`nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits` as GPU records."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_FIELDS) or _number(cells[0]) is None:
            continue
        health = []
        if (_number(cells[5]) or 0) > 0:
            health.append("uncorrected ECC")
        if cells[6].lower() == "yes":
            health.append("retired page pending")
        if cells[7].lower() == "yes":
            health.append("remapped row failure")
        gpus.append({"index": int(cells[0]), "uuid": cells[1], "name": cells[2], "mem_total": _number(cells[3]),
                     "mem_used": _number(cells[4]), "health": health, "processes": [], "pci": cells[8]})
    return gpus


def parse_smi_apps(text: str) -> list:
    """`nvidia-smi --query-compute-apps=<APP_FIELDS> --format=csv,noheader,nounits` as (uuid, process)."""
    apps = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",", 3)]
        if len(cells) == 4 and _number(cells[1]) is not None:
            uuid, pid, name, mem = cells[0], int(cells[1]), cells[2], cells[3]
            apps.append((uuid, {"pid": pid, "command": name, "mem": _number(mem)}))
    return apps


def _owner(pid: int):
    try:
        uid = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _holders(gpus: list, environ) -> list:
    """Each process with its user and command, from /proc where the reading did not give them."""
    leases = gpulease.holders(environ)
    for g in gpus:
        if g["index"] in leases:
            holder = gpulease.holder_job(g["index"], leases[g["index"]], environ)
            g["leased_by"] = holder["pid"]
            g["lease_user"] = _owner(holder["pid"]) or "?"
            if holder["job"]:
                g["lease_job"] = holder["job"]
        for p in g["processes"]:
            if not p.get("user"):
                p["user"] = _owner(p["pid"]) or "?"
            if not p.get("command") or "/" in p["command"]:
                p["command"] = " ".join(procfs.cmdline(p["pid"])) or p.get("command") or "?"
        g["free"] = not g["processes"] and "leased_by" not in g
    return gpus


def from_smi(run=subprocess.run) -> list:
    common = ["--format=csv,noheader,nounits"]
    gpus = parse_smi_gpus(run(["nvidia-smi", "--query-gpu=" + ",".join(GPU_FIELDS)] + common,
                              capture_output=True, text=True, timeout=30, check=True).stdout)
    apps = parse_smi_apps(run(["nvidia-smi", "--query-compute-apps=" + ",".join(APP_FIELDS)] + common,
                              capture_output=True, text=True, timeout=30, check=True).stdout)
    by_uuid = {g["uuid"]: g for g in gpus}
    for uuid, proc in apps:
        if uuid in by_uuid:
            by_uuid[uuid]["processes"].append(proc)
    return gpus


# -- XID errors since boot, from the kernel log -------------------------------------------------------

KERNEL_LOG = "/dev/kmsg"
XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)[^)]*\): (\d+)")
# XIDs a program causes (an illegal address, a page fault in its kernel, its process killed): not the GPU's fault.
PROGRAM_XIDS = {13, 31, 43, 45}


def pci_key(text):
    """(domain, bus, device) of "00000000:3B:00.0" (nvidia-smi) or "0000:3b:00" (NVML, the kernel log)."""
    parts = str(text or "").split(":")
    try:
        return int(parts[-3], 16), int(parts[-2], 16), int(parts[-1].split(".")[0], 16)
    except (IndexError, ValueError):
        return None


def xid_errors(path=KERNEL_LOG, limit=200000) -> dict:
    """{pci_key: sorted XIDs} the driver logged since boot; {} where the log cannot be read (dmesg_restrict)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return {}
    found = {}
    try:
        for _ in range(limit):
            try:
                record = os.read(fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # records overwritten while reading: go on with the next
                break  # EAGAIN: the end of the log
            if not record:
                break
            for m in XID_RE.finditer(record.decode("utf-8", "replace")):  # /dev/kmsg: one record a read
                if int(m.group(4)) not in PROGRAM_XIDS:
                    key = (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16))
                    found.setdefault(key, set()).add(int(m.group(4)))
    finally:
        os.close(fd)
    return {k: sorted(v) for k, v in found.items()}


def flag_xids(gpus, xids: dict) -> None:
    for g in gpus:
        seen = xids.get(pci_key(g.get("pci")))
        if seen:
            g["health"].append("XID %s since boot" % ", ".join(str(x) for x in seen))


def inventory(environ=None, run=subprocess.run, loader=ctypes.CDLL, kernel_log=KERNEL_LOG) -> dict:
    """{"source": "stand-in" | "nvml" | "nvidia-smi" | "none", "gpus": [...], "error": why none where there is one}."""
    environ = os.environ if environ is None else environ
    standin = environ.get(STANDIN_ENV)
    if standin:
        try:
            with open(standin) as f:
                gpus = json.load(f)["gpus"]
            for g in gpus:
                g.setdefault("health", [])
                g.setdefault("processes", [])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return {"source": "stand-in", "gpus": [], "error": "cannot read the stand-in %s: %s" % (standin, e)}
        return {"source": "stand-in", "gpus": _holders(gpus, environ)}
    try:
        source, gpus = "nvml", nvml.gpus(loader)
    except nvml.Unavailable:
        try:
            source, gpus = "nvidia-smi", from_smi(run)
        except FileNotFoundError:
            return {"source": "none", "gpus": [], "error": "no NVIDIA driver"}
        except (OSError, subprocess.SubprocessError) as e:
            return {"source": "none", "gpus": [], "error": "nvidia-smi failed: %s" % (str(e).strip() or "no reason")}
    flag_xids(gpus, xid_errors(kernel_log))
    return {"source": source, "gpus": _holders(gpus, environ)}
