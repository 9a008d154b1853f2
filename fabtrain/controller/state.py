"""The controller's memory between `fab` invocations: which job is current,
and which data the last copy-data verified on each node.

`fab start-pserver` and a later `fab start-trainers` must agree on the job
id; the nodes hold the truth about processes, this file only the id. It lives
in $FABTRAIN_STATE_DIR (default ~/.fabtrain/controller), one file a cluster,
and one more for the data hint (`<cluster>.data.json`): copy-data uses it only
to guess whether a node will need a copy, and verifies on the node either way.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def folder() -> Path:
    """Where the controller keeps its state: $FABTRAIN_STATE_DIR, else ~/.fabtrain/controller."""
    return Path(os.environ.get("FABTRAIN_STATE_DIR") or Path.home() / ".fabtrain" / "controller")


def _path(cluster_name: str, suffix: str = "") -> Path:
    return folder() / f"{cluster_name}{suffix}.json"


def load(cluster_name: str) -> dict:
    try:
        return json.loads(_path(cluster_name).read_text())
    except (OSError, ValueError):
        return {}


def save(cluster_name: str, **fields) -> dict:
    data = {**fields, "updated": time.time()}
    _write(_path(cluster_name), data)
    return data


def recorded_ports(cluster_name: str, job_id: str | None) -> dict | None:
    """The ports the controller started job `job_id` with (None: unknown here): for fab status and /api/job."""
    saved = load(cluster_name)
    network = saved.get("network") if isinstance(saved.get("network"), dict) else None
    if not network or job_id is None or saved.get("job_id") != job_id:
        return None
    return {**network.get("ports", {}), "auto": list(network.get("auto", []))}


def data_on_nodes(cluster_name: str) -> dict[str, str]:
    """Node name -> sha256 of the MANIFEST.json the last copy-data verified there."""
    try:
        nodes = json.loads(_path(cluster_name, ".data").read_text()).get("nodes", {})
        return {k: v for k, v in nodes.items() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        return {}


def remember_data_on_nodes(cluster_name: str, nodes: dict[str, str | None]) -> None:
    """Record what copy-data verified (None: nothing known any more)."""
    held = {**data_on_nodes(cluster_name), **nodes}
    _write(_path(cluster_name, ".data"),
           {"nodes": {k: v for k, v in held.items() if v}, "updated": time.time()})


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    # It holds the job's coordinator secret: readable by this user only.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
    os.replace(tmp, path)


def load_file(cluster_name: str, suffix: str) -> dict:
    """Another file of the controller's memory (`<cluster><suffix>.json`), {} if none or unreadable."""
    try:
        data = json.loads(_path(cluster_name, suffix).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_file(cluster_name: str, suffix: str, data: dict) -> None:
    _write(_path(cluster_name, suffix), data)
