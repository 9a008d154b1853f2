"""The workspace on a node: where it is, whose it is, and that nobody else can tamper with it.

Node ops call these before they write anything: a workspace another user
could write to (or one another node of any cluster already uses) is refused
in one line, and what fabtrain makes there is this user's only.
"""
import errno
import json
import os
import stat

from fabtrain.contract import jobid
from fabtrain.contract.jobfolder import JOBS, JobFolder
from fabtrain.node import atomic
from fabtrain.contract.replies import UserFacing


def workspace(payload):
    return os.path.abspath(os.path.expanduser(payload["workspace"]))


def check_workspace(ws):
    """Refuse a workspace another user could tamper with (sshd's StrictModes, for fabtrain's records).

    The workspace and every directory above it must belong to this user or
    root, and none may be writable by group or others -- unless it is a
    root-owned sticky directory such as /tmp, where nobody can replace our entries.
    Returns None, or the one-line refusal.
    """
    me = os.getuid()
    path = ws
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid not in (me, 0):
                return ("workspace %s: %s belongs to uid %d, not to this user (uid %d) or root"
                        % (ws, path, st.st_uid, me))
            sticky_root = st.st_uid == 0 and st.st_mode & 0o1000 and path != ws
            if st.st_mode & 0o022 and not sticky_root:
                return "workspace %s: %s is writable by group or others (chmod go-w %s)" % (ws, path, path)
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def make_private_dirs(*paths):
    """Directories only this user can enter (0700), made if missing, tightened if not."""
    for path in paths:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o700)


OWNER_FILE = ".fabtrain-owner.json"


def claim_workspace(ws, cluster, node):
    """Make the workspace this node's, or say whose it is.

    Two nodes must never share one workspace (two nodes on one machine, or
    servers that share /home over NFS): each would see, watch and kill the
    other's processes as its own. The first node to use a workspace claims it
    with a marker made with O_EXCL (atomic, on NFS too); any other node is
    refused. Returns None, or the one-line refusal.
    """
    marker = os.path.join(ws, OWNER_FILE)
    me = {"cluster": cluster, "node": node}
    try:
        os.makedirs(ws, mode=0o700, exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        if not isinstance(e, FileExistsError):
            return "cannot use workspace %s: %s" % (ws, e.strerror or e)
        owner = atomic.read_json(marker, {})
        if {k: owner.get(k) for k in me} == me:
            return None
        return ("workspace %s is already node %r of cluster %r (one machine, or storage shared between "
                "servers): give node %r its own (nodes[].workspace, or leave it out for <cluster.workspace>/%s); "
                "if that node is gone, remove %s" % (ws, owner.get("node"), owner.get("cluster"), node, node, marker))
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    return None


def job_dir(ws, job_id=None):
    """<ws>/jobs/<job_id>, or the current job's (None when there is none). An id that is not a
    job id is refused here, whatever sent it: nothing outside jobs/ is ever read for a job."""
    if job_id is not None:
        return os.path.join(ws, JOBS, jobid.checked(job_id, UserFacing))
    cur = os.path.join(ws, "current")
    return os.path.realpath(cur) if os.path.islink(cur) else None


CODE_IDENTITY = ".fabtrain-code.json"  # written by `fab deploy`: which code this is


def code_refusal(ws, jd):
    """None when the job has its code (its snapshot, or a deployed <ws>/code to make it from);
    else the one line that says to deploy. `fab deploy` always writes CODE_IDENTITY, so code/
    without it (missing, or the empty folder `fab provision` makes) was never deployed."""
    if os.path.isdir(JobFolder(jd).code) or os.path.isfile(os.path.join(ws, "code", CODE_IDENTITY)):
        return None
    return "no code deployed to %s: run `fab deploy` first" % os.path.join(ws, "code")


def snapshot_code(ws, jd):
    """The job's own copy of <ws>/code, made once, at its first start: jobs/<id>/code.

    Hard links, so unchanged files cost nothing; `fab deploy` (rsync) replaces a
    file by renaming a new one over it, never writing into it, so a deploy while
    the job runs leaves the job's code as it was. Returns which code it is.
    """
    src, dst = os.path.join(ws, "code"), JobFolder(jd).code
    if not os.path.isdir(dst):
        tmp = dst + ".tmp.%d" % os.getpid()
        _link_tree(src, tmp)  # deployed: code_refusal
        os.replace(tmp, dst)
    return atomic.read_json(os.path.join(dst, CODE_IDENTITY), {})


def _link_tree(src, dst):
    """dst made as a copy of the tree src: each folder with src's permission bits, each file
    linked (_link_or_copy), each symbolic link made again as it reads. What
    shutil.copytree(symlinks=True) does, without importing shutil: ~3 ms of CPU in every
    job's first start, paid by every node at once."""
    folders = []

    def fail(error):  # os.walk passes over a folder it cannot read; a copy must not
        raise error

    for folder, dirs, files in os.walk(src, onerror=fail):  # a link to a folder is in dirs, not entered
        target = os.path.normpath(os.path.join(dst, os.path.relpath(folder, src)))
        os.mkdir(target, 0o700)
        folders.append((folder, target))
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                os.symlink(os.readlink(os.path.join(folder, name)), os.path.join(target, name))
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                os.symlink(os.readlink(path), os.path.join(target, name))
            else:
                _link_or_copy(path, os.path.join(target, name))
    for folder, target in reversed(folders):  # last: a read-only folder is filled first
        os.chmod(target, stat.S_IMODE(os.stat(folder).st_mode))


def _link_or_copy(src, dst):
    """A hard link where the file system allows one; a copy across file systems (jobs/ mounted
    elsewhere than code/) or where links are refused."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        import shutil

        shutil.copy2(src, dst)
