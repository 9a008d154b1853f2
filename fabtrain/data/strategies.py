"""Splitting one input into N shards: the strategies, and split() to run one.

``contiguous`` (contiguous.py)
    N byte ranges cut at line boundaries near ``k * size / N``; the shards
    concatenate back to the input byte for byte.
``round-robin`` (roundrobin.py, with _rrworker.py)
    Line i goes to shard ``i mod N``; line counts differ by at most one.
``files`` (files.py)
    File i of a directory input (sorted) goes to shard ``i mod N``.

The input is read as one byte stream (stream.py); each shard is written,
fsynced and described (sha256, bytes, lines) by shardio.py.
"""

from __future__ import annotations

import os

from .contiguous import split_contiguous
from .errors import PrepareError
from .fetch import InputSet
from .files import split_files
from .progress import Progress
from .roundrobin import split_round_robin
from .shardio import ShardResult
from .stream import Stream, require_lines

STRATEGIES = ("contiguous", "round-robin", "files")


def split(strategy: str, inp: InputSet, n: int, out_dir: str, base: str, kind: str, what: str,
          *, progress_enabled: bool = True, label: str | None = None) -> tuple[str, list[ShardResult]]:
    """Split inp into n shards named ``{base}-00000`` ... under out_dir.

    Returns (strategy actually used, results).  ``files`` on a single-file
    input (a test file, say) falls back to ``contiguous``."""
    if strategy not in STRATEGIES:
        raise PrepareError(f"--strategy {strategy}: unknown (use one of {', '.join(STRATEGIES)})")
    names = [shard_name(base, k) for k in range(n)]
    paths = [os.path.join(out_dir, nm) for nm in names]
    if strategy == "files" and not inp.is_dir:
        strategy = "contiguous" if len(inp.files) == 1 else strategy
    stream = Stream(inp)
    if strategy != "files":
        require_lines(stream, n, what)
    elif stream.size == 0:
        raise PrepareError(f"{what}: empty input")
    total = stream.size
    with Progress(label or f"splitting {base}", total, enabled=progress_enabled) as bar:
        if strategy == "contiguous":
            res = split_contiguous(stream, n, paths, names, kind, bar)
        elif strategy == "round-robin":
            res = split_round_robin(stream, n, paths, names, kind, bar)
        else:
            res = split_files(inp, n, paths, names, kind, what, bar)
    return strategy, res


def shard_name(base: str, k: int) -> str:
    return f"{base}-{k:05d}"
