"""prepare.py and fabtrain.data: shards, dictionary, manifest, bad input.

Small inputs only: the whole file runs in a few seconds.
"""

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from fabtrain.data import (PrepareError, files_for_trainer, load_manifest,
                                    load_word_dict, prepare)
from fabtrain.data import _rrworker as rr
from fabtrain.data import roundrobin, shardio
from fabtrain.data.cli import main
from fabtrain.data.dictionary import build_word_dict, count_tokens
from fabtrain.data.progress import Progress

from tests.support import REPO
PREPARE = str(REPO / "prepare.py")


def run(*args, cwd):
    return subprocess.run([sys.executable, PREPARE, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def shards(d, base="train.txt"):
    return sorted(p for p in Path(d).iterdir() if p.name.startswith(base + "-"))


def corpus(lines=200, seed=0):
    """Lines of varying length, some non-UTF-8 bytes, no final newline."""
    out = []
    for i in range(lines):
        word = b"w%d" % ((i * 7919 + seed) % 97)
        out.append(b" ".join([word] * (1 + (i * 31) % 13)))
    out[5] = b"caf\xe9 \xff\xfe raw \x80bytes"      # latin-1 and junk bytes
    out[6] = "über straße".encode()
    out[7] = b""                                         # an empty line
    return b"\n".join(out)                               # no trailing newline


def no_leftovers(parent):
    return [p.name for p in Path(parent).iterdir() if ".prepare-" in p.name]


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("prepare.py: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ---------------------------------------------------------------- contiguous

@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_contiguous_concatenates_back_byte_for_byte(tmp_path, n):
    data = corpus()
    (tmp_path / "in.txt").write_bytes(data)
    r = prepare(str(tmp_path / "out"), n, input=str(tmp_path / "in.txt"), progress=False)
    parts = shards(tmp_path / "out")
    assert [p.name for p in parts] == [f"train.txt-{k:05d}" for k in range(n)]
    assert b"".join(p.read_bytes() for p in parts) == data
    sizes = [p.stat().st_size for p in parts]
    assert all(s > 0 for s in sizes)
    assert max(sizes) - min(sizes) < len(data) // n        # roughly balanced
    for p in parts[:-1]:
        assert p.read_bytes().endswith(b"\n")             # cut at line boundaries
    assert r.manifest["strategy"] == "contiguous"


@pytest.mark.parametrize("step", [3, 4096, 5000])
def test_contiguous_checksums_hold_for_any_copy_step(tmp_path, monkeypatch, step):
    # many copy steps per shard, hashed through mappings that start inside
    # a page; a directory input adds pieces and synthesized newlines
    monkeypatch.setattr(shardio, "COPY_STEP", step)
    monkeypatch.setattr(shardio, "WRITEBACK_STEP", 2 * step)
    src = tmp_path / "src"
    src.mkdir()
    data = corpus(700)
    for i in range(3):
        (src / f"part-{i}").write_bytes(data[i * len(data) // 3:(i + 1) * len(data) // 3])
    r = prepare(str(tmp_path / "out"), 3, input=str(src), progress=False, build_dict=False)
    parts = shards(tmp_path / "out")
    joined = b"".join(p.read_bytes() for p in parts)
    assert joined.replace(b"\n", b"") == data.replace(b"\n", b"")
    for p in parts:
        b = p.read_bytes()
        e = r.manifest["files"][p.name]
        assert (e["sha256"], e["bytes"]) == (hashlib.sha256(b).hexdigest(), len(b))
        assert e["lines"] == b.count(b"\n") + (not b.endswith(b"\n"))


def test_contiguous_gives_every_shard_a_line_even_with_one_huge_line(tmp_path):
    data = b"x" * 100000 + b"\n" + b"a\nb\nc\n"
    (tmp_path / "in.txt").write_bytes(data)
    prepare(str(tmp_path / "out"), 4, input=str(tmp_path / "in.txt"), progress=False,
            build_dict=False)
    parts = [p.read_bytes() for p in shards(tmp_path / "out")]
    assert parts == [b"x" * 100000 + b"\n", b"a\n", b"b\n", b"c\n"]


@pytest.mark.parametrize("mode", ["sendfile", "readwrite"])
def test_copy_fallbacks_give_the_same_bytes(tmp_path, monkeypatch, mode):
    data = corpus(300)
    (tmp_path / "in.txt").write_bytes(data)
    monkeypatch.setattr(shardio, "_copy_mode", [mode])
    prepare(str(tmp_path / "out"), 3, input=str(tmp_path / "in.txt"), progress=False)
    assert b"".join(p.read_bytes() for p in shards(tmp_path / "out")) == data


def test_copy_file_range_failure_falls_back_to_sendfile(tmp_path, monkeypatch):
    def exdev(*a, **k):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(os, "copy_file_range", exdev, raising=False)
    monkeypatch.setattr(shardio, "_copy_mode", ["copy_file_range"])
    data = corpus(50)
    (tmp_path / "in.txt").write_bytes(data)
    prepare(str(tmp_path / "out"), 2, input=str(tmp_path / "in.txt"), progress=False)
    assert shardio.copy_mode() == "sendfile"
    assert b"".join(p.read_bytes() for p in shards(tmp_path / "out")) == data


@pytest.mark.parametrize("wc", ["wc", "none", "/bin/false"])
def test_line_counts_agree_with_and_without_wc(tmp_path, monkeypatch, wc):
    import shutil
    monkeypatch.setattr(shardio, "WC_MIN", 0)                 # every shard through wc -l
    monkeypatch.setattr(shardio, "_wc", [shutil.which("wc") if wc == "wc" else
                                         None if wc == "none" else wc])
    data = corpus(120)
    (tmp_path / "in.txt").write_bytes(data)
    r = prepare(str(tmp_path / "o"), 3, input=str(tmp_path / "in.txt"), progress=False)
    for p in shards(tmp_path / "o"):
        b = p.read_bytes()
        assert r.manifest["files"][p.name]["lines"] == b.count(b"\n") + (not b.endswith(b"\n"))


def test_directory_input_is_its_files_in_order_with_newlines_between(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"b1\nb2")          # no final newline: one is added
    (src / "a.txt").write_bytes(b"a1\na2\n")
    (src / "sub" / "c.txt").write_bytes(b"c1\nc2")  # last file: left as it is
    (src / ".hidden").write_bytes(b"skipped\n")
    prepare(str(tmp_path / "out"), 2, input=str(src), progress=False)
    got = b"".join(p.read_bytes() for p in shards(tmp_path / "out"))
    assert got == b"a1\na2\nb1\nb2\nc1\nc2"


# ---------------------------------------------------------------- round-robin

@pytest.mark.parametrize("n", [1, 3, 4])
def test_round_robin_line_i_goes_to_shard_i_mod_n(tmp_path, monkeypatch, n):
    monkeypatch.setattr(rr, "DEAL_BLOCK", 97)        # many blocks, lines cut across them
    monkeypatch.setattr(roundrobin, "RR_BATCH", 1000)        # many batches for the writer thread
    data = corpus(301)
    (tmp_path / "in.txt").write_bytes(data)
    r = prepare(str(tmp_path / "out"), n, input=str(tmp_path / "in.txt"),
                strategy="round-robin", progress=False)
    lines = data.split(b"\n")
    parts = [p.read_bytes() for p in shards(tmp_path / "out")]
    for k, part in enumerate(parts):
        expect = lines[k::n]
        joined = b"\n".join(expect)
        # the very last input line has no newline; every other line keeps its own
        assert part == (joined if (len(lines) - 1) % n == k else joined + b"\n")
    counts = [e["lines"] for e in r.manifest["files"].values() if e["kind"] == "train"]
    assert max(counts) - min(counts) <= 1 and sum(counts) == len(lines)
    union = Counter(line for part in parts for line in part.split(b"\n")[:part.count(b"\n") + (0 if part.endswith(b"\n") else 1)])
    assert union == Counter(data.split(b"\n"))


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 16])
def test_line_dealer_deals_line_i_to_group_first_plus_i_mod_n(block):
    rng = random.Random(block)
    # short lines, lines longer than a block, empty lines, no final newline
    lines = [bytes(rng.choice(b"ab\xff ") for _ in range(rng.choice([0, 1, 5, 300])))
             for _ in range(200)]
    data = b"\n".join(lines)
    for n, first in ((1, 0), (3, 2), (5, 1)):
        dealer = rr.LineDealer(n, first=first, block=block)
        got = [[] for _ in range(n)]
        counts = [0] * n
        pos = 0
        while pos < len(data):                   # fed in pieces of random sizes
            step = rng.randint(1, 500)
            dealer.feed(data[pos:pos + step])
            pos += step
            pieces, c = dealer.take()
            for k in range(n):
                got[k] += pieces[k]
                counts[k] += c[k]
        dealer.finish()
        pieces, c = dealer.take()
        parts = data.split(b"\n")
        tail = parts.pop()                       # b"" when data ends with a newline
        ends = [p + b"\n" for p in parts] + ([tail] if tail else [])
        for k in range(n):
            expect = ends[(k - first) % n::n]    # line i -> group (first + i) mod n
            assert b"".join(got[k] + pieces[k]) == b"".join(expect)
            assert counts[k] + c[k] == len(expect)


@pytest.mark.parametrize("data", [corpus(400), corpus(400) + b"\n"])
def test_round_robin_worker_processes_give_the_same_shards(tmp_path, monkeypatch, data):
    (tmp_path / "in.txt").write_bytes(data)
    shas = []
    for workers in (0, 2):
        monkeypatch.setattr(roundrobin, "RR_WORKERS", workers)
        monkeypatch.setattr(roundrobin, "RR_CHUNK", 1000)         # many chunks, both slots reused
        r = prepare(str(tmp_path / f"o{workers}"), 3, input=str(tmp_path / "in.txt"),
                    strategy="round-robin", progress=False, build_dict=False)
        shas.append(r.manifest["files"])
        assert b"".join(sorted(p.read_bytes() for p in shards(tmp_path / f"o{workers}"))) != b""
    assert shas[0] == shas[1]


def test_a_failing_round_robin_worker_is_one_clear_error(tmp_path, monkeypatch):
    # a worker that takes its first two tasks (both its slots), then dies
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nfor _ in range(3):\n    sys.stdin.readline()\n"
                      "sys.exit('worker: out of memory')\n")
    monkeypatch.setattr(roundrobin, "WORKER_PY", str(worker))
    monkeypatch.setattr(roundrobin, "RR_WORKERS", 2)
    monkeypatch.setattr(roundrobin, "RR_CHUNK", 1000)
    (tmp_path / "in.txt").write_bytes(corpus(400))
    with pytest.raises(PrepareError, match="^round-robin worker process failed: worker: out of memory$"):
        prepare(str(tmp_path / "o"), 3, input=str(tmp_path / "in.txt"), strategy="round-robin",
                progress=False, build_dict=False)
    assert not (tmp_path / "o").exists()


def test_round_robin_from_the_command_line(tmp_path):
    data = b"".join(b"line %d\n" % i for i in range(10))
    (tmp_path / "in.txt").write_bytes(data)
    r = run("--input", "in.txt", "--out", "o", "--split-count", "3", "--strategy", "round-robin",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o/train.txt-00001").read_bytes() == b"line 1\nline 4\nline 7\n"
    assert "strategy round-robin" in r.stdout


# ---------------------------------------------------------------- files

def test_files_strategy_assigns_file_i_to_shard_i_mod_n(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(7):
        body = b"file %d line %d\n" % (i, 0) + b"file %d line 1" % i   # no final newline
        (src / f"part-{i:03d}").write_bytes(body)
    r = prepare(str(tmp_path / "out"), 3, input=str(src), strategy="files", progress=False)
    for k in range(3):
        files = [(src / f"part-{i:03d}").read_bytes() for i in range(k, 7, 3)]
        assert (tmp_path / f"out/train.txt-{k:05d}").read_bytes() == b"\n".join(files)
    assert r.manifest["strategy"] == "files"
    assert r.manifest["files"]["train.txt-00000"]["lines"] == 6


def test_files_strategy_needs_a_file_per_shard(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"f{i}").write_bytes(b"x\n")
    r = run("--input", src, "--out", "o", "--split-count", "3", "--strategy", "files",
            cwd=tmp_path)
    assert_one_line_error(r, "2 files", "3 shards")
    assert not (tmp_path / "o").exists() and not no_leftovers(tmp_path)


# ---------------------------------------------------------------- manifest

def test_manifest_matches_the_files(tmp_path):
    (tmp_path / "in.txt").write_bytes(corpus())
    (tmp_path / "t.txt").write_bytes(b"t1 a\nt2 b\nt3 c\n")
    r = run("--input", "in.txt", "--test", "t.txt", "--out", "o", "--split-count", "3",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "o/MANIFEST.json").read_text())
    assert m["version"] == 1 and m["split_count"] == 3 and m["strategy"] == "contiguous"
    assert m["synthetic"] is False and m["source"].endswith("in.txt")
    names = set(os.listdir(tmp_path / "o"))
    assert names == set(m["files"]) | {"MANIFEST.json"}
    for name, e in m["files"].items():
        b = (tmp_path / "o" / name).read_bytes()
        assert e["sha256"] == hashlib.sha256(b).hexdigest()
        assert e["bytes"] == len(b)
        assert e["lines"] == len(b.splitlines()) if b"\r" not in b else True
        assert e["lines"] == b.count(b"\n") + (0 if b.endswith(b"\n") else 1)
    kinds = Counter(e["kind"] for e in m["files"].values())
    assert kinds == {"train": 3, "test": 3, "dict": 1}
    assert [m["files"][f"test.txt-{k:05d}"]["shard"] for k in range(3)] == [0, 1, 2]
    assert load_manifest(str(tmp_path / "o")) == m


def test_files_for_trainer(tmp_path):
    (tmp_path / "in.txt").write_bytes(corpus())
    (tmp_path / "t.txt").write_bytes(b"".join(b"t%d\n" % i for i in range(8)))
    prepare(str(tmp_path / "o"), 4, input=str(tmp_path / "in.txt"), test=str(tmp_path / "t.txt"),
            progress=False)
    m = load_manifest(str(tmp_path / "o"))
    assert files_for_trainer(m, 1, 2) == ["train.txt-00001", "train.txt-00003", "test.txt-00001",
                                          "test.txt-00003", "word_dict.json", "MANIFEST.json"]
    assert files_for_trainer(m, 3, 4)[:2] == ["train.txt-00003", "test.txt-00003"]
    every = [f for t in range(4) for f in files_for_trainer(m, t, 4) if "-" in f]
    assert sorted(every) == sorted(f for f in m["files"] if "-" in f)   # each shard exactly once
    with pytest.raises(PrepareError, match="5 trainers"):
        files_for_trainer(m, 0, 5)
    with pytest.raises(PrepareError, match="out of range"):
        files_for_trainer(m, 2, 2)


# ---------------------------------------------------------------- dictionary

def test_dictionary_order_min_freq_and_special_tokens():
    text = b"b a a\nc a b\n<unk> z\n"
    counts, lines = count_tokens([text[:5], text[5:]])          # a block boundary mid-line
    assert lines == 3 and counts[b"a"] == 3
    d = build_word_dict(counts, lines, min_freq=2)
    # <s>,<e>: 3 each (one per line); a: 3; b: 2; <unk>: 1 literal + c + z dropped = 3
    assert list(d) == ["<e>", "<s>", "<unk>", "a", "b"]
    assert list(d.values()) == [0, 1, 2, 3, 4]
    d1 = build_word_dict(counts, lines, min_freq=1)
    assert list(d1) == ["<e>", "<s>", "a", "b", "<unk>", "c", "z"]
    assert build_word_dict(Counter(), 0, 1).keys() == {"<unk>", "<s>", "<e>"}


def test_word_dict_json_round_trips_non_utf8_tokens(tmp_path):
    (tmp_path / "in.txt").write_bytes(b"caf\xe9 x\n\xff x\n\xe4\xbd\xa0 x\n")
    r = run("--input", "in.txt", "--out", "o", "--split-count", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    raw = (tmp_path / "o/word_dict.json").read_bytes()
    raw.decode("utf-8")                                   # valid UTF-8 JSON
    assert "你".encode() in raw and b"\\udce9" in raw and b"\\udcff" in raw
    d = load_word_dict(str(tmp_path / "o/word_dict.json"), as_bytes=True)
    assert {b"caf\xe9", b"\xff", "你".encode(), b"x", b"<s>", b"<e>", b"<unk>"} == set(d)
    assert d[b"x"] == 0 or d[b"<e>"] == 0
    assert sorted(d.values()) == list(range(len(d)))


def test_min_freq_and_no_dict_flags(tmp_path):
    (tmp_path / "in.txt").write_bytes(b"a a b\na c\n")
    assert run("--input", "in.txt", "--out", "o", "--split-count", "1", "--min-freq", "2",
               cwd=tmp_path).returncode == 0
    assert set(json.loads((tmp_path / "o/word_dict.json").read_text())) == {"a", "<s>", "<e>", "<unk>"}
    assert run("--input", "in.txt", "--out", "o2", "--split-count", "1", "--no-dict",
               cwd=tmp_path).returncode == 0
    assert not (tmp_path / "o2/word_dict.json").exists()
    assert "word_dict.json" not in json.loads((tmp_path / "o2/MANIFEST.json").read_text())["files"]


# ---------------------------------------------------------------- tarball / URL

def make_tgz(path, members):
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif isinstance(data, tuple):                  # ("symlink", target)
                info.type = tarfile.SYMTYPE
                info.linkname = data[1]
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def test_file_url_of_an_imikolov_tarball(tmp_path):
    train = b"".join(b"the cat sat %d\n" % i for i in range(20))
    test = b"".join(b"a dog ran %d\n" % i for i in range(6))
    make_tgz(tmp_path / "simple-examples.tgz", [
        ("./simple-examples", None), ("./simple-examples/data", None),
        ("./simple-examples/data/ptb.train.txt", train),
        ("./simple-examples/data/ptb.valid.txt", b"v\n"),
        ("./simple-examples/data/ptb.test.txt", test),
        ("./simple-examples/data/ptb.char.train.txt", b"c h a r\n"),
        ("./simple-examples/link", ("symlink", "/etc/passwd")),
    ])
    url = (tmp_path / "simple-examples.tgz").as_uri()
    r = run("--input", url, "--out", "o", "--split-count", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    o = tmp_path / "o"
    assert b"".join(p.read_bytes() for p in shards(o)) == train
    assert b"".join(p.read_bytes() for p in shards(o, "test.txt")) == test
    m = json.loads((o / "MANIFEST.json").read_text())
    assert m["source"] == f"{url} (simple-examples/data/ptb.train.txt)"
    assert m["source_sha256"] == hashlib.sha256((tmp_path / "simple-examples.tgz").read_bytes()).hexdigest()
    assert m["skipped_members"] == 1                      # the symlink, never created
    assert "cat" in json.loads((o / "word_dict.json").read_text())
    assert not no_leftovers(tmp_path)
    # a rerun with the same URL is a no-op without downloading
    (tmp_path / "simple-examples.tgz").unlink()
    r2 = run("--input", url, "--out", "o", "--split-count", "2", cwd=tmp_path)
    assert r2.returncode == 0 and "up to date" in r2.stdout, r2.stderr


@pytest.mark.parametrize("evil", ["../escape.txt", "/tmp/abs-escape.txt", "a/../../escape.txt"])
def test_tarball_path_traversal_is_refused(tmp_path, evil):
    make_tgz(tmp_path / "evil.tgz", [("ok.txt", b"fine\n"), (evil, b"pwned\n")])
    (tmp_path / "inner").mkdir()
    r = run("--input", (tmp_path / "evil.tgz").as_uri(), "--out", "inner/o", "--split-count", "1",
            cwd=tmp_path)
    assert_one_line_error(r, "unsafe path in archive")
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "inner/escape.txt").exists()
    assert not Path("/tmp/abs-escape.txt").exists()
    assert not (tmp_path / "inner/o").exists() and not no_leftovers(tmp_path / "inner")


def test_local_tarball_and_plain_file_url(tmp_path):
    make_tgz(tmp_path / "d.tar.gz", [("d/x.txt", b"x1\nx2\n"), ("d/y.txt", b"y1\n")])
    assert run("--input", "d.tar.gz", "--out", "o", "--split-count", "1", "--no-dict",
               cwd=tmp_path).returncode == 0
    assert (tmp_path / "o/train.txt-00000").read_bytes() == b"x1\nx2\ny1\n"
    (tmp_path / "p.txt").write_bytes(b"p1\np2\n")
    assert run("--input", (tmp_path / "p.txt").as_uri(), "--out", "o2", "--split-count", "2",
               cwd=tmp_path).returncode == 0
    assert (tmp_path / "o2/train.txt-00001").read_bytes() == b"p2\n"


# ---------------------------------------------------------------- --sample

def test_sample_is_deterministic_and_marked_synthetic(tmp_path):
    for d in ("a", "b"):
        r = run("--sample", "--out", d, "--split-count", "2", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "synthetic" in r.stdout
    ma = json.loads((tmp_path / "a/MANIFEST.json").read_text())
    mb = json.loads((tmp_path / "b/MANIFEST.json").read_text())
    assert ma["files"] == mb["files"]
    assert ma["synthetic"] is True and "synthetic" in ma["source"]
    assert 3000 <= sum(e["lines"] for e in ma["files"].values() if e["kind"] == "train") <= 10000
    assert 1000 <= ma["dictionary"]["words"] <= 5000
    assert ma["files"]["test.txt-00000"]["lines"] > 0


# ---------------------------------------------------------------- reruns, --force

def test_rerun_is_a_noop_and_a_different_request_is_refused(tmp_path):
    (tmp_path / "in.txt").write_bytes(corpus())
    assert run("--input", "in.txt", "--out", "o", "--split-count", "4", cwd=tmp_path).returncode == 0
    before = {p.name: p.stat().st_ino for p in (tmp_path / "o").iterdir()}
    r = run("--input", "in.txt", "--out", "o", "--split-count", "4", cwd=tmp_path)
    assert r.returncode == 0 and "up to date" in r.stdout
    assert {p.name: p.stat().st_ino for p in (tmp_path / "o").iterdir()} == before

    r = run("--input", "in.txt", "--out", "o", "--split-count", "2", cwd=tmp_path)
    assert_one_line_error(r, "--out o", "different", "split count 4 there, 2 asked", "--force")
    assert {p.name: p.stat().st_ino for p in (tmp_path / "o").iterdir()} == before

    r = run("--input", "in.txt", "--out", "o", "--split-count", "2", "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "o")) == ["MANIFEST.json", "train.txt-00000",
                                                  "train.txt-00001", "word_dict.json"]
    assert not no_leftovers(tmp_path)


def test_damaged_output_of_the_same_request_is_rebuilt(tmp_path):
    (tmp_path / "in.txt").write_bytes(corpus())
    assert run("--input", "in.txt", "--out", "o", "--split-count", "2", cwd=tmp_path).returncode == 0
    (tmp_path / "o/train.txt-00001").write_bytes(b"corrupted\n")
    r = run("--input", "in.txt", "--out", "o", "--split-count", "2", cwd=tmp_path)
    assert r.returncode == 0 and "wrote" in r.stdout
    assert b"".join(p.read_bytes() for p in shards(tmp_path / "o")) == corpus()


def test_shards_without_manifest_are_not_overwritten(tmp_path):
    (tmp_path / "in.txt").write_bytes(b"a\nb\n")
    (tmp_path / "o").mkdir()
    (tmp_path / "o/train.txt-00000").write_bytes(b"someone else's\n")
    (tmp_path / "o/notes.txt").write_bytes(b"keep me\n")
    r = run("--input", "in.txt", "--out", "o", "--split-count", "2", cwd=tmp_path)
    assert_one_line_error(r, "no MANIFEST.json", "--force")
    assert (tmp_path / "o/train.txt-00000").read_bytes() == b"someone else's\n"
    r = run("--input", "in.txt", "--out", "o", "--split-count", "2", "--force", cwd=tmp_path)
    assert r.returncode == 0
    assert (tmp_path / "o/notes.txt").read_bytes() == b"keep me\n"      # not ours: kept
    assert (tmp_path / "o/train.txt-00000").read_bytes() == b"a\n"


def test_output_dir_whose_parent_is_read_only_is_staged_inside_it(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_bytes(b"a\nb\n")
    out = tmp_path / "o"
    out.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path)
                        else real_access(p, m))
    prepare(str(out), 2, input=str(tmp_path / "in.txt"), progress=False)
    assert sorted(os.listdir(out)) == ["MANIFEST.json", "train.txt-00000", "train.txt-00001",
                                       "word_dict.json"]
    assert not no_leftovers(tmp_path)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("args,needles", [
    (["--input", "/nonexistent/x.txt", "--out", "o", "--split-count", "2"],
     ["--input /nonexistent/x.txt", "no such file"]),
    (["--input", "empty.txt", "--out", "o", "--split-count", "2"], ["--input empty.txt", "empty input"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "3"], ["--input two.txt", "only 2 lines", "3 shards"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "3", "--strategy", "round-robin"], ["only 2 lines"]),
    (["--input", "two.txt", "--test", "empty.txt", "--out", "o", "--split-count", "1"], ["--test empty.txt", "empty"]),
    (["--input", "two.txt", "--test", "nope.txt", "--out", "o", "--split-count", "1"], ["--test nope.txt", "no such file"]),
    (["--input", "emptydir", "--out", "o", "--split-count", "1"], ["--input emptydir", "no files"]),
    (["--input", "file:///nonexistent/simple-examples.tgz", "--out", "o", "--split-count", "1"],
     ["--input file:///nonexistent/simple-examples.tgz", "download failed"]),
    (["--input", "http://127.0.0.1:9/simple-examples.tgz", "--out", "o", "--split-count", "1"],
     ["--input http://127.0.0.1:9/simple-examples.tgz", "download failed"]),
    (["--input", "s3://bucket/x", "--out", "o", "--split-count", "1"], ["unsupported URL scheme"]),
    (["--input", "garbage.tgz", "--out", "o", "--split-count", "1"], ["garbage.tgz", "not a valid tar archive"]),
    (["--input", "two.txt", "--out", "two.txt", "--split-count", "1"], ["--out two.txt", "not a directory"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "0"], ["--split-count 0"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "x"], ["--split-count", "invalid int"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "1", "--strategy", "bogus"], ["--strategy", "bogus"]),
    (["--input", "two.txt", "--sample", "--out", "o", "--split-count", "1"], ["--input", "--sample"]),
    (["--out", "o", "--split-count", "1"], ["--input", "--sample"]),
    (["--input", "two.txt", "--split-count", "1"], ["--out"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "1", "--no-dict", "--min-freq", "3"], ["--min-freq"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "1", "--min-freq", "0"], ["--min-freq 0"]),
    (["--input", "two.txt", "--out", "o", "--split-count", "1", "--bogus"], ["--bogus"]),
    (["--input", "srcdir", "--out", "srcdir/o", "--split-count", "1"], ["inside --input srcdir"]),
    (["--input", "two.txt", "--test", "garbage.tgz", "--out", "o", "--split-count", "1"], ["--test garbage.tgz"]),
    (["--input", "/nonexistent/x.txt", "--out", "new/deeper/o", "--split-count", "1"], ["no such file"]),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, args, needles):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "two.txt").write_bytes(b"one\ntwo\n")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "srcdir").mkdir()
    (tmp_path / "srcdir/a.txt").write_bytes(b"a\n")
    (tmp_path / "garbage.tgz").write_bytes(b"this is not a tarball\n" * 10)
    before = sorted(os.listdir(tmp_path))
    r = run(*args, cwd=tmp_path)
    assert_one_line_error(r, *needles)
    assert sorted(os.listdir(tmp_path)) == before      # no output dir, no temp dir


def test_sigterm_mid_download_exits_130_and_leaves_nothing(tmp_path):
    import signal
    import socket
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    sent = threading.Event()

    def stall():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 10000000\r\n\r\n" + b"x\n" * 5000)
        sent.set()
        threading.Event().wait(20)      # never finish the body
        conn.close()

    threading.Thread(target=stall, daemon=True).start()
    proc = subprocess.Popen([sys.executable, PREPARE, "--input", f"http://127.0.0.1:{port}/c.txt",
                             "--out", "o", "--split-count", "1"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sent.wait(20)
        deadline = 50
        while not no_leftovers(tmp_path) and deadline:   # the download has begun
            threading.Event().wait(0.1)
            deadline -= 1
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["prepare.py: interrupted (temporary files removed)"]
    assert not (tmp_path / "o").exists() and not no_leftovers(tmp_path)


def test_test_input_with_too_few_lines_leaves_no_train_shards(tmp_path):
    (tmp_path / "in.txt").write_bytes(corpus())
    (tmp_path / "t.txt").write_bytes(b"only one\n")
    r = run("--input", "in.txt", "--test", "t.txt", "--out", "o", "--split-count", "2", cwd=tmp_path)
    assert_one_line_error(r, "--test t.txt", "only 1 line")
    assert not (tmp_path / "o").exists() and not no_leftovers(tmp_path)


def test_split_count_defaults_to_the_cluster_trainers(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_bytes(corpus())
    r = subprocess.run([sys.executable, PREPARE, "--input", "in.txt", "--out", "o"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "FABTRAIN_CLUSTER": str(REPO / "cluster.yaml")})
    from fabtrain.config.cluster import load_cluster
    expected = load_cluster(str(REPO / "cluster.yaml")).trainer_count
    assert r.returncode == 0, r.stderr
    assert len(shards(tmp_path / "o")) == expected
    r = subprocess.run([sys.executable, PREPARE, "--input", "in.txt", "--out", "o2"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "FABTRAIN_CLUSTER": str(tmp_path / "missing.yaml")})
    assert_one_line_error(r, "missing.yaml")


def test_main_in_process_returns_codes(tmp_path, capsys):
    (tmp_path / "in.txt").write_bytes(b"a\nb\n")
    assert main(["--help"]) == 0
    assert main(["--input", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
                 "--split-count", "1"]) == 2
    assert main(["--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "o"),
                 "--split-count", "2", "-q"]) == 0
    err = capsys.readouterr().err
    assert err.count("prepare.py:") == 1


def test_progress_only_after_the_delay_and_plain_lines_off_a_tty():
    buf = io.StringIO()
    with Progress("splitting train", 100, stream=buf, delay=10) as bar:
        bar.update(100)
    assert buf.getvalue() == ""                        # quick work: nothing shown
    buf = io.StringIO()
    with Progress("splitting train", 100, stream=buf, delay=0, every=0) as bar:
        bar.update(50)
        bar.update(50)
    lines = buf.getvalue().splitlines()
    assert lines and "\r" not in buf.getvalue() and "100.0%" in lines[-1]
