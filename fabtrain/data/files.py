"""The ``files`` strategy: whole files of a directory input, dealt to shards.

File i of the input (sorted) goes to shard ``i mod N``, the shard being its
files concatenated (as the PaddlePaddle cluster docs assign files by
suffix).  Needs at least N files and no empty shard.  The bytes are copied
by the kernel, as for ``contiguous``.
"""

from __future__ import annotations

import os

from .errors import PrepareError
from .fetch import InputSet
from .shardio import ShardResult, run_shards
from .stream import Stream


def assign_files(inp: InputSet, n: int) -> list[list[int]]:
    """File indexes of each shard: file i -> shard i mod n."""
    return [list(range(k, len(inp.files), n)) for k in range(n)]


def split_files(inp: InputSet, n: int, paths: list[str], names: list[str], kind: str,
                what: str, progress=None) -> list[ShardResult]:
    if len(inp.files) < n:
        raise PrepareError(f"{what}: {len(inp.files)} file{'s' if len(inp.files) != 1 else ''}, "
                           f"fewer than the {n} shards asked for (strategy files gives each "
                           f"shard whole files)")
    jobs = []
    for k, idxs in enumerate(assign_files(inp, n)):
        sub = InputSet([inp.files[i] for i in idxs], [inp.sizes[i] for i in idxs], "")
        if sub.total_bytes == 0:
            raise PrepareError(f"{what}: shard {k} would be empty (its files "
                               f"{', '.join(os.path.basename(f) for f in sub.files[:3])} hold no data)")
        s = Stream(sub)
        jobs.append((s.pieces(0, s.size), paths[k], names[k], kind, k))
    return run_shards(jobs, progress)
