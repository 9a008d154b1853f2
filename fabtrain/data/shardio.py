"""Writing one shard: created, filled, fsynced, and described.

Every shard is created under a temporary name by the caller, fsynced here,
and described by a ShardResult (sha256, bytes, lines) computed from the
bytes as they are written (copied shards: through a read-only mapping of
what was just copied).  Copied data goes through the kernel
(``os.copy_file_range``, falling back to ``os.sendfile``, then to
pread/write).  Shared by every strategy (contiguous.py, files.py,
roundrobin.py) and by prepare's dictionary file.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os

from .errors import PrepareError
from .stream import InputChanged

READ_BLOCK = 8 << 20      # read-back / hashing block


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


# --------------------------------------------------------------------------
# copying and checking one shard

_copy_mode = ["copy_file_range" if hasattr(os, "copy_file_range") else
              "sendfile" if hasattr(os, "sendfile") else "readwrite"]
_FALLBACK_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                    getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EPERM, errno.ETXTBSY}


def copy_mode() -> str:
    """Which kernel path copies data in this process (for the docs/bench)."""
    return _copy_mode[0]


def write_all(fd: int, data) -> None:
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
                write_all(dst, data)
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


def create_new(path: str) -> int:
    """A new shard file (O_EXCL: never one that is already there), read-write for the mapping."""
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
        write_all(self.fd, data)
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
    fd = create_new(dst_path)
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


def run_shards(jobs, progress) -> list[ShardResult]:
    """jobs: list of (pieces, dst_path, name, kind, shard)."""
    if len(jobs) == 1:
        return [build_shard(*jobs[0], progress=progress)]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=_workers(len(jobs))) as pool:
        futs = [pool.submit(build_shard, *job, progress=progress) for job in jobs]
        return [f.result() for f in futs]


def finish_shards(fds, names, kind, hashes, nbytes, lines) -> list[ShardResult]:
    """fsync every shard written and hashed by its caller (round-robin) and
    describe it (the caller closes the fds)."""
    results = []
    for k, fd in enumerate(fds):
        os.fsync(fd)
        results.append(ShardResult(names[k], kind, k, hashes[k].hexdigest(), nbytes[k], lines[k]))
    return results
