"""fab split-data / copy-data on real sshd nodes: each trainer's shards, verified."""
import hashlib
import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import FAB, REPO, require
from tests.support.procscan import wait_for
from tests.support.sshd import write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(180)]


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def data_cluster(tmp_path, sshd):
    corpus = tmp_path / "corpus.txt"
    # ~6 MB of text, so a rate-limited copy can be interrupted half-way.
    words = [f"w{i}" for i in range(500)]
    with corpus.open("w") as f:
        for i in range(120_000):
            f.write(" ".join(words[(i * 7 + k * 13) % 500] for k in range(8)) + "\n")
    path = write_cluster(tmp_path / "c.yaml", sshd,
                         ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"]), ("node3", ["trainer"])],
                         job={"mode": "collective", "trainer": {"command": "true"},
                              "data": {"dir": str(tmp_path / "prepared"), "input": str(corpus)},
                              "watchdog": {"enabled": False}})
    return path, tmp_path


def node_data(tmp_path, node):
    return tmp_path / f"ws-{node}" / "data"


def test_each_node_gets_exactly_its_shards_and_a_second_copy_sends_nothing(fab, data_cluster):
    path, tmp = data_cluster
    out = fab("split-data", cluster=path, check=True)
    assert "3 train shards" in out.stdout
    manifest = json.loads((tmp / "prepared" / "MANIFEST.json").read_text())
    out = fab("copy-data", cluster=path, check=True)
    for i, node in enumerate(("node1", "node2", "node3")):
        d = node_data(tmp, node)
        assert sorted(p.name for p in d.iterdir()) == ["MANIFEST.json", f"train.txt-{i:05d}", "word_dict.json"]
        for name in (f"train.txt-{i:05d}", "word_dict.json"):
            assert sha(d / name) == manifest["files"][name]["sha256"]
        assert re.search(rf"^{node}: 3 files verified, 3 sent", out.stdout, re.M), out.stdout
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for n in ("node1", "node2", "node3") for p in node_data(tmp, n).iterdir()}
    out = fab("copy-data", cluster=path, check=True)
    assert out.stdout.count("already in place and verified, nothing sent") == 3, out.stdout
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before}
    assert after == before  # nothing rewritten


