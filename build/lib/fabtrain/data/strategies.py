"""Splitting one input into N shards.

Everything works on bytes: a line is a run of bytes ending in ``\\n`` (or
the bytes after the last ``\\n``), whatever the encoding, so bytes that are
not UTF-8 pass through unchanged.

An input made of several files (a directory) is read as their
concatenation in order, with one ``\\n`` added after a file that does not
end in one when another file follows it (so no two files' lines merge).

Strategies
----------
``contiguous``
    N byte ranges cut at line boundaries near ``k * size / N``; shard k is
    range k, so the shards concatenate back to the input byte for byte.
    Every shard gets at least one line.  Data is copied by the kernel
    (``os.copy_file_range``, falling back to ``os.sendfile``, then to
    pread/write), shards in parallel threads.
``round-robin``
    Line i goes to shard ``i mod N``; line counts differ by at most one.
    Lines are dealt by ``_rrworker.LineDealer`` in small, cache-friendly
    blocks: in worker processes for large inputs (the dealing holds the
    GIL), else in this process with a writer thread that writes and hashes.
``files``
    File i of a directory input (sorted) goes to shard ``i mod N``, the
    shard being its files concatenated (as the PaddlePaddle cluster docs
    assign files by suffix).  Needs at least N files and no empty shard.

Every shard is created under a temporary name by the caller, fsynced here,
and described by a ShardResult (sha256, bytes, lines) computed from the
bytes as they are written (copied shards: through a read-only mapping of
what was just copied).
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import mmap
import os
import queue
import sys
import threading

from .errors import PrepareError
from .fetch import InputSet
from ._rrworker import LineDealer
from .progress import Progress

STRATEGIES = ("contiguous", "round-robin", "files")
READ_BLOCK = 8 << 20      # read-back / hashing block
RR_BATCH = 8 << 20        # round-robin: input read, and handed to the writer, in these
RR_CHUNK = 16 << 20       # round-robin chunk for a worker process
RR_SLOTS = 2              # chunks in flight per worker
RR_PARALLEL_MIN = 64 << 20  # inputs smaller than this are split in this process
RR_WORKERS = None         # force a worker count (tests); None: by size and CPUs
SCAN_BLOCK = 64 << 10     # looking for a line boundary


class ShardResult:
    __slots__ = ("name", "kind", "shard", "sha256", "bytes", "lines")

    def __init__(self, name: str, kind: str, shard, sha256: str, bytes: int, lines: int):
        self.name, self.kind, self.shard = name, kind, shard
        self.sha256, self.bytes, self.lines = sha256, bytes, lines

    def entry(self) -> dict:
        d = {"sha256": self.sha256, "bytes": self.bytes, "lines": self.lines, "kind": self.kind}
        if self.shard is not None:
            d["shard"] = self.shard
        return d


class InputChanged(PrepareError):
    pass


# --------------------------------------------------------------------------
# the logical input


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


# --------------------------------------------------------------------------
# copying and checking one shard

_copy_mode = ["copy_file_range" if hasattr(os, "copy_file_range") else
              "sendfile" if hasattr(os, "sendfile") else "readwrite"]
_FALLBACK_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                    getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EPERM, errno.ETXTBSY}


def copy_mode() -> str:
    """Which kernel path copies data in this process (for the docs/bench)."""
    return _copy_mode[0]


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def copy_range(src: int, dst: int, offset: int, count: int, path: str) -> None:
    """Append src[offset:offset+count] to dst (at dst's file position)."""
    end = offset + count
    while offset < end:
        want = min(end - offset, 1 << 30)
        mode = _copy_mode[0]
        try:
            if mode == "copy_file_range":
                n = os.copy_file_range(src, dst, want, offset)
            elif mode == "sendfile":
                n = os.sendfile(dst, src, offset, want)
            else:
                data = os.pread(src, min(want, READ_BLOCK), offset)
                _write_all(dst, data)
                n = len(data)
        except OSError as exc:
            if mode != "readwrite" and exc.errno in _FALLBACK_ERRNOS:
                _copy_mode[0] = "sendfile" if mode == "copy_file_range" else "readwrite"
                continue
            raise
        if n == 0:
            raise InputChanged(f"{path}: input changed while it was read (shorter)")
        offset += n


def digest_fd(fd: int, size: int) -> tuple[str, int, bytes]:
    """(sha256 hex, number of b"\\n", last byte) of the first size bytes of fd."""
    h = hashlib.sha256()
    buf = bytearray(min(READ_BLOCK, max(size, 1)))
    view = memoryview(buf)
    off = 0
    newlines = 0
    last = b""
    while off < size:
        n = os.preadv(fd, [buf], off)
        if n == 0:
            raise PrepareError("output file shrank while it was checked")
        n = min(n, size - off)
        h.update(view[:n])
        newlines += buf.count(b"\n", 0, n)
        last = bytes(buf[n - 1:n])
        off += n
    return h.hexdigest(), newlines, last


def _lines(newlines: int, size: int, last: bytes) -> int:
    return newlines + (1 if size and last != b"\n" else 0)


WC_MIN = 32 << 20     # files at least this big are line-counted by wc -l
_wc = []


def _wc_start(path: str):
    """Start `wc -l < path` (coreutils counts newlines with SIMD, several
    times faster than bytes.count, and outside our GIL); None if there is
    no wc."""
    if not _wc:
        import shutil
        _wc.append(shutil.which("wc"))
    if not _wc[0]:
        return None
    import subprocess
    try:
        with open(path, "rb") as src:
            return subprocess.Popen([_wc[0], "-l"], stdin=src, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, env={"LC_ALL": "C"})
    except OSError:
        return None


def _wc_finish(proc) -> int | None:
    out, _ = proc.communicate()
    try:
        return int(out.split()[0]) if proc.returncode == 0 else None
    except (ValueError, IndexError):
        return None


def describe_file(path: str, name: str, kind: str, shard: int | None = None) -> ShardResult:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        sha, newlines, last = digest_fd(fd, size)
    finally:
        os.close(fd)
    return ShardResult(name, kind, shard, sha, size, _lines(newlines, size, last))


_sync_file_range = []


def _start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """sync_file_range(SYNC_FILE_RANGE_WRITE): start writing these dirty
    pages without waiting, so the disk works while we go on and the final
    fsync has only the tail to wait for.  Best effort (Linux/glibc only)."""
    if not _sync_file_range:
        fn = None
        try:
            import ctypes
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
        except (ImportError, OSError, AttributeError):
            fn = None
        _sync_file_range.append(fn)
    fn = _sync_file_range[0]
    if fn is not None:
        fn(fd, offset, nbytes, 2)


def _create(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)


COPY_STEP = 4 << 20       # copied, then hashed while still in the CPU cache
WRITEBACK_STEP = 32 << 20  # how often writeback is started during a copy


class _ShardWriter:
    """Copies pieces into one new file with the kernel's copy path and
    hashes every step right after it is copied, through a read-only mapping
    of what was just written: no second pass over the file, and no copy of
    the bytes into this process for the checksum."""

    def __init__(self, fd: int, progress=None):
        self.fd = fd
        self.progress = progress
        self.hash = hashlib.sha256()
        self.size = 0
        self.flushed = 0
        self.last = b""

    def copy(self, src: int, offset: int, count: int, path: str) -> None:
        end = offset + count
        while offset < end:
            step = min(COPY_STEP, end - offset)
            copy_range(src, self.fd, offset, step, path)
            start = self.size - self.size % mmap.ALLOCATIONGRANULARITY
            skip = self.size - start
            with mmap.mmap(self.fd, skip + step, mmap.MAP_SHARED, mmap.PROT_READ,
                           offset=start) as mm:
                with memoryview(mm) as view:
                    self._hashed(view[skip:])
            offset += step

    def write(self, data: bytes) -> None:
        _write_all(self.fd, data)
        self._hashed(memoryview(data))

    def _hashed(self, view) -> None:
        self.hash.update(view)
        self.last = bytes(view[-1:])
        self.size += len(view)
        if self.size - self.flushed >= WRITEBACK_STEP:
            _start_writeback(self.fd, self.flushed, self.size - self.flushed)
            self.flushed = self.size
        if self.progress is not None:
            self.progress.update(len(view))


def build_shard(pieces, dst_path: str, name: str, kind: str, shard: int,
                progress=None) -> ShardResult:
    """Write the pieces to a new file, fsync it, and describe it."""
    fd = _create(dst_path)
    try:
        out = _ShardWriter(fd, progress)
        for path, off, length in pieces:
            if path is None:
                out.write(b"\n")
                continue
            src = os.open(path, os.O_RDONLY)
            try:
                out.copy(src, off, length, path)
            finally:
                os.close(src)
        # lines: wc -l (SIMD, another process) counts while fsync waits for
        # the disk; small files are counted here
        wc = _wc_start(dst_path) if out.size >= WC_MIN else None
        try:
            os.fsync(fd)
        except BaseException:
            if wc is not None:
                wc.kill()
                wc.communicate()
            raise
        newlines = _wc_finish(wc) if wc is not None else None
        if newlines is None:
            _sha, newlines, _last = digest_fd(fd, out.size)
        lines = _lines(newlines, out.size, out.last)
    finally:
        os.close(fd)
    return ShardResult(name, kind, shard, out.hash.hexdigest(), out.size, lines)


def _workers(n: int) -> int:
    return max(1, min(n, 2 * (os.cpu_count() or 1), 16))


def _run_shards(jobs, progress) -> list[ShardResult]:
    """jobs: list of (pieces, dst_path, name, kind, shard)."""
    if len(jobs) == 1:
        return [build_shard(*jobs[0], progress=progress)]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=_workers(len(jobs))) as pool:
        futs = [pool.submit(build_shard, *job, progress=progress) for job in jobs]
        return [f.result() for f in futs]


