"""MANIFEST.json: what prepare.py wrote, and which files each trainer needs.

Shape (version 1)::

    {
      "version": 1,
      "created_by": "fabtrain prepare.py",
      "strategy": "contiguous",          # how train.txt-* were cut
      "test_strategy": "contiguous",     # how test.txt-* were cut (null: no test set)
      "split_count": 4,
      "synthetic": false,                # true for --sample data
      "source": "/data/ptb.train.txt",   # human description of the train input
      "test_source": "/data/ptb.test.txt",
      "source_sha256": "...",            # only for downloaded inputs
      "dictionary": {"min_freq": 1, "words": 10000, "built_from": "train"},   # or null
      "request": {...},                  # exact inputs + options, to recognise a rerun
      "files": {
        "train.txt-00000": {"sha256": "...", "bytes": 123, "lines": 10, "kind": "train", "shard": 0},
        "test.txt-00000":  {"sha256": "...", "bytes": 45, "lines": 2, "kind": "test", "shard": 0},
        "word_dict.json":  {"sha256": "...", "bytes": 99, "lines": 12, "kind": "dict"}
      }
    }

MANIFEST.json itself is not in ``files`` (it cannot hold its own hash).
"""

from __future__ import annotations

import hashlib
import json
import os

from .errors import PrepareError

VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
DICT_NAME = "word_dict.json"
TRAIN_BASE = "train.txt"
TEST_BASE = "test.txt"


def dumps(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=False, ensure_ascii=True) + "\n").encode()


def load_manifest(path: str) -> dict:
    """Load DIR/MANIFEST.json (or a path to the file itself)."""
    if os.path.isdir(path):
        path = os.path.join(path, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise PrepareError(f"{path}: no such file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise PrepareError(f"{path}: not a valid manifest ({exc})") from None
    check_manifest(data, path)
    return data


def check_manifest(data, where: str = "MANIFEST.json") -> None:
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise PrepareError(f"{where}: not a prepare.py manifest (no 'files' object)")
    if data.get("version") != VERSION:
        raise PrepareError(f"{where}: manifest version {data.get('version')!r} "
                           f"is not supported (expected {VERSION})")
    n = data.get("split_count")
    if not isinstance(n, int) or n < 1:
        raise PrepareError(f"{where}: split_count must be a positive integer")


def files_for_trainer(manifest: dict, trainer_id: int, trainer_count: int) -> list[str]:
    """The file names (relative to the data directory) trainer `trainer_id`
    of `trainer_count` needs: its train and test shards (shard number
    ≡ trainer_id mod trainer_count), word_dict.json when there is one, and
    MANIFEST.json.  Shards come in shard order, then the dictionary, then
    the manifest.

    Raises PrepareError when the ids are out of range, or when the split
    has fewer shards than there are trainers (some trainer would get no
    training data)."""
    check_manifest(manifest)
    if isinstance(trainer_count, bool) or not isinstance(trainer_count, int) or trainer_count < 1:
        raise PrepareError(f"trainer_count must be a positive integer, not {trainer_count!r}")
    if isinstance(trainer_id, bool) or not isinstance(trainer_id, int) \
            or not 0 <= trainer_id < trainer_count:
        raise PrepareError(f"trainer_id {trainer_id!r} is out of range 0..{trainer_count - 1}")
    n = manifest["split_count"]
    if n < trainer_count:
        raise PrepareError(f"the data is split into {n} shard{'s' if n != 1 else ''} but there are "
                           f"{trainer_count} trainers: run prepare.py with --split-count "
                           f"{trainer_count} (or a multiple of it)")
    train, test, rest = [], [], []
    for name, entry in manifest["files"].items():
        kind = entry.get("kind")
        if kind in ("train", "test"):
            if entry["shard"] % trainer_count == trainer_id:
                (train if kind == "train" else test).append((entry["shard"], name))
        elif kind == "dict":
            rest.append(name)
    return [nm for _, nm in sorted(train)] + [nm for _, nm in sorted(test)] + sorted(rest) \
        + [MANIFEST_NAME]


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def verify(directory: str, manifest: dict, *, checksums: bool = True,
           names=None) -> list[str]:
    """Problems found comparing files under directory with the manifest
    (empty list: all good).  names limits the check to some files (a node
    holding only its own shards)."""
    problems = []
    for name, entry in manifest["files"].items():
        if names is not None and name not in names:
            continue
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if size != entry.get("bytes"):
            problems.append(f"{name}: {size} bytes, manifest says {entry.get('bytes')}")
            continue
        if checksums and sha256_file(path) != entry.get("sha256"):
            problems.append(f"{name}: sha256 differs from the manifest")
    return problems
