"""Leases on this machine's GPUs: an flock on one file per GPU in a machine-wide directory.

A lease lives exactly as long as an open descriptor on its file: the kernel drops the lock when the last
process holding that descriptor exits (crash, SIGKILL, reboot), so a dead job's GPUs are free again with no
cleanup, and two takers in the same instant never both win (flock is atomic). The directory is sticky and
world-writable like /tmp, and each file is opened read-only: another user can neither remove a file nor
release a lock held through someone else's descriptor; taking a free GPU is what every user may do.
The one exception is the directory's owner, who may unlink files in it: on a shared server an administrator
makes it root-owned first (`install -d -m 1777 -o root /tmp/fabtrain-gpu-leases`).
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat

from fabtrain.node import procfs

LEASE_DIR_ENV = "FABTRAIN_GPU_LEASE_DIR"
DEFAULT_LEASE_DIR = "/tmp/fabtrain-gpu-leases"
# In the agent's environment: the descriptors holding its job's leases on this node, which it hands on to
# its keeper (so a restarted agent holds them too) and to each restart's next generation.
FDS_ENV = "FABTRAIN_GPU_LEASE_FDS"


def lease_dir(environ=None) -> str:
    """The machine-wide directory, made sticky and world-writable by whoever makes it first."""
    path = (os.environ if environ is None else environ).get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o1777)  # after mkdir: the umask would drop the bits
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_ISVTX:
        raise OSError(errno.EPERM, "GPU lease directory %s is not a sticky shared directory" % path)
    return path


def _lock_file(directory: str, index: int) -> int:
    """The GPU's lease file, opened read-only; made (0444) by whoever needs it first.

    O_CREAT only where it is missing: with fs.protected_regular (systemd's default), opening with O_CREAT
    another user's existing file in a sticky world-writable directory is refused, even read-only."""
    path = os.path.join(directory, "gpu%d.lease" % index)
    for _ in range(3):
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            pass
        try:
            return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
        except FileExistsError:
            continue  # made by another taker at this instant: open theirs
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)


def take(candidates, count: int, environ=None):
    """Descriptors holding leases on the first `count` free GPUs of `candidates`, as {index: fd}; None if too few.

    Keep the descriptors open (and inheritable into the process that lives as long as the job) to hold them.
    """
    directory = lease_dir(environ)
    held = {}
    for index in candidates:
        if len(held) == count:
            break
        fd = _lock_file(directory, index)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        held[index] = fd
    if len(held) < count:
        release(held)
        return None
    return held


def release(held) -> None:
    for fd in held.values():
        os.close(fd)


def leased(index: int, environ=None) -> bool:
    """Whether some live process holds GPU `index`'s lease."""
    fd = _lock_file(lease_dir(environ), index)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def inherited(environ=None) -> tuple:
    """The lease descriptors this process was given (FDS_ENV), those still open."""
    text = (os.environ if environ is None else environ).get(FDS_ENV, "")
    fds = []
    for part in text.split(","):
        if part.isdigit():
            try:
                os.fstat(int(part))
                fds.append(int(part))
            except OSError:
                pass
    return tuple(fds)


def holders(environ=None) -> dict:
    """{GPU index: pid} of the leases held now, read from /proc/locks; {} where no lease was ever taken."""
    path = (os.environ if environ is None else environ).get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR
    try:
        names = [n for n in os.listdir(path) if n.startswith("gpu") and n.endswith(".lease")]
        inodes = {os.stat(os.path.join(path, n)).st_ino: int(n[3:-6]) for n in names if n[3:-6].isdigit()}
        with open("/proc/locks") as f:
            locks = f.read().splitlines()
    except OSError:
        return {}
    held = {}
    for line in locks:
        cells = line.split()
        if len(cells) >= 6 and cells[1] == "FLOCK" and cells[3] == "WRITE" and cells[4].isdigit():
            inode = cells[5].rsplit(":", 1)[-1]
            if inode.isdigit() and int(inode) in inodes:
                held[inodes[int(inode)]] = int(cells[4])
    return held


def _has_open(pid: str, path: str) -> bool:
    try:
        fds = os.listdir("/proc/%s/fd" % pid)
    except OSError:
        return False  # another user's process, or gone
    for fd in fds:
        try:
            if os.readlink("/proc/%s/fd/%s" % (pid, fd)) == path:
                return True
        except OSError:
            pass
    return False


def holder_job(index: int, lock_pid: int, environ=None) -> dict:
    """Who holds GPU `index`'s lease: {"pid", "job"}: a live process of a fabtrain job with the lease file
    open and its FABTRAIN_JOB_ID, where this user may read them; else the pid that took the lock (it may
    have exited: the descriptors live on in the job's processes) and no job."""
    path = os.path.realpath(os.path.join(
        (os.environ if environ is None else environ).get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR, "gpu%d.lease" % index))
    for name in sorted((n for n in os.listdir("/proc") if n.isdigit()), key=int):
        if _has_open(name, path):
            job = procfs.environ(int(name)).get(b"FABTRAIN_JOB_ID")
            if job:
                return {"pid": int(name), "job": job.decode("utf-8", "replace")}
    return {"pid": lock_pid, "job": None}