# --------------------------------------------------------------------------
# the strategies


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
    return _run_shards(jobs, progress)


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
    return _run_shards(jobs, progress)


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


def _split_rr_parallel(stream: Stream, n: int, paths: list[str], names: list[str], kind: str,
                       progress, workers: int) -> list[ShardResult]:
    """Round-robin with the line splitting done by worker processes
    (_rrworker.py); this process only writes and hashes, in order.

    Chunk c goes to worker c mod P, into its slot (c // P) mod 2, a memfd
    that both processes map; two slots per worker keep every worker busy
    while its previous chunk is written out."""
    import json
    import mmap
    import subprocess
    import sys

    chunks = _rr_chunks(stream, RR_CHUNK)
    p = max(1, min(workers, len(chunks)))
    nslots = RR_SLOTS
    memfds = [[os.memfd_create(f"fabtrain-rr-{w}-{s}", getattr(os, "MFD_CLOEXEC", 1))
               for s in range(nslots)] for w in range(p)]
    maps: dict = {}
    procs: list = []
    fds: list[int] = []
    worker_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rrworker.py")

    def send(c: int) -> None:
        a, b = chunks[c]
        task = {"slot": (c // p) % nslots, "pieces": [list(x) for x in stream.pieces(a, b)]}
        proc = procs[c % p]
        proc.stdin.write(json.dumps(task).encode() + b"\n")
        proc.stdin.flush()

    def failed(w: int):
        proc = procs[w]
        try:
            proc.stdin.close()
        except OSError:
            pass
        proc.wait(timeout=10)
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        reason = err[-1] if err else f"exit status {proc.returncode}"
        return PrepareError(f"round-robin worker process failed: {reason}")

    def view(w: int, s: int, total: int):
        mm, length = maps.get((w, s), (None, 0))
        if mm is None or length < total:
            if mm is not None:
                mm.close()
            length = os.fstat(memfds[w][s]).st_size
            mm = mmap.mmap(memfds[w][s], length, mmap.MAP_SHARED, mmap.PROT_READ)
            maps[(w, s)] = (mm, length)
        return memoryview(mm)

    try:
        for w in range(p):
            proc = subprocess.Popen([sys.executable, "-I", worker_py], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=memfds[w])
            procs.append(proc)
            proc.stdin.write(json.dumps({"n": n, "slots": memfds[w]}).encode() + b"\n")
        for c in range(min(len(chunks), p * nslots)):
            send(c)
        fds = [_create(x) for x in paths]
        hashes = [hashlib.sha256() for _ in range(n)]
        nbytes = [0] * n
        lines = [0] * n
        g = 0
        for c in range(len(chunks)):
            w, s = c % p, (c // p) % nslots
            reply = procs[w].stdout.readline()
            if not reply:
                raise failed(w)
            res = json.loads(reply)
            sizes, counts = res["sizes"], res["lines"]
            total = sum(sizes)
            mv = view(w, s, total)
            try:
                off = 0
                for j in range(n):
                    k = (g + j) % n
                    sz = sizes[j]
                    if sz:
                        piece = mv[off:off + sz]
                        _write_all(fds[k], piece)
                        hashes[k].update(piece)
                        piece.release()
                        nbytes[k] += sz
                        off += sz
                    lines[k] += counts[j]
            finally:
                mv.release()
            g += sum(counts)
            if progress is not None:
                progress.update(total)
            if c + p * nslots < len(chunks):
                send(c + p * nslots)
        return _finish_shards(fds, names, kind, hashes, nbytes, lines)
    finally:
        for proc in procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for f in (proc.stdout, proc.stderr):
                f.close()
        for mm, _ in maps.values():
            mm.close()
        for row in memfds:
            for fd in row:
                os.close(fd)
        for fd in fds:
            os.close(fd)


def _finish_shards(fds, names, kind, hashes, nbytes, lines) -> list[ShardResult]:
    """fsync every shard and describe it (the caller closes the fds)."""
    results = []
    for k, fd in enumerate(fds):
        os.fsync(fd)
        results.append(ShardResult(names[k], kind, k, hashes[k].hexdigest(), nbytes[k], lines[k]))
    return results


def _split_rr_serial(stream: Stream, n: int, paths: list[str], names: list[str], kind: str,
                     progress=None) -> list[ShardResult]:
    """Round-robin in this process: this thread deals lines, a writer
    thread writes and hashes.  What each shard got from RR_BATCH bytes of
    input goes to the writer as one bytes object, so the two threads hand
    the GIL over a few times per batch, not per line block."""
    fds = [_create(p) for p in paths]
    hashes = [hashlib.sha256() for _ in range(n)]
    nbytes = [0] * n
    lines = [0] * n
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
                        _write_all(fds[k], data)
                        hashes[k].update(data)
                        nbytes[k] += len(data)
                        if progress is not None:
                            progress.update(len(data))
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)

    def hand_over():
        pieces, counts = dealer.take()
        for k in range(n):
            lines[k] += counts[k]
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
        return _finish_shards(fds, names, kind, hashes, nbytes, lines)
    finally:
        for fd in fds:
            os.close(fd)


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
