"""The controller's memory between `fab` invocations: which job is current.

`fab start-pserver` and a later `fab start-trainers` must agree on the job
id; the nodes hold the truth about processes, this file only the id. It lives
in $FABTRAIN_STATE_DIR (default ~/.fabtrain/controller), one file a cluster.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _path(cluster_name: str) -> Path:
    root = Path(os.environ.get("FABTRAIN_STATE_DIR") or Path.home() / ".fabtrain" / "controller")
    return root / f"{cluster_name}.json"


def load(cluster_name: str) -> dict:
    try:
        return json.loads(_path(cluster_name).read_text())
    except (OSError, ValueError):
        return {}


def save(cluster_name: str, **fields) -> dict:
    path = _path(cluster_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**fields, "updated": time.time()}
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    # It holds the job's coordinator secret: readable by this user only.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
    os.replace(tmp, path)
    return data
