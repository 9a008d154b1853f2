"""Where the data comes from: a text file, a directory, a tarball or a URL.

* A regular file is one input.
* A directory is every regular file under it (recursively, hidden names
  skipped), sorted by relative path (byte order).
* A tarball (``.tgz .tar.gz .tar .tar.bz2 .tbz2 .tar.xz .txz``), local or
  downloaded, is extracted safely into a temporary directory (archive.py:
  nothing outside the target, nothing past the size limits).  If it holds the
  imikolov layout (``simple-examples/data/ptb.train.txt``) the train file is
  ``ptb.train.txt`` and the test file its sibling ``ptb.test.txt``;
  otherwise all its regular files are a directory input.
* A URL (``http https ftp file``) is downloaded with urllib to a temporary
  file first; if it is a tar archive it is extracted as above, else it is
  a text file.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat

from .archive import ExtractLimits, safe_extract
from .errors import PrepareError
from .progress import Progress

URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
URL_SCHEMES = ("http", "https", "ftp", "file")
TAR_SUFFIXES = (".tgz", ".tar.gz", ".tar", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz")
IMIKOLOV_TRAIN = "ptb.train.txt"
IMIKOLOV_TEST = "ptb.test.txt"
DOWNLOAD_TIMEOUT = 60.0


def is_url(text: str) -> bool:
    return bool(URL_RE.match(text))


def is_tar_name(path: str) -> bool:
    low = path.lower()
    return any(low.endswith(s) for s in TAR_SUFFIXES)


class InputSet:
    """An ordered list of files that together make one input."""

    __slots__ = ("files", "sizes", "description", "is_dir")

    def __init__(self, files: list[str], sizes: list[int], description: str, is_dir: bool = False):
        self.files = files
        self.sizes = sizes
        self.description = description
        self.is_dir = is_dir

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def _what(flag: str, shown: str) -> str:
    return f"{flag} {shown}"


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file or directory"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return (exc.strerror or str(exc)).lower()


def list_dir_files(root: str) -> list[str]:
    """Regular files under root, recursively, hidden names skipped, sorted
    by relative path compared as bytes."""
    found: list[tuple[bytes, str]] = []

    def onerror(exc: OSError):
        raise exc

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError:
                continue  # dangling link
            if stat.S_ISREG(st.st_mode):
                rel = os.path.relpath(full, root)
                found.append((os.fsencode(rel), full))
    found.sort()
    return [full for _, full in found]


def local_input(path: str, flag: str) -> InputSet:
    """A local file or directory (not a tarball: see materialize)."""
    shown = path
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PrepareError(f"{_what(flag, shown)}: {_os_reason(exc)}") from None
    apath = os.path.abspath(path)
    if stat.S_ISDIR(st.st_mode):
        try:
            files = list_dir_files(apath)
        except OSError as exc:
            raise PrepareError(f"{_what(flag, shown)}: {_os_reason(exc)}") from None
        if not files:
            raise PrepareError(f"{_what(flag, shown)}: directory holds no files")
        sizes = []
        for f in files:
            try:
                sizes.append(os.stat(f).st_size)
            except OSError as exc:
                raise PrepareError(f"{flag} {f}: {_os_reason(exc)}") from None
        return InputSet(files, sizes, f"{apath} (directory, {len(files)} files)", is_dir=True)
    if not stat.S_ISREG(st.st_mode):
        raise PrepareError(f"{_what(flag, shown)}: not a regular file or directory")
    if not os.access(path, os.R_OK):
        raise PrepareError(f"{_what(flag, shown)}: permission denied")
    return InputSet([apath], [st.st_size], f"{apath}")


def fingerprint_local(path: str, flag: str) -> dict:
    """What identifies a local input without reading it: path, sizes and
    modification times.  Used to tell a rerun from a different request."""
    if is_tar_name(path) and os.path.isfile(path):
        st = os.stat(path)
        return {"path": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                "kind": "tarball"}
    inp = local_input(path, flag)
    if not inp.is_dir:
        st = os.stat(inp.files[0])
        return {"path": inp.files[0], "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                "kind": "file"}
    h = hashlib.sha256()
    root = os.path.abspath(path)
    for f in inp.files:
        st = os.stat(f)
        h.update(os.fsencode(os.path.relpath(f, root)) + b"\0%d\0%d\n" % (st.st_size, st.st_mtime_ns))
    return {"path": root, "kind": "directory", "files": len(inp.files),
            "bytes": inp.total_bytes, "listing_sha256": h.hexdigest()}


def download(url: str, dest_dir: str, flag: str, *, progress_enabled: bool = True,
             timeout: float = DOWNLOAD_TIMEOUT) -> tuple[str, str]:
    """Fetch url into a new file in dest_dir; return (path, sha256)."""
    import urllib.error
    import urllib.request
    scheme = url.split("://", 1)[0].lower()
    if scheme not in URL_SCHEMES:
        raise PrepareError(f"{flag} {url}: unsupported URL scheme {scheme!r} "
                           f"(use one of {', '.join(URL_SCHEMES)})")
    name = os.path.basename(urllib.request.url2pathname(url.split("://", 1)[1].split("?")[0].rstrip("/")))
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "download"
    target = os.path.join(dest_dir, "download-" + name)
    h = hashlib.sha256()
    got = 0
    try:
        req = urllib.request.Request(url, headers={"User-Agent": "fabtrain-prepare/1"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as out, Progress("downloading", total,
                                                      enabled=progress_enabled) as bar:
                while True:
                    block = resp.read(1 << 20)
                    if not block:
                        break
                    out.write(block)
                    h.update(block)
                    got += len(block)
                    bar.update(len(block))
            if total is not None and got != total:
                raise PrepareError(f"{flag} {url}: download failed: got {got} of {total} bytes")
    except PrepareError:
        raise
    except urllib.error.HTTPError as exc:
        raise PrepareError(f"{flag} {url}: download failed: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, OSError):
            reason = _os_reason(reason)
        raise PrepareError(f"{flag} {url}: download failed: {reason}") from None
    except (OSError, ValueError) as exc:  # timeouts, resets, bad URLs
        raise PrepareError(f"{flag} {url}: download failed: {exc}") from None
    if got == 0:
        raise PrepareError(f"{flag} {url}: empty input (the download is 0 bytes)")
    return target, h.hexdigest()


def _looks_like_tar(path: str) -> bool:
    import tarfile
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def inputs_from_tree(root: str, flag: str, shown: str) -> tuple[InputSet, InputSet | None]:
    """Train (and test, if the imikolov layout is found) inputs from an
    extracted archive."""
    files = list_dir_files(root)
    trains = [f for f in files if os.path.basename(f) == IMIKOLOV_TRAIN]
    if trains:
        trains.sort(key=lambda f: (f.count(os.sep), f))
        train = trains[0]
        rel = os.path.relpath(train, root)
        tr = InputSet([train], [os.path.getsize(train)], f"{shown} ({rel})")
        test_path = os.path.join(os.path.dirname(train), IMIKOLOV_TEST)
        te = None
        if os.path.isfile(test_path):
            te = InputSet([test_path], [os.path.getsize(test_path)],
                          f"{shown} ({os.path.relpath(test_path, root)})")
        return tr, te
    if not files:
        raise PrepareError(f"{flag} {shown}: archive holds no files")
    sizes = [os.path.getsize(f) for f in files]
    return InputSet(files, sizes, f"{shown} (archive, {len(files)} files)", is_dir=True), None


def materialize(spec: str, work: str, flag: str, *, progress_enabled: bool = True,
                limits: ExtractLimits | None = None) -> tuple[InputSet, InputSet | None, dict]:
    """Turn --input into local files (downloading/extracting under work).

    Returns (train input, test input found inside an archive or None,
    provenance facts for the manifest)."""
    facts: dict = {}
    if is_url(spec):
        path, digest = download(spec, work, flag, progress_enabled=progress_enabled)
        facts["source_sha256"] = digest
        facts["source_bytes"] = os.path.getsize(path)
        if _looks_like_tar(path):
            dest = os.path.join(work, "extracted")
            os.makedirs(dest)
            facts.update(safe_extract(path, dest, flag, spec, limits))
            train, test = inputs_from_tree(dest, flag, spec)
            os.unlink(path)
            return train, test, facts
        return InputSet([path], [os.path.getsize(path)], spec), None, facts
    if is_tar_name(spec) and os.path.isfile(spec):
        shown = os.path.abspath(spec)
        h = hashlib.sha256()
        with open(spec, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        facts["source_sha256"] = h.hexdigest()
        facts["source_bytes"] = os.path.getsize(spec)
        dest = os.path.join(work, "extracted")
        os.makedirs(dest)
        facts.update(safe_extract(spec, dest, flag, spec, limits))
        train, test = inputs_from_tree(dest, flag, shown)
        return train, test, facts
    return local_input(spec, flag), None, facts
