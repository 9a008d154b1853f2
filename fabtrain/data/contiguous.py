"""The ``contiguous`` strategy: N byte ranges of the input, cut at line ends.

The cuts lie at line boundaries near ``k * size / N``; shard k is range k,
so the shards concatenate back to the input byte for byte.  Every shard
gets at least one line.  The kernel copies each range
(shardio.build_shard), shards in parallel threads.
"""

from __future__ import annotations

from .shardio import ShardResult, run_shards
from .stream import Stream


def contiguous_cuts(stream: Stream, n: int) -> list[int]:
    """n+1 boundaries 0 = c0 < c1 < ... < cn = size, each a line start,
    each close to k*size/n, with at least one line per shard.
    The caller has checked that the stream has at least n lines."""
    size = stream.size
    tail = stream.tail_line_starts(n - 1)   # tail[j-1] = start of the j-th last line
    cuts = [0]
    for k in range(1, n):
        target = k * size // n
        nl = stream.newline_at_or_after(max(target - 1, cuts[-1]))
        cut = nl + 1 if nl >= 0 else size
        # leave at least one line for each of the n-k shards still to come
        cut = min(cut, tail[n - k - 1])
        cuts.append(cut)
    cuts.append(size)
    return cuts


def split_contiguous(stream: Stream, n: int, paths: list[str], names: list[str], kind: str,
                     progress=None) -> list[ShardResult]:
    cuts = contiguous_cuts(stream, n)
    jobs = [(stream.pieces(cuts[k], cuts[k + 1]), paths[k], names[k], kind, k) for k in range(n)]
    return run_shards(jobs, progress)
