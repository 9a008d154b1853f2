"""Extracting a tarball input: never outside the target, never without bound.

* Member names that are absolute or contain ``..`` are refused; links and
  special files are skipped (never created), so no later member can be
  written through one.
* A member whose path runs through a name the archive made a file (``a``,
  then ``a/b``) is refused by name, as is a name that is both a file and a
  directory.
* The archive may not expand past a budget: ``max_bytes`` in all, and
  ``max_expansion`` times its own (compressed) size. Each member is checked
  against the budget *before* it is written, from its header, so a 1 MB
  tarball of a 1 GiB file stops at once with nothing of that file on disk.
  Each member also costs its 512-byte header, so a million empty files count
  too. Whatever was extracted before the refusal is in the caller's
  temporary directory, which prepare() removes.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import PrepareError

DEFAULT_MAX_EXTRACT_MB = 20 * 1024  # 20 GiB: a large corpus; raise it for a larger one
DEFAULT_MAX_EXPANSION = 100  # text compresses 3-10x with gzip/xz; a bomb, 1000x and more
FREE_EXTRACT_BYTES = 1 << 20  # below this, no ratio check: a tiny archive has a large ratio of headers
MEMBER_OVERHEAD = 512  # one tar header


@dataclass(frozen=True)
class ExtractLimits:
    max_bytes: int = DEFAULT_MAX_EXTRACT_MB << 20
    max_expansion: float = DEFAULT_MAX_EXPANSION

    @classmethod
    def from_mb(cls, max_extract_mb: int | None = None, max_expansion: float | None = None) -> "ExtractLimits":
        return cls(max_bytes=(max_extract_mb if max_extract_mb is not None else DEFAULT_MAX_EXTRACT_MB) << 20,
                   max_expansion=max_expansion if max_expansion is not None else DEFAULT_MAX_EXPANSION)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


class _Budget:
    """Bytes this archive may still put on disk; refuses a member before it is written."""

    def __init__(self, limits: ExtractLimits, archive_bytes: int, where: str):
        self.limits, self.archive_bytes, self.where = limits, archive_bytes, where
        self.by_ratio = max(int(limits.max_expansion * archive_bytes), FREE_EXTRACT_BYTES)
        self.used = 0

    def take(self, name: str, size: int) -> None:
        after = self.used + MEMBER_OVERHEAD + size
        if after > self.limits.max_bytes:
            raise PrepareError(
                f"{self.where}: member {name!r} ({_mib(size)}) would take the extracted size past "
                f"the {_mib(self.limits.max_bytes)} limit; raise job.data.max_extract_mb "
                f"(prepare.py --max-extract-mb) if this archive is expected to be that large")
        if after > self.by_ratio:
            raise PrepareError(
                f"{self.where}: member {name!r} ({_mib(size)}) would expand the {_mib(self.archive_bytes)} "
                f"archive more than {self.limits.max_expansion:g} times (a decompression bomb?); raise "
                f"job.data.max_expansion (prepare.py --max-expansion) if this archive is expected")
        self.used = after


def _safe_parts(name: str) -> list[str] | None:
    """Path components of a member name, or None if it would escape."""
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return None
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        return None
    return parts


def _os_reason(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()


def _check_parents(dest: str, parts: list[str], name: str, where: str) -> None:
    """Every directory on the way to a member is a directory (never a file we made)."""
    path = dest
    for i, part in enumerate(parts[:-1]):
        path = os.path.join(path, part)
        if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
            raise PrepareError(f"{where}: archive member {name!r} is inside "
                               f"{'/'.join(parts[:i + 1])!r}, which the archive made a file")


def safe_extract(archive: str, dest: str, flag: str, shown: str,
                 limits: ExtractLimits | None = None) -> dict:
    """Extract the regular files and directories of a tar archive under dest.

    Returns counts for the manifest; every refusal is one PrepareError line."""
    import tarfile
    import zlib
    limits = limits or ExtractLimits()
    where = f"{flag} {shown}"
    dest_real = os.path.realpath(dest)
    budget = _Budget(limits, os.path.getsize(archive), where)
    files = skipped = 0
    member = None
    try:
        with tarfile.open(archive, "r:*") as tf:
            for member in tf:
                parts = _safe_parts(member.name)
                if parts is None:
                    raise PrepareError(f"{where}: unsafe path in archive: {member.name!r}")
                if not parts:
                    continue
                if not (member.isdir() or member.isreg()):
                    budget.take(member.name, 0)
                    skipped += 1
                    continue
                budget.take(member.name, member.size if member.isreg() else 0)
                _check_parents(dest_real, parts, member.name, where)
                target = os.path.join(dest_real, *parts)
                if member.isdir():
                    if os.path.lexists(target) and not os.path.isdir(target):
                        raise PrepareError(f"{where}: archive member {member.name!r} is both a file and a directory")
                    os.makedirs(target, exist_ok=True)
                    continue
                if _extract_file(tf, member, target, dest_real, where):
                    files += 1
                else:
                    skipped += 1
    except PrepareError:
        raise
    except (tarfile.TarError, EOFError, ValueError, zlib.error) as exc:
        raise PrepareError(f"{where}: not a valid tar archive ({exc})") from None
    except OSError as exc:
        if exc.filename is None and exc.errno is None:
            raise PrepareError(f"{where}: not a valid tar archive ({exc})") from None
        at = f" at member {member.name!r}" if member is not None else ""
        raise PrepareError(f"{where}: cannot extract{at}: {_os_reason(exc)}") from None
    if files == 0:
        raise PrepareError(f"{where}: archive holds no files")
    return {"extracted_files": files, "skipped_members": skipped}


def _extract_file(tf, member, target: str, dest_real: str, where: str) -> bool:
    """Write one regular member; False when tarfile has no data for it."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    real_parent = os.path.realpath(parent)
    if real_parent != dest_real and not real_parent.startswith(dest_real + os.sep):
        raise PrepareError(f"{where}: unsafe path in archive: {member.name!r}")
    if os.path.lexists(target):
        if os.path.isdir(target) and not os.path.islink(target):
            raise PrepareError(f"{where}: archive member {member.name!r} is both a file and a directory")
        os.unlink(target)  # a later member of the same name wins, as in tar
    src = tf.extractfile(member)
    if src is None:
        return False
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with src, os.fdopen(fd, "wb") as out:
        while True:
            block = src.read(1 << 20)
            if not block:
                break
            out.write(block)
    return True
