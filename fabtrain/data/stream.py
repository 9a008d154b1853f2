"""The logical input: the files of an InputSet read as one byte stream.

Everything works on bytes: a line is a run of bytes ending in ``\\n`` (or
the bytes after the last ``\\n``), whatever the encoding, so bytes that are
not UTF-8 pass through unchanged.

An input made of several files (a directory) is read as their
concatenation in order, with one ``\\n`` added after a file that does not
end in one when another file follows it (so no two files' lines merge).
"""

from __future__ import annotations

import bisect
import os

from .errors import PrepareError
from .fetch import InputSet

SCAN_BLOCK = 64 << 10     # looking for a line boundary


class InputChanged(PrepareError):
    pass


class Stream:
    """The files of an InputSet read as one byte stream."""

    NEWLINE = None  # path of a synthesized "\n" segment

    def __init__(self, inp: InputSet):
        self.inp = inp
        self.segs: list[tuple[str | None, int, int]] = []   # (path, length, logical start)
        self.starts: list[int] = []
        pos = 0
        last = len(inp.files) - 1
        for i, (path, size) in enumerate(zip(inp.files, inp.sizes)):
            if size:
                self._add(path, size, pos)
                pos += size
                if i < last and self._last_byte(path, size) != b"\n":
                    self._add(None, 1, pos)
                    pos += 1
        self.size = pos

    def _add(self, path, length, start):
        self.segs.append((path, length, start))
        self.starts.append(start)

    @staticmethod
    def _last_byte(path: str, size: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(size - 1)
            return f.read(1)

    def pieces(self, a: int, b: int) -> list[tuple[str | None, int, int]]:
        """(path, offset, length) pieces covering logical [a, b); path None
        stands for a synthesized newline."""
        out = []
        if a >= b:
            return out
        i = bisect.bisect_right(self.starts, a) - 1
        while a < b:
            path, length, start = self.segs[i]
            lo = a - start
            hi = min(length, b - start)
            out.append((path, lo, hi - lo))
            a = start + hi
            i += 1
        return out

    def read_at(self, off: int, n: int) -> bytes:
        chunks = []
        for path, lo, ln in self.pieces(off, min(off + n, self.size)):
            if path is None:
                chunks.append(b"\n")
            else:
                with open(path, "rb") as f:
                    f.seek(lo)
                    chunks.append(f.read(ln))
        return b"".join(chunks)

    def iter_blocks(self, block: int, buffer: bytearray | None = None):
        """The whole stream, in blocks of about `block` bytes.  Given a
        buffer (of at least `block` bytes) the blocks are memoryviews of it,
        valid until the next one is read: no new memory for every block, so
        no page faults for every block."""
        view = memoryview(buffer) if buffer is not None else None
        for path, length, _start in self.segs:
            if path is None:
                yield b"\n"
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except (AttributeError, OSError):
                    pass
                off = 0
                while off < length:
                    want = min(block, length - off)
                    if view is None:
                        data = os.pread(fd, want, off)
                        got = len(data)
                    else:
                        got = os.preadv(fd, [view[:want]], off)
                        data = view[:got]
                    if not got:
                        raise InputChanged(f"{path}: input changed while it was read (shorter)")
                    off += got
                    yield data
            finally:
                os.close(fd)

    def newline_at_or_after(self, pos: int) -> int:
        """Index of the first b"\\n" at or after pos, or -1."""
        while pos < self.size:
            data = self.read_at(pos, SCAN_BLOCK)
            i = data.find(b"\n")
            if i >= 0:
                return pos + i
            pos += len(data)
        return -1

    def tail_line_starts(self, m: int) -> list[int]:
        """Starts of the last m lines, last line first (fewer if the stream
        has fewer lines).  Reads backwards only as far as it needs."""
        out: list[int] = []
        if self.size == 0 or m <= 0:
            return out
        end = self.size
        if self.read_at(end - 1, 1) == b"\n":
            end -= 1          # the final newline ends the last line, starts none
        hi = end
        while hi > 0 and len(out) < m:
            lo = max(0, hi - SCAN_BLOCK)
            data = self.read_at(lo, hi - lo)
            j = len(data)
            while len(out) < m:
                k = data.rfind(b"\n", 0, j)
                if k < 0:
                    break
                out.append(lo + k + 1)
                j = k
            hi = lo
        if len(out) < m:
            out.append(0)     # the first line
        return out

    def count_lines_upto(self, m: int) -> int:
        """min(number of lines, m)."""
        return len(self.tail_line_starts(m))


def require_lines(stream: Stream, n: int, what: str) -> None:
    if stream.size == 0:
        raise PrepareError(f"{what}: empty input")
    have = stream.count_lines_upto(n)
    if have < n:
        raise PrepareError(f"{what}: only {have} line{'s' if have != 1 else ''}, "
                           f"fewer than the {n} shards asked for (--split-count {n})")