def rsyncs_to(tmp):
    """Command lines of live rsync processes (either end) that name a path under tmp."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        line = b" ".join(argv).decode(errors="replace")
        if "rsync" in line and str(tmp) in line:
            found.append(f"{pid} {line}")
    return found


def test_copy_data_trusts_the_nodes_not_its_memory(fab, data_cluster, tmp_path):
    """The controller remembers which manifest each node held after the last copy; that only
    decides whether rsync starts early. Every node is verified either way."""
    path, tmp = data_cluster
    fab("split-data", "copy-data", cluster=path, check=True)
    hint = json.loads(next((tmp_path / "controller-state").glob("*.data.json")).read_text())
    assert sorted(hint["nodes"]) == ["node1", "node2", "node3"]
    # remembered as holding the data, but it is gone: found missing and copied again
    import shutil
    shutil.rmtree(node_data(tmp, "node1"))
    out = fab("copy-data", cluster=path, check=True)
    assert re.search(r"^node1: 3 files verified, 3 sent", out.stdout, re.M), out.stdout
    assert out.stdout.count("nothing sent") == 2
    # not remembered (say, another controller copied it), but in place: the rsync started
    # early is stopped, nothing is sent or rewritten, and no rsync is left running
    for f in (tmp_path / "controller-state").glob("*.data.json"):
        f.unlink()
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for n in ("node1", "node2", "node3")
              for p in node_data(tmp, n).iterdir()}
    out = fab("copy-data", cluster=path, check=True)
    assert out.stdout.count("already in place and verified, nothing sent") == 3, out.stdout
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before
    # the node's side of the stopped rsync ends as soon as its sshd sees the connection close
    assert wait_for(lambda: rsyncs_to(tmp) == [], timeout=10), rsyncs_to(tmp)


def test_a_corrupted_shard_on_a_node_is_detected_and_repaired(fab, data_cluster):
    path, tmp = data_cluster
    fab("split-data", "copy-data", cluster=path, check=True)
    shard = node_data(tmp, "node2") / "train.txt-00001"
    good = sha(shard)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # same size, same mtime: rsync's quick check alone would miss it
    stat = shard.stat()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    out = fab("copy-data", cluster=path, check=True)
    assert re.search(r"^node2: 3 files verified, 1 sent", out.stdout, re.M), out.stdout
    assert out.stdout.count("nothing sent") == 2
    assert sha(shard) == good


def test_an_interrupted_copy_leaves_nothing_truncated_and_resumes(fab, data_cluster, tmp_path):
    path, tmp = data_cluster
    fab("split-data", cluster=path, check=True)
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(tmp_path / "st")}
    proc = subprocess.Popen([FAB, "copy-data", "--bwlimit", "1000"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    # Interrupt once rsync is writing a shard (into its temp name).
    deadline = time.time() + 30
    while time.time() < deadline and not any(
            p.name.startswith(".train.txt-") for n in ("node1", "node2", "node3")
            if node_data(tmp, n).exists() for p in node_data(tmp, n).iterdir()):
        time.sleep(0.05)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)  # fab and its rsyncs, as a Ctrl-C'd laptop would
    proc.wait()
    subprocess.run(["pkill", "-KILL", "-f", f"rsync.*{tmp}/prepared"], check=False)
    time.sleep(0.3)
    manifest = json.loads((tmp / "prepared" / "MANIFEST.json").read_text())
    for i, node in enumerate(("node1", "node2", "node3")):
        final = node_data(tmp, node) / f"train.txt-{i:05d}"
        # Either not there yet, or whole: never a truncated file under the final name.
        assert not final.exists() or sha(final) == manifest["files"][final.name]["sha256"]
    partials = [p for n in ("node1", "node2", "node3") for p in (node_data(tmp, n) / ".rsync-partial").glob("*")
                if (node_data(tmp, n) / ".rsync-partial").exists()]
    assert partials  # the interrupted copy left partial data to resume from, not a truncated final file
    kept = {node: sum(p.stat().st_size for p in (node_data(tmp, node) / ".rsync-partial").glob("*"))
            if (node_data(tmp, node) / ".rsync-partial").exists() else 0 for node in ("node1", "node2", "node3")}
    out = fab("copy-data", cluster=path, check=True)
    for i, node in enumerate(("node1", "node2", "node3")):
        final = node_data(tmp, node) / f"train.txt-{i:05d}"
        assert sha(final) == manifest["files"][final.name]["sha256"]
        assert not (node_data(tmp, node) / ".rsync-partial").exists() or \
            not list((node_data(tmp, node) / ".rsync-partial").iterdir())
        # The resumed copy sent less than a fresh one: rsync's own count of the bytes it put on the wire
        # stays below the data it delivered less what the node already held (the kept part costs only
        # block checksums, under 1% of it).
        m = re.search(rf"^{node}: 3 files verified, \d sent \((\d+) bytes, (\d+) over the wire\)$", out.stdout, re.M)
        if m is None:                    # the interrupted run had already delivered this node's files whole
            assert re.search(rf"^{node}: 3 files already in place and verified, nothing sent$", out.stdout, re.M), out.stdout
            continue
        delivered, wire = int(m.group(1)), int(m.group(2))
        assert 0 < wire <= delivered - kept[node] + delivered // 100, (node, delivered, wire, kept[node])
    assert sum(kept.values()) > 0


def test_an_unreachable_node_is_named_and_the_others_get_their_data(fab, data_cluster, sshd):
    path, tmp = data_cluster
    fab("split-data", cluster=path, check=True)
    node = next(n for n in sshd.nodes if n.name == "node2")
    sshd.stop(node)
    try:
        out = fab("copy-data", cluster=path)
    finally:
        sshd.start(node)
    assert out.returncode == 1
    assert re.search(r"^node2: FAILED: node2 \(root@127\.0\.0\.3:\d+\): unreachable: connection refused$",
                     out.stdout, re.M), out.stdout
    assert re.search(r"^node1: 3 files verified, 3 sent", out.stdout, re.M), out.stdout
    assert re.search(r"^node3: 3 files verified, 3 sent", out.stdout, re.M), out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    assert wait_for(lambda: rsyncs_to(tmp) == [], timeout=10), rsyncs_to(tmp)
    out = fab("copy-data", cluster=path, check=True)      # back up: only node2 gets a copy
    assert re.search(r"^node2: 3 files verified, 3 sent", out.stdout, re.M), out.stdout
    assert out.stdout.count("nothing sent") == 2


def test_a_full_disk_is_reported_by_node_name_and_the_others_finish(fab, data_cluster):
    path, tmp = data_cluster
    fab("split-data", cluster=path, check=True)
    small = node_data(tmp, "node2")
    small.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True, text=True)
    require(mount.returncode == 0, "tmpfs", f"a 64 KiB tmpfs stands in for a full disk; mounting it needs root "
                                            f"(CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        out = fab("copy-data", cluster=path)
        assert out.returncode == 1
        assert re.search(r"^node2: FAILED: not enough disk for the data: \d+ MiB to copy", out.stdout, re.M), out.stdout
        assert re.search(r"^node1: 3 files verified, 3 sent", out.stdout, re.M)
        assert re.search(r"^node3: 3 files verified, 3 sent", out.stdout, re.M)
        assert not (small / "train.txt-00001").exists()
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_shared_storage_is_only_verified(fab, data_cluster):
    path, tmp = data_cluster
    fab("split-data", cluster=path, check=True)
    text = path.read_text().replace("input:", "shared: true\n    input:")
    path.write_text(text)
    out = fab("copy-data", cluster=path, check=True)
    assert out.stdout.count("shared data verified") == 3
    assert not node_data(tmp, "node1").exists()
    shard = tmp / "prepared" / "train.txt-00002"
    shard.write_bytes(shard.read_bytes() + b"extra\n")
    out = fab("copy-data", cluster=path)
    assert out.returncode == 1 and re.search(r"node3: FAILED: shared data at .* does not match the manifest: train.txt-00002 mismatch", out.stdout), out.stdout


def test_copy_data_before_split_data_says_what_to_do(fab, data_cluster):
    path, _ = data_cluster
    out = fab("copy-data", cluster=path)
    assert out.returncode == 2 and "run `fab split-data` first" in out.stderr
    assert "Traceback" not in out.stderr
