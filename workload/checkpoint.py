"""Checkpoints on disk: written atomically, found again by version.

A checkpoint is written to a temporary file in the same directory, flushed to
disk and renamed over its final name, so a reader (or a restarted job) sees a
whole old file or a whole new one, never half of one.
"""
import os
import re
from pathlib import Path

import torch

PSERVER_FILE = re.compile(r"^pserver-(\d+)-v(\d+)\.pt$")


def save_atomic(obj, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)     # a failed write (disk full...) leaves no temp file behind
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)      # make the rename itself durable
    finally:
        os.close(dir_fd)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def pserver_path(directory, pserver_id, version):
    return Path(directory) / f"pserver-{pserver_id}-v{version:09d}.pt"


def pserver_versions(directory, pserver_id):
    """The versions pserver `pserver_id` has a checkpoint of, oldest first."""
    if not directory or not Path(directory).is_dir():
        return []
    found = []
    for path in Path(directory).iterdir():
        m = PSERVER_FILE.match(path.name)
        if m and int(m.group(1)) == pserver_id:
            found.append(int(m.group(2)))
    return sorted(found)


def prune(directory, pserver_id, keep=3):
    """Keep the newest `keep` checkpoints of this pserver: enough that every pserver still shares one."""
    for version in pserver_versions(directory, pserver_id)[:-keep]:
        pserver_path(directory, pserver_id, version).unlink(missing_ok=True)


def common_version(versions_by_pserver):
    """The newest version every pserver has a checkpoint of, or None.

    Pservers save every N updates at the same versions; a save on SIGTERM may
    land at different versions on different pservers, and then the newest
    periodic one is the consistent point to resume from.
    """
    common = set.intersection(*(set(v) for v in versions_by_pserver)) if versions_by_pserver else set()
    return max(common) if common else None
