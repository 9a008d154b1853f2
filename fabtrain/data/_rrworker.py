"""Round-robin line dealing (stdlib only): the LineDealer used by
roundrobin.py, and the worker process it runs for large inputs.

Splitting lines costs Python objects and holds the GIL, so for large
inputs the round-robin strategy spreads it over worker processes (this file
run as a script).  The parent sends one JSON line per task on stdin:

    {"slot": 0, "pieces": [[path, offset, length], [null, 0, 1], ...]}

(a null path is a synthesized newline; a task starts at a line start).
The worker reads those bytes, deals their lines to N groups (line j of the
task to group j mod N), and writes the groups one after the other into the
memfd of that slot (passed with ``pass_fds``; its number is given in the
first line, ``{"n": N, "slots": [fd, fd]}``).  It answers with one JSON
line ``{"sizes": [...], "lines": [...]}``; the parent rotates the groups
to shards by the task's first global line number.
"""

import json
import os
import sys

# Lines are cut this many bytes at a time: the bytes objects that split()
# makes are still in the CPU cache when join() reads them, which halves the
# cost per line against cutting megabytes at a time.
DEAL_BLOCK = 64 << 10


class LineDealer:
    """Deals the lines of a byte stream to n groups in turn: the first line
    to group `first`, the next to first+1 mod n, and so on.

    feed() takes the stream in pieces of any size (lines may be cut across
    them); take() hands over what each group got since the last take(), as
    lists of bytes that end in b"\\n"; finish() deals a last line that has
    no newline."""

    def __init__(self, n: int, first: int = 0, block: int | None = None):
        self.n = n
        self.next = first % n        # the group the next line goes to
        self.block = block or DEAL_BLOCK
        self.carry = []              # the start of a line not yet ended
        self.lines = [0] * n
        self.pieces = [[] for _ in range(n)]

    def feed(self, data) -> None:
        """Deal the lines in data (bytes, bytearray or memoryview)."""
        if isinstance(data, bytes) and len(data) <= self.block:
            self._deal(data.split(b"\n"))
            return
        view = memoryview(data)
        for off in range(0, len(view), self.block):
            self._deal(bytes(view[off:off + self.block]).split(b"\n"))

    def _deal(self, parts: list) -> None:
        if len(parts) == 1:                  # no line ends in this block
            self.carry.append(parts[0])
            return
        if self.carry:
            self.carry.append(parts[0])
            parts[0] = b"".join(self.carry)
        last = parts.pop()
        self.carry = [last] if last else []
        n, pieces, lines, first = self.n, self.pieces, self.lines, self.next
        for k in range(n):
            sel = parts[(k - first) % n::n]
            if sel:
                lines[k] += len(sel)
                sel.append(b"")                  # join then ends with "\n", no extra copy
                pieces[k].append(b"\n".join(sel))
        self.next = (first + len(parts)) % n

    def finish(self) -> None:
        if self.carry:
            k = self.next
            self.pieces[k].append(b"".join(self.carry))
            self.lines[k] += 1
            self.next = (k + 1) % self.n
            self.carry = []

    def take(self):
        """(pieces per group, lines per group) since the last take()."""
        out, counts = self.pieces, self.lines
        self.pieces = [[] for _ in range(self.n)]
        self.lines = [0] * self.n
        return out, counts


def _pwrite_all(fd: int, pieces, off: int) -> int:
    iov_max = 1024
    for i in range(0, len(pieces), iov_max):
        batch = [memoryview(p) for p in pieces[i:i + iov_max]]
        while batch:
            w = os.pwritev(fd, batch, off)
            off += w
            while batch and w >= len(batch[0]):
                w -= len(batch[0])
                batch.pop(0)
            if batch and w:
                batch[0] = batch[0][w:]
    return off


def main() -> int:
    stdin = sys.stdin.buffer
    stdout = sys.stdout.buffer
    hello = json.loads(stdin.readline())
    n = hello["n"]
    slots = hello["slots"]
    fds = {}
    for line in stdin:
        task = json.loads(line)
        dealer = LineDealer(n)
        for path, off, length in task["pieces"]:
            if path is None:
                dealer.feed(b"\n")
                continue
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            end = off + length
            while off < end:
                # read a block at a time straight into the bytes object split() cuts
                data = os.pread(fd, min(end - off, dealer.block), off)
                if not data:
                    raise SystemExit(f"{path}: input changed while it was read (shorter)")
                dealer.feed(data)
                off += len(data)
        dealer.finish()
        groups, counts = dealer.take()
        sizes = [sum(len(p) for p in g) for g in groups]
        out = slots[task["slot"]]
        total = sum(sizes)
        if os.fstat(out).st_size < total:
            os.ftruncate(out, total)
        off = 0
        for g in groups:
            off = _pwrite_all(out, g, off)
        stdout.write(json.dumps({"sizes": sizes, "lines": counts}).encode() + b"\n")
        stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
