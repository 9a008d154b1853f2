"""The ``round-robin`` strategy: line i goes to shard ``i mod N``.

Line counts differ by at most one.  Lines are dealt by
``_rrworker.LineDealer`` in small, cache-friendly blocks: in worker
processes for large inputs (the dealing holds the GIL, so a thread could
not share it), else in this process with a writer thread.  Either way this
process writes every shard in order and hashes it as it goes; the buffer
and chunk sizes below are measured (docs/data.md, bench/split.py).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import queue
import sys
import threading

from ._rrworker import LineDealer
from .errors import PrepareError
from .shardio import ShardResult, create_new, finish_shards, write_all
from .stream import Stream

RR_BATCH = 8 << 20        # round-robin: input read, and handed to the writer, in these
RR_CHUNK = 16 << 20       # round-robin chunk for a worker process
RR_SLOTS = 2              # chunks in flight per worker
RR_PARALLEL_MIN = 64 << 20  # inputs smaller than this are split in this process
RR_WORKERS = None         # force a worker count (tests); None: by size and CPUs
WORKER_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rrworker.py")


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rr_worker_count(size: int) -> int:
    """Worker processes for round-robin (0: split in this process)."""
    if RR_WORKERS is not None:
        return RR_WORKERS
    if size < RR_PARALLEL_MIN or not hasattr(os, "memfd_create"):
        return 0
    # Dealing lines holds the GIL, so a thread cannot share it; with two
    # CPUs two worker processes deal while this one writes and hashes
    # (measured: 10-15% faster than dealing here, bench/split.py).
    cpus = _available_cpus()
    return min(max(cpus - 1, 2), 4) if cpus >= 2 else 0


def split_round_robin(stream: Stream, n: int, paths: list[str], names: list[str], kind: str,
                      progress=None) -> list[ShardResult]:
    workers = rr_worker_count(stream.size)
    if workers:
        return _split_rr_parallel(stream, n, paths, names, kind, progress, workers)
    return _split_rr_serial(stream, n, paths, names, kind, progress)


class _ShardFiles:
    """The n shards being written in order: their fds, and the running
    sha256, byte count and line count of each."""

    def __init__(self, paths: list[str]):
        n = len(paths)
        self.fds = [create_new(p) for p in paths]
        self.hashes = [hashlib.sha256() for _ in range(n)]
        self.nbytes = [0] * n
        self.lines = [0] * n

    def append(self, k: int, data) -> None:
        write_all(self.fds[k], data)
        self.hashes[k].update(data)
        self.nbytes[k] += len(data)

    def finish(self, names: list[str], kind: str) -> list[ShardResult]:
        return finish_shards(self.fds, names, kind, self.hashes, self.nbytes, self.lines)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


# --------------------------------------------------------------------------
# large inputs: lines dealt by worker processes


def _rr_chunks(stream: Stream, size: int) -> list[tuple[int, int]]:
    """Consecutive ranges of about `size` bytes, each ending at a line end
    (the last at the end of the stream)."""
    bounds = [0]
    while bounds[-1] + size < stream.size:
        nl = stream.newline_at_or_after(bounds[-1] + size - 1)
        if nl < 0 or nl + 1 >= stream.size:
            break
        bounds.append(nl + 1)
    bounds.append(stream.size)
    return list(zip(bounds, bounds[1:]))


class _DealerProcesses:
    """P worker processes running _rrworker.py, and the memfds they deal into.

    Chunk c goes to worker c mod P, into its slot (c // P) mod 2, a memfd
    that both processes map; two slots per worker keep every worker busy
    while its previous chunk is written out."""

    def __init__(self, stream: Stream, chunks: list[tuple[int, int]], p: int):
        self.stream, self.chunks, self.p = stream, chunks, p
        self.nslots = RR_SLOTS
        self.memfds = [[os.memfd_create(f"fabtrain-rr-{w}-{s}", getattr(os, "MFD_CLOEXEC", 1))
                        for s in range(self.nslots)] for w in range(p)]
        self.maps: dict = {}
        self.procs: list = []

    def start(self, n: int) -> None:
        """Start the workers, dealing to n groups, and fill every slot."""
        import subprocess
        for w in range(self.p):
            proc = subprocess.Popen([sys.executable, "-I", WORKER_PY], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=self.memfds[w])
            self.procs.append(proc)
            proc.stdin.write(json.dumps({"n": n, "slots": self.memfds[w]}).encode() + b"\n")
        for c in range(min(len(self.chunks), self.p * self.nslots)):
            self._send(c)

    def _send(self, c: int) -> None:
        a, b = self.chunks[c]
        task = {"slot": (c // self.p) % self.nslots,
                "pieces": [list(x) for x in self.stream.pieces(a, b)]}
        proc = self.procs[c % self.p]
        proc.stdin.write(json.dumps(task).encode() + b"\n")
        proc.stdin.flush()

    def receive(self, c: int):
        """(bytes per group, lines per group, a view of the groups one after
        the other) of chunk c.  The caller releases the view, then calls
        written(c)."""
        w, s = c % self.p, (c // self.p) % self.nslots
        reply = self.procs[w].stdout.readline()
        if not reply:
            raise self._failed(w)
        res = json.loads(reply)
        sizes = res["sizes"]
        return sizes, res["lines"], self._view(w, s, sum(sizes))

    def written(self, c: int) -> None:
        """Chunk c is out of its slot: the slot takes the next chunk for it."""
        if c + self.p * self.nslots < len(self.chunks):
            self._send(c + self.p * self.nslots)

    def _view(self, w: int, s: int, total: int):
        mm, length = self.maps.get((w, s), (None, 0))
        if mm is None or length < total:
            if mm is not None:
                mm.close()
            length = os.fstat(self.memfds[w][s]).st_size
            mm = mmap.mmap(self.memfds[w][s], length, mmap.MAP_SHARED, mmap.PROT_READ)
            self.maps[(w, s)] = (mm, length)
        return memoryview(mm)

    def _failed(self, w: int) -> PrepareError:
        proc = self.procs[w]
        try:
            proc.stdin.close()
        except OSError:
            pass
        proc.wait(timeout=10)
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        reason = err[-1] if err else f"exit status {proc.returncode}"
        return PrepareError(f"round-robin worker process failed: {reason}")

    def close(self) -> None:
        """End the workers (closing stdin ends them) and free the slots."""
        import subprocess
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for f in (proc.stdout, proc.stderr):
                f.close()
        for mm, _ in self.maps.values():
            mm.close()
        for row in self.memfds:
            for fd in row:
                os.close(fd)


def _write_dealt(shards: _ShardFiles, view, sizes: list[int], counts: list[int], first: int) -> None:
    """Write one dealt chunk: its group j (the next sizes[j] bytes of view)
    goes to shard (first + j) mod n, first being the chunk's first line."""
    n = len(shards.lines)
    off = 0
    for j in range(n):
        k = (first + j) % n
        sz = sizes[j]
        if sz:
            piece = view[off:off + sz]
            shards.append(k, piece)
            piece.release()
            off += sz
        shards.lines[k] += counts[j]


def _split_rr_parallel(stream: Stream, n: int, paths: list[str], names: list[str], kind: str,
                       progress, workers: int) -> list[ShardResult]:
    """Round-robin with the line dealing done by worker processes
    (_DealerProcesses); this process only writes and hashes, in order."""
    chunks = _rr_chunks(stream, RR_CHUNK)
    dealers = _DealerProcesses(stream, chunks, max(1, min(workers, len(chunks))))
    shards = None
    try:
        dealers.start(n)
        shards = _ShardFiles(paths)
        first = 0
        for c in range(len(chunks)):
            sizes, counts, view = dealers.receive(c)
            try:
                _write_dealt(shards, view, sizes, counts, first)
            finally:
                view.release()
            first += sum(counts)
            if progress is not None:
                progress.update(sum(sizes))
            dealers.written(c)
        return shards.finish(names, kind)
    finally:
        dealers.close()
        if shards is not None:
            shards.close()


# --------------------------------------------------------------------------
# small inputs: lines dealt in this process


def _split_rr_serial(stream: Stream, n: int, paths: list[str], names: list[str], kind: str,
                     progress=None) -> list[ShardResult]:
    """Round-robin in this process: this thread deals lines, a writer
    thread writes and hashes.  What each shard got from RR_BATCH bytes of
    input goes to the writer as one bytes object, so the two threads hand
    the GIL over a few times per batch, not per line block."""
    shards = _ShardFiles(paths)
    q: queue.Queue = queue.Queue(maxsize=4)
    failure: list[BaseException] = []

    def writer():
        try:
            while True:
                outs = q.get()
                if outs is None:
                    return
                if failure:
                    continue
                for k, data in enumerate(outs):
                    if data:
                        shards.append(k, data)
                        if progress is not None:
                            progress.update(len(data))
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)

    def hand_over():
        pieces, counts = dealer.take()
        for k in range(n):
            shards.lines[k] += counts[k]
        q.put([b"".join(p) for p in pieces])

    dealer = LineDealer(n)
    t = threading.Thread(target=writer, name="prepare-rr-writer", daemon=True)
    old_interval = sys.getswitchinterval()
    # After each write and hash the writer needs the GIL back from the
    # dealing thread, which holds it until the switch interval (5 ms by
    # default) runs out; a short interval keeps the writer from idling.
    sys.setswitchinterval(min(old_interval, 0.0002))
    t.start()
    try:
        for big in stream.iter_blocks(RR_BATCH, bytearray(RR_BATCH)):
            if failure:
                break
            dealer.feed(big)
            hand_over()
        if not failure:
            dealer.finish()                   # a last line without a newline
            hand_over()
    finally:
        q.put(None)
        t.join()
        sys.setswitchinterval(old_interval)
    try:
        if failure:
            raise failure[0]
        return shards.finish(names, kind)
    finally:
        shards.close()
