"""What `fab check` and `fab provision` ask of a node (ops "probe" and "provision").

A module of its own, imported only for these two ops: what they need
(platform, shutil, subprocess, the GPU inventory) would cost every other
node-side call its import time.
"""
import ast
import json
import os
import platform
import shutil
import subprocess
import sys
import time

from fabtrain.contract.clock import boot_id
from fabtrain.contract.jobfolder import JOBS
from fabtrain.node import gpuinv
from fabtrain.contract.opreplies import Probe, Provision, Tools
from fabtrain.contract.replies import UserFacing
from fabtrain.node.workspace import check_workspace, claim_workspace, make_private_dirs, workspace


def op_probe(payload):
    """What `fab check` reads of a node: its Python, tools, disk, memory, packages, GPUs, clock."""
    ws = workspace(payload)
    probe = {
        "workspace_conflict": claim_workspace(ws, payload["cluster"], payload["node"]),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "python_path": sys.executable,
        "workspace": ws,
        "time": time.time(),
        "boot_id": boot_id(),  # the controller's own machine has no clock offset
        "cpus": os.cpu_count(),
        "tools": Tools(**{t: bool(shutil.which(t)) for t in Tools.FIELDS}),
    }
    existing = ws
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    du = shutil.disk_usage(existing)
    probe["disk_free"] = du.free
    probe["disk_total"] = du.total
    try:
        with open("/proc/meminfo") as f:
            probe["mem_total"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        probe["mem_total"] = None
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        metadata = None

    def version(dist):
        try:
            return metadata.version(dist) if metadata else None
        except Exception:
            return None

    probe["psutil"] = version("psutil")
    probe["paddle"] = version("paddlepaddle") or version("paddlepaddle-gpu")
    probe["torch"] = version("torch")
    probe["cuda"] = None
    probe["gpus"] = 0
    if probe["torch"] and payload.get("torch_cuda", True) and torch_has_gpu_build():
        try:
            probe["cuda"], probe["gpus"] = torch_cuda_by_import()
        except Exception as e:  # a broken torch install is a finding, not a crash
            probe["torch_error"] = str(e)[:200]
    if payload.get("torch_cuda", True):  # check only: who holds which GPU, and their health
        probe["gpu_inventory"] = gpuinv.inventory()
    return Probe(**probe).wire()


def torch_cuda_by_import():
    """(CUDA version, devices) as torch itself sees them: only importing torch tells whether CUDA works (2 to 3 s
    of CPU, so only for check, and only for a build that has a GPU backend)."""
    code = "import torch,json;print(json.dumps([torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    ok, count, cuda = json.loads(out.stdout.strip().splitlines()[-1])
    return (cuda if ok else None), count


def torch_has_gpu_build(version_file=None):
    """Whether the torch here was built for CUDA or ROCm (torch.cuda serves both), read from the torch/version.py
    its build wrote, without importing torch. A CPU build sees no GPU whatever the machine has: nothing to ask
    it. True where the file cannot be read as torch writes it: then torch is asked."""
    try:
        if version_file is None:
            import importlib.util
            spec = importlib.util.find_spec("torch")  # finds the package; imports nothing of it
            version_file = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        with open(version_file) as f:
            tree = ast.parse(f.read())
    except Exception:  # noqa: BLE001 - an odd install: ask torch itself
        return True
    built = {}  # "cuda"/"hip" -> the version it names, None for a build without it
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):  # cuda: Optional[str] = None, as torch writes it
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and isinstance(node.value, ast.Constant):
            built[target.id] = node.value.value
    if set(built) != {"cuda", "hip"}:  # not the file torch's build writes: ask torch
        return True
    return built["cuda"] is not None or built["hip"] is not None


def op_provision(payload):
    """`fab provision`: the workspace's folders and, if asked, a venv with the job's requirements."""
    ws = workspace(payload)
    os.umask(0o077)
    refusal = check_workspace(ws)
    if refusal:
        raise UserFacing(refusal)
    make_private_dirs(ws, os.path.join(ws, JOBS))
    for sub in ("code", "data", "runtime"):
        os.makedirs(os.path.join(ws, sub), exist_ok=True)
    if not payload.get("venv"):
        return Provision(workspace=ws).wire()
    venv = os.path.join(ws, "venv")
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, capture_output=True)
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q"]
    wheelhouse = os.path.join(ws, "wheelhouse")
    if payload.get("wheelhouse"):
        pip += ["--no-index", "--find-links", wheelhouse]
    reqs = payload.get("requirements") or []
    if reqs:
        out = subprocess.run(pip + reqs, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError("pip install failed: " + (out.stderr.strip().splitlines() or ["?"])[-1])
    return Provision(workspace=ws, venv=os.path.join(venv, "bin", "python")).wire()
