"""Hostile tarballs through the real command lines (prepare.py and `fab split-data`).

Each ends in one line naming the archive and the member, exit status 2, no
traceback, and nothing left behind: no output directory, no temporary one.
"""
import io
import os
import resource
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from tests.support import REPO
PREPARE = str(REPO / "prepare.py")
FAB = str(Path(sys.executable).parent / "fab")
LINES = b"".join(b"the cat sat on mat %d\n" % i for i in range(200))

pytestmark = pytest.mark.timeout(120)


def make_tar(path, members, mode="w:gz"):
    """members: (name, bytes | None for a directory | int n for n zero bytes)."""
    with tarfile.open(path, mode) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif isinstance(data, int):
                info.size = data
                with open("/dev/zero", "rb") as zeros:
                    tf.addfile(info, zeros)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def prepare(cwd, *args, fsize_limit=None):
    def limit():
        if fsize_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    return subprocess.run([sys.executable, PREPARE, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=60, preexec_fn=limit)


def split_data(root, data):
    """`fab split-data` with a one-node local cluster whose job.data is `data`."""
    cluster = root / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({
        "cluster": {"name": "arch", "workspace": str(root / "ws")},
        "nodes": [{"name": "n0", "host": "local", "roles": ["pserver", "trainer"]}],
        "job": {"data": {"dir": "out", **data}}}))
    return subprocess.run([FAB, "split-data"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FABTRAIN_CLUSTER": str(cluster)})


def one_line(r, prefix, *words):
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def left_behind(root):
    return sorted(p.name for p in Path(root).iterdir() if ".prepare-" in p.name or p.name in ("o", "out"))


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    """About 1 MB of gzip that holds 1 GiB of zeros, after a small honest member."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.tgz"
    with tarfile.open(path, "w:gz", compresslevel=9) as tf:
        info = tarfile.TarInfo("small.txt")
        info.size = len(LINES)
        tf.addfile(info, io.BytesIO(LINES))
        info = tarfile.TarInfo("big.txt")
        info.size = 1 << 30
        with open("/dev/zero", "rb") as zeros:
            tf.addfile(info, zeros)
    assert path.stat().st_size < 2 << 20
    return path


@pytest.mark.parametrize("members,words", [
    ([("a", LINES), ("a/b", LINES)], ["member 'a/b' is inside 'a', which the archive made a file"]),
    ([("a", LINES), ("a/x/y/b", LINES)], ["member 'a/x/y/b' is inside 'a', which the archive made a file"]),
    ([("a/b", LINES), ("a", LINES)], ["member 'a' is both a file and a directory"]),
    ([("a", LINES), ("a", None)], ["member 'a' is both a file and a directory"]),
], ids=["file-then-child", "file-then-grandchild", "child-then-file", "file-then-dir"])
def test_a_name_that_is_a_file_and_a_directory_is_one_line(tmp_path, members, words):
    make_tar(tmp_path / "in.tgz", members)
    one_line(prepare(tmp_path, "--input", "in.tgz", "--out", "o", "--split-count", "1"),
             "prepare.py: --input in.tgz: ", *words)
    assert left_behind(tmp_path) == []
    one_line(split_data(tmp_path, {"input": "in.tgz"}), f"fab split-data: --input {tmp_path / 'in.tgz'}: ", *words)
    assert left_behind(tmp_path) == []


def test_a_decompression_bomb_is_refused_before_its_member_is_written(tmp_path, bomb):
    start = time.monotonic()
    # No file over 16 MiB may be written: had big.txt been extracted, the run would die of SIGXFSZ.
    r = prepare(tmp_path, "--input", bomb, "--out", "o", "--split-count", "1", fsize_limit=16 << 20)
    line = one_line(r, f"prepare.py: --input {bomb}: ", "member 'big.txt' (1,024.0 MiB)",
                    "more than 100 times", "--max-expansion")
    assert time.monotonic() - start < 20, line
    assert left_behind(tmp_path) == [] and left_behind(bomb.parent) == []  # small.txt went with its temp dir


def test_the_total_size_limit_and_its_flag(tmp_path):
    noise = os.urandom(3 << 20)  # does not compress: only the total can stop it
    make_tar(tmp_path / "big.tgz", [("d/noise.txt", noise), ("d/lines.txt", LINES)])
    one_line(prepare(tmp_path, "--input", "big.tgz", "--out", "o", "--split-count", "1", "--no-dict",
                     "--max-extract-mb", "2"),
             "prepare.py: --input big.tgz: ", "member 'd/noise.txt' (3.0 MiB)", "past the 2.0 MiB limit",
             "job.data.max_extract_mb")
    assert left_behind(tmp_path) == []
    r = prepare(tmp_path, "--input", "big.tgz", "--out", "o", "--split-count", "1", "--no-dict", "--max-extract-mb", "4")
    assert r.returncode == 0, r.stderr
    one_line(prepare(tmp_path, "--input", "big.tgz", "--out", "o2", "--split-count", "1", "--max-extract-mb", "0"),
             "prepare.py: --max-extract-mb 0: must be at least 1")


def test_the_cluster_files_data_section_sets_both_limits(tmp_path):
    # 8 MiB of empty lines in a few KB: 1000x, refused by default, accepted when the ratio is raised.
    make_tar(tmp_path / "lines.tgz", [("lines.txt", b"x\n" * (4 << 20))])
    assert (tmp_path / "lines.tgz").stat().st_size < 64 << 10
    one_line(split_data(tmp_path, {"input": "lines.tgz"}), "fab split-data: --input ",
             "member 'lines.txt' (8.0 MiB)", "more than 100 times", "job.data.max_expansion")
    assert left_behind(tmp_path) == []
    one_line(split_data(tmp_path, {"input": "lines.tgz", "max_expansion": 100000, "max_extract_mb": 4}),
             "fab split-data: --input ", "past the 4.0 MiB limit")
    assert left_behind(tmp_path) == []
    r = split_data(tmp_path, {"input": "lines.tgz", "max_expansion": 100000})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "MANIFEST.json").is_file()
