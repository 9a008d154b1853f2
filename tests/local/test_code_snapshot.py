"""A job's snapshot of the deployed code (fabtrain.node.workspace.snapshot_code) is the tree
shutil.copytree(symlinks=True) would make, with every file hard-linked: the same folders and
their permission bits, the same symbolic links, the same file contents, no file copied."""
import os
import shutil
import stat

import pytest

from fabtrain.node import workspace


def tree(root):
    """{relative path: what it is} of everything under root, links not followed."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("folder", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), open(path, "rb").read())
    return out


@pytest.fixture
def deployed(tmp_path):
    ws = tmp_path / "ws"
    code = ws / "code"
    (code / "pkg" / "sub").mkdir(parents=True)
    (code / workspace.CODE_IDENTITY).write_text('{"hash": "abc"}')
    (code / "train.py").write_text("print('hi')\n")
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "sub" / "data.txt").write_text("x" * 1000)
    os.chmod(code / "train.py", 0o750)
    (code / "latest").symlink_to("train.py")  # a link to a file
    (code / "shared").symlink_to("pkg/sub")  # a link to a folder: made again, not entered
    (code / "dangling").symlink_to("/nowhere/at/all")
    os.chmod(code / "pkg" / "sub", 0o555)  # read-only: filled before its bits are set
    yield ws
    os.chmod(code / "pkg" / "sub", 0o755)


def test_a_snapshot_is_the_tree_copytree_makes_with_every_file_linked(deployed, tmp_path):
    jd = deployed / "jobs" / "20261127-000000-abcd"
    jd.mkdir(parents=True)
    old_umask = os.umask(0o077)  # as node ops' start sets it
    try:
        identity = workspace.snapshot_code(str(deployed), str(jd))
    finally:
        os.umask(old_umask)
    assert identity == {"hash": "abc"}
    reference = tmp_path / "reference"
    shutil.copytree(deployed / "code", reference, symlinks=True)
    made = tree(jd / "code")
    assert made == tree(reference)
    assert made["pkg/sub"] == ("folder", 0o555) and made["shared"] == ("link", "pkg/sub")
    for rel, what in made.items():
        if what[0] == "file":
            assert os.stat(jd / "code" / rel).st_ino == os.stat(deployed / "code" / rel).st_ino, rel
    assert not [p for p in os.listdir(jd) if ".tmp." in p]  # renamed into place, nothing left aside
    os.chmod(jd / "code" / "pkg" / "sub", 0o755)


def test_a_job_that_has_its_snapshot_keeps_it(deployed):
    jd = deployed / "jobs" / "20261127-000000-abcd"
    jd.mkdir(parents=True)
    workspace.snapshot_code(str(deployed), str(jd))
    (deployed / "code" / "new.py").write_text("")  # a later deploy
    workspace.snapshot_code(str(deployed), str(jd))  # the job's second start: its code as it was
    assert not (jd / "code" / "new.py").exists()
    os.chmod(jd / "code" / "pkg" / "sub", 0o755)
