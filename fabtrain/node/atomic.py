"""The one atomic write of the node side: a reader sees the old file or the new, never half of one.

Temp file in the same directory, fsync (not for health.json, rewritten every
interval), rename. Every record fabtrain writes on a node (job.json, run
records, health.json, coordinator state) goes through `write`. Records are private to the user by default (0600).
"""
from __future__ import annotations

import json
import os


def write(path: str, data, mode: int = 0o600, durable: bool = True) -> None:
    """Replace path with data (str or bytes), whole: readers see the old file or the new one.

    durable: on disk before it replaces the old one (fsync). Without it a crash of the
    machine may lose the newest write; for a file rewritten every second (health.json)
    that is nothing, and an fsync a second on every agent of a node is not."""
    if isinstance(data, str):
        data = data.encode()
    tmp = "%s.tmp.%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def write_json(path: str, value, mode: int = 0o600, indent: int | None = None, durable: bool = True) -> None:
    write(path, json.dumps(value, indent=indent), mode, durable)


def read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
