"""Leases on this machine's GPUs: an flock on one file per GPU in a machine-wide directory.

A lease lives exactly as long as an open descriptor on its file: the kernel drops the lock when the last
process holding that descriptor exits (crash, SIGKILL, reboot), so a dead job's GPUs are free again with no
cleanup, and two takers in the same instant never both win (flock is atomic). The directory is sticky and
world-writable like /tmp, and each file is opened read-only: another user can neither remove a file nor
release a lock held through someone else's descriptor; taking a free GPU is what every user may do.
The one exception is the directory's owner (and a tmp cleaner), who may unlink files in it: on a shared
server an administrator makes it root-owned first (`install -d -m 1777 -o root /tmp/fabtrain-gpu-leases`).

Three ways a flock could protect nothing, each closed here:
- a held lease file unlinked: the next taker would make a new file and lock it. After locking, a taker
  checks that its file is still the one in the directory, and that no process holds a lease on an earlier,
  unlinked file of the same GPU (/proc/locks names the locked inodes; a process's descriptor on it reads
  ``.../gpuN.lease (deleted)``): such a GPU stays leased by that process;
- a directory where flocks are not shared by every job of the machine: a network or FUSE file system
  (NFS, CIFS, Lustre, ...: locks are per client, or not at all), or a private /tmp (systemd's PrivateTmp,
  Slurm's job_container/tmpfs, pam_namespace: each job sees its own copy). `lease_dir` refuses both in
  one line naming the directory and what it is on;
- CUDA's device order: CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, while a lease
  (and NVML, nvidia-smi, Slurm's GRES) is keyed by the PCI order. The plan sets PCI_BUS_ID for every
  process that is given GPUs, so the index a rank is leased is the GPU it runs on.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat

from fabtrain.node import procfs

LEASE_DIR_ENV = "FABTRAIN_GPU_LEASE_DIR"
DEFAULT_LEASE_DIR = "/tmp/fabtrain-gpu-leases"
# In the agent's environment: the descriptors holding its job's leases on this node, which it hands on to
# its keeper (so a restarted agent holds them too) and to each restart's next generation.
FDS_ENV = "FABTRAIN_GPU_LEASE_FDS"


# File systems whose flocks are not one machine's: locks there are per client, emulated, or not kept.
SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "gpfs", "afs",
             "beegfs", "orangefs", "pvfs2", "ocfs2", "gfs2")
# Mount points where a mount of a sub-folder means a private copy of the machine's temporary folder.
TMP_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm")


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, mountinfo: str) -> dict:
    """The mount that holds `path` (a real path): {"point", "root", "fstype", "source"} from /proc/self/mountinfo."""
    best = None
    for line in mountinfo.splitlines():
        cells = line.split()
        if " - " not in line or len(cells) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        point = _unescape(cells[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best["point"])):  # the last of equal points is on top
            best = {"point": point, "root": _unescape(cells[3]), "fstype": after[0] if after else "?",
                    "source": _unescape(after[1]) if len(after) > 1 else "?"}
    return best or {"point": "/", "root": "/", "fstype": "?", "source": "?"}


def unshared_reason(path: str, mountinfo: str):
    """Why a lease directory at `path` would not be seen by every job of this machine, or None."""
    m = mount_of(path, mountinfo)
    fstype = m["fstype"]
    if fstype in SHARED_FS or fstype.startswith("fuse.") or fstype == "fuse":
        return "it is on %s (%s, mounted at %s), where a lock is not one machine's" % (fstype, m["source"], m["point"])
    if m["root"] != "/" and m["point"] in TMP_MOUNTS:
        return ("%s here is a private copy (%s of %s), as systemd's PrivateTmp or Slurm's job_container/tmpfs "
                "make: a job outside it never sees these leases" % (m["point"], m["root"], m["source"]))
    return None


def _checked_shared(path: str) -> None:
    try:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    except OSError:
        return  # not Linux's /proc: nothing to tell
    where = path if os.path.exists(path) else os.path.dirname(os.path.abspath(path))  # not made yet: its folder's
    why = unshared_reason(os.path.realpath(where), mountinfo)
    if why:
        raise OSError(errno.EXDEV, "GPU lease directory %s cannot keep two jobs off one GPU: %s; set %s to a "
                                   "directory on a local file system that every job of this machine sees"
                      % (path, why, LEASE_DIR_ENV))


def lease_dir(environ=None) -> str:
    """The machine-wide directory, made sticky and world-writable by whoever makes it first; OSError where
    it is not one every job of the machine shares (see the module's docstring)."""
    path = (os.environ if environ is None else environ).get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR
    _checked_shared(path)
    if not os.path.lexists(path):
        # Made whole under another name, then renamed into place: a taker at the same instant never sees it
        # without its sticky bit (mkdir then chmod, for the umask would drop the bits).
        tmp = "%s.%d.new" % (path, os.getpid())
        os.mkdir(tmp, 0o700)
        try:
            os.chmod(tmp, 0o1777)
            os.rename(tmp, path)
        except OSError as e:
            os.rmdir(tmp)
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
                raise
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
        fd = _locked(directory, index)
        if fd is not None:
            held[index] = fd
    if len(held) < count:
        release(held)
        return None
    return held


def _locked(directory: str, index: int):
    """A descriptor holding GPU `index`'s lease, or None where someone else holds it."""
    for _ in range(3):
        fd = _lock_file(directory, index)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        mine = os.fstat(fd)
        try:
            now = os.lstat(os.path.join(directory, "gpu%d.lease" % index))
            same = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
        except FileNotFoundError:
            same = False
        if not same:  # unlinked or replaced between our open and our lock: lock the file that is there now
            os.close(fd)
            continue
        if unlinked_holders(directory, mine.st_dev).get(index):
            os.close(fd)  # an earlier file of this GPU, unlinked while held, still holds it
            return None
        return fd
    return None


def _lease_index(name: str):
    """N of a lease file's name ``gpuN.lease``, or None."""
    if name.startswith("gpu") and name.endswith(".lease") and name[3:-6].isdigit():
        return int(name[3:-6])
    return None


def _flocked_inodes(dev: int) -> dict:
    """{inode: pid that took it} of every exclusive flock on device `dev`, from /proc/locks."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    major, minor = os.major(dev), os.minor(dev)
    out = {}
    for line in lines:
        cells = line.split()
        if len(cells) >= 6 and cells[1] == "FLOCK" and cells[3] == "WRITE" and cells[4].isdigit():
            parts = cells[5].split(":")
            if len(parts) == 3 and all(p.isalnum() for p in parts):
                try:
                    if (int(parts[0], 16), int(parts[1], 16)) == (major, minor):
                        out[int(parts[2])] = int(cells[4])
                except ValueError:
                    pass
    return out


def unlinked_holders(directory: str, dev=None) -> dict:
    """{GPU index: pid} of leases held on files unlinked from `directory` (a held file someone removed).

    Cheap where nothing was removed: only an exclusive flock on the directory's device whose inode is not
    a file in it sends us through the processes' descriptors, which name the removed file
    (``<directory>/gpuN.lease (deleted)``). A process of another user cannot be read by a non-root taker."""
    try:
        dev = os.stat(directory).st_dev if dev is None else dev
        present = {os.lstat(os.path.join(directory, n)).st_ino for n in os.listdir(directory) if _lease_index(n) is not None}
    except OSError:
        return {}
    orphans = {ino: pid for ino, pid in _flocked_inodes(dev).items() if ino not in present}
    if not orphans:
        return {}
    prefix = os.path.realpath(directory) + "/"
    found = {}
    for pid in sorted((n for n in os.listdir("/proc") if n.isdigit()), key=int):
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if not (target.startswith(prefix) and target.endswith(" (deleted)")):
                    continue
                index = _lease_index(target[len(prefix):-len(" (deleted)")])
                st = os.stat("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            if index is not None and st.st_dev == dev and st.st_ino in orphans:
                found.setdefault(index, int(pid))
    return found


def release(held) -> None:
    for fd in held.values():
        os.close(fd)


def leased(index: int, environ=None) -> bool:
    """Whether some live process holds GPU `index`'s lease."""
    directory = lease_dir(environ)
    fd = _lock_file(directory, index)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return index in unlinked_holders(directory)
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
    for index, pid in unlinked_holders(path).items():
        held.setdefault(index, pid)
    return held


def _has_open(pid: str, path: str) -> bool:
    try:
        fds = os.listdir("/proc/%s/fd" % pid)
    except OSError:
        return False  # another user's process, or gone
    for fd in fds:
        try:
            if os.readlink("/proc/%s/fd/%s" % (pid, fd)) in (path, path + " (deleted)"):
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
