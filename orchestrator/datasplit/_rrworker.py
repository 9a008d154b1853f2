"""Round-robin worker process (stdlib only; run as a script by strategies.py).

Splitting lines costs Python objects and holds the GIL, so for large
inputs the round-robin strategy spreads it over worker processes.  The
parent sends one JSON line per task on stdin:

    {"slot": 0, "pieces": [[path, offset, length], [null, 0, 1], ...]}

(a null path is a synthesized newline).  The worker reads those bytes,
cuts them into lines, and writes, into the memfd of that slot (passed with
``pass_fds``; its number is given in the first line, ``{"n": N,
"slots": [fd, fd]}``), the N groups of lines whose index within the chunk
is 0, 1, ..., N-1 mod N, one after the other.  It answers with one JSON
line ``{"sizes": [...], "lines": [...]}``; the parent rotates the groups
to shards by the chunk's first global line number.
"""

import json
import os
import sys


def split_groups(data: bytes, n: int):
    """(groups, line counts): group j holds lines j, j+n, ... of data."""
    parts = data.split(b"\n")
    last = parts.pop()            # b"" when data ends with a newline
    total = len(parts)
    groups, counts = [], []
    for j in range(n):
        sel = parts[j::n]
        c = len(sel)
        if sel:
            sel.append(b"")
            out = b"\n".join(sel)
        else:
            out = b""
        if last and j == total % n:
            out += last
            c += 1
        groups.append(out)
        counts.append(c)
    return groups, counts


def main() -> int:
    stdin = sys.stdin.buffer
    stdout = sys.stdout.buffer
    hello = json.loads(stdin.readline())
    n = hello["n"]
    slots = hello["slots"]
    fds = {}
    for line in stdin:
        task = json.loads(line)
        chunks = []
        for path, off, length in task["pieces"]:
            if path is None:
                chunks.append(b"\n")
                continue
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            data = os.pread(fd, length, off)
            while len(data) < length:
                more = os.pread(fd, length - len(data), off + len(data))
                if not more:
                    raise SystemExit(f"{path}: input changed while it was read (shorter)")
                data += more
            chunks.append(data)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        groups, counts = split_groups(data, n)
        del data
        out = slots[task["slot"]]
        total = sum(len(g) for g in groups)
        if os.fstat(out).st_size < total:
            os.ftruncate(out, total)
        off = 0
        for g in groups:
            view = memoryview(g)
            while view:
                w = os.pwrite(out, view, off)
                off += w
                view = view[w:]
        stdout.write(json.dumps({"sizes": [len(g) for g in groups], "lines": counts}).encode()
                     + b"\n")
        stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
