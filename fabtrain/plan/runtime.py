"""fabtrain's node runtime: the files that run on a node, and their version.

The runtime (fabtrain/__init__.py, fabtrain/contract/ and fabtrain/node/) is shipped by `fab
deploy` to ``<workspace>/runtime/<version>/``, apart from the user's code in
``<workspace>/code``: neither can shadow the other, and a job keeps the
runtime it started with while a newer fabtrain deploys another version beside
it. The version is a hash of the files, so it changes exactly when they do.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from fabtrain.contract import RUNTIME_PACKAGES

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # .../fabtrain


def runtime_files() -> list[Path]:
    """Every file of the runtime, relative to the directory that holds fabtrain/."""
    files = [PACKAGE_ROOT / "__init__.py"]
    for package in RUNTIME_PACKAGES:
        files += sorted((PACKAGE_ROOT / package).rglob("*.py"))
    return [f.relative_to(PACKAGE_ROOT.parent) for f in files if "__pycache__" not in f.parts]


@functools.lru_cache(maxsize=1)
def runtime_version() -> str:
    digest = hashlib.sha256()
    for rel in runtime_files():
        digest.update(str(rel).encode() + b"\0" + (PACKAGE_ROOT.parent / rel).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def runtime_dir() -> str:
    """Where the runtime lives on a node, relative to its workspace ($WS)."""
    return f"$WS/runtime/{runtime_version()}"
