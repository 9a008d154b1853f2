"""`fab split-data` and `fab copy-data`: each trainer's shards onto its node, verified.

split-data runs prepare.py's library on this machine for `job.data`, with
one shard per trainer. copy-data then works node by node, in parallel:

  1. verify   one remote command: sha256 of every file the node needs,
              against MANIFEST.json (and the free disk)
  2. rsync    only the files that are missing or differ, over the node's SSH
              settings; rsync writes each into a temp name and renames it when
              whole, and `--partial-dir` keeps an interrupted file for resuming
  3. verify   again, so what the trainers will read is known to be right

A node that already has everything costs one remote command and sends
nothing. A node with shared storage (`data.shared: true`) is only verified.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .cluster import Cluster
from .datasplit import MANIFEST_NAME, files_for_trainer, load_manifest, prepare
from .datasplit.manifest import sha256_file
from .errors import UserError
from .lifecycle import rsync_reason
from .session import Session
from .transport import NodeError, Transport

PARTIAL_DIR = ".rsync-partial"


def split_data(cluster: Cluster, input: str | None = None, force: bool = False):
    """prepare.py for the cluster: job.data.input into job.data.dir, one shard per trainer."""
    data = cluster.job.data
    source = input or data.input
    kwargs = {"sample": True} if source == "sample" else {"input": source, "test": data.test}
    if source != "sample" and not re.match(r"^[a-z]+://", source):
        path = Path(source).expanduser()
        kwargs["input"] = str(path if path.is_absolute() else Path(cluster.path).resolve().parent / path)
    return prepare(str(cluster.data_dir()), cluster.trainer_count, strategy=data.strategy,
                   min_freq=data.min_freq, force=force, progress=sys.stderr.isatty(), **kwargs)


def files_per_node(cluster: Cluster, manifest: dict) -> dict[str, list[str]]:
    """Node name -> the data files its trainers need (shards by trainer id mod count)."""
    count, per_node = cluster.trainer_count, cluster.job.trainer.per_node
    needed = {}
    for index, node in enumerate(cluster.trainer_nodes):
        names: dict[str, None] = {}  # ordered set
        for rank in range(index * per_node, (index + 1) * per_node):  # the plan's trainer ranks
            names.update(dict.fromkeys(files_for_trainer(manifest, rank, count)))
        needed[node.name] = list(names)
    return needed


@dataclass
class NodeCopy:
    node: str
    files: int = 0
    sent: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    verified: bool = False
    shared: bool = False


def copy_data(session: Session, progress=None, bwlimit: int | None = None) -> list:
    cluster = session.cluster
    data_dir = cluster.data_dir()
    try:
        manifest = load_manifest(str(data_dir))
    except UserError as e:
        raise UserError(f"{e} (run `fab split-data` first)") from None
    needed = files_per_node(cluster, manifest)
    manifest_sha = sha256_file(str(data_dir / MANIFEST_NAME))
    shared = cluster.job.data.shared
    remote_dir = cluster.job.data.dir if shared else "$WS/data"

    def one(t: Transport) -> NodeCopy:
        names = needed[t.node.name]
        expected = {n: manifest["files"][n]["sha256"] for n in names if n in manifest["files"]}
        expected[MANIFEST_NAME] = manifest_sha
        result = NodeCopy(t.node.name, files=len(names), shared=shared)
        first = t.call("verify", {"dir": remote_dir, "files": expected}, timeout=3600)
        stale = [n for n, state in first["files"].items() if state != "ok"]
        if shared:
            if stale:
                raise NodeError(f"{t.node.name}: shared data at {remote_dir} does not match the manifest: "
                                + ", ".join(f"{n} {first['files'][n]}" for n in stale[:5]))
            result.verified = True
            return result
        to_send = stale
        if not to_send:
            result.verified = True
            return result
        need_bytes = sum(manifest["files"].get(n, {}).get("bytes", 0) for n in stale)
        if need_bytes > first["disk_free"]:
            raise NodeError(f"{t.node.name}: not enough disk for the data: {need_bytes >> 20} MiB to copy, "
                            f"{first['disk_free'] >> 20} MiB free in {t.node.workspace}")
        result.bytes_sent = _rsync_files(t, data_dir, to_send, t.node.workspace + "/data", progress, bwlimit)
        result.sent = to_send
        second = t.call("verify", {"dir": remote_dir, "files": expected}, timeout=3600)
        bad = [n for n, state in second["files"].items() if state != "ok"]
        if bad:
            raise NodeError(f"{t.node.name}: after copying, {', '.join(bad[:5])} still differ from the manifest")
        result.verified = True
        return result

    return session.map(one, [cluster.node(n) for n in needed])


def _rsync_files(t: Transport, source_dir: Path, names: list[str], remote_dir: str, progress,
                 bwlimit: int | None = None) -> int:
    transport_args, dest = t.rsync_destination(remote_dir)
    argv = ["rsync", "-a", "--ignore-times", f"--partial-dir={PARTIAL_DIR}", "--files-from=-", "--from0",
            "--info=progress2,stats1", "--no-inc-recursive", *([f"--bwlimit={bwlimit}"] if bwlimit else []),
            *transport_args, f"{source_dir}/", dest]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stderr_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    proc.stdin.write(b"\0".join(n.encode() for n in names))
    proc.stdin.close()
    # Progress only for copies that take more than a second.
    sent, last_report, buf = 0, time.time(), b""
    while True:
        chunk = proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
        if not chunk:
            break
        buf += chunk
        *records, buf = re.split(rb"[\r\n]", buf)
        for rec in records:
            m = re.match(rb"\s*([\d,]+)\s+(\d+)%\s+(\S+)", rec)
            if m:
                sent = int(m.group(1).replace(b",", b""))
                if progress and time.time() - last_report >= 1.0:
                    last_report = time.time()
                    progress(f"{t.node.name}: {m.group(2).decode()}% {sent >> 20} MiB {m.group(3).decode()}")
    proc.wait()
    reader.join()
    if proc.returncode != 0:
        raise NodeError(f"{t.node.name}: rsync failed: {rsync_reason(b''.join(stderr_chunks).decode(errors='replace'), proc.returncode)}")
    return sent
