"""`fab split-data` and `fab copy-data`: each trainer's shards onto its node, verified.

split-data runs prepare.py's library on this machine for `job.data`, with
one shard per trainer. copy-data then works node by node, in parallel:

  1. verify   sha256 of every file the node needs, against MANIFEST.json
              (and the free disk)
  2. rsync    only the files that are missing or differ, over the node's SSH
              settings; rsync writes each into a temp name and renames it when
              whole, and `--partial-dir` keeps an interrupted file for resuming
  3. verify   again, so what the trainers will read is known to be right

Both verifies go through one node-side process (a fabtrain.remote.rpc
Channel), so the node's login shell and interpreter start once, not twice.
Unless the last copy-data verified this very manifest on the node, rsync is
started together with the first verify: its SSH connection and the node's
login shell come up while the node hashes, and it reads the list of files
to send only when the verify has answered (on a node with a `.bashrc` that
runs `pyenv init` or `conda init`, each of those costs tenths of a second).

A node that already has everything costs one remote command and sends
nothing. A node with shared storage (`data.shared: true`) is only verified.
A spare node gets the shards of every trainer (files_per_node).
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fabtrain.controller import state
from fabtrain.config.cluster import Cluster
from fabtrain.data import MANIFEST_NAME, files_for_trainer, load_manifest, prepare
from fabtrain.data.archive import ExtractLimits
from fabtrain.data.manifest import sha256_file
from fabtrain.errors import UserError
from fabtrain.remote.rpc import Channel
from fabtrain.remote.rsync import Rsync
from fabtrain.remote.session import Session
from fabtrain.remote.transport import NodeError, Transport

PARTIAL_DIR = ".rsync-partial"


def split_data(cluster: Cluster, input: str | None = None, force: bool = False):
    """prepare.py for the cluster: job.data.input into job.data.dir, one shard per trainer."""
    data = cluster.job.data
    source = input or data.input
    kwargs = {"sample": True} if source == "sample" else {"input": source, "test": data.test}
    if source != "sample" and not re.match(r"^[a-z]+://", source):
        path = Path(source).expanduser()
        kwargs["input"] = str(path if path.is_absolute() else Path(cluster.path).resolve().parent / path)
    limits = ExtractLimits.from_mb(data.max_extract_mb, data.max_expansion)
    try:
        return prepare(str(cluster.data_dir()), cluster.trainer_count, strategy=data.strategy,
                       min_freq=data.min_freq, force=force, progress=sys.stderr.isatty(),
                       limits=limits, **kwargs)
    except OSError as e:  # a full disk, a permission: one line, as prepare.py prints it
        where = f"{e.filename}: " if e.filename else ""
        raise UserError(f"{where}{e.strerror or e}") from None


def files_per_node(cluster: Cluster, manifest: dict) -> dict[str, list[str]]:
    """Node name -> the data files its trainers need (shards by trainer id mod count). A spare (`spare: true`)
    needs every trainer's: it may take any trainer node's slot, and then reads that slot's shards."""
    count, per_node = cluster.trainer_count, cluster.job.trainer.per_node
    needed = {}
    for index, node in enumerate(cluster.trainer_nodes):
        names: dict[str, None] = {}  # ordered set
        for rank in range(index * per_node, (index + 1) * per_node):  # the plan's trainer ranks
            names.update(dict.fromkeys(files_for_trainer(manifest, rank, count)))
        needed[node.name] = list(names)
    every = list(dict.fromkeys(name for names in needed.values() for name in names))
    return needed | {node.name: every for node in cluster.spare_nodes}


@dataclass
class NodeCopy:
    node: str
    files: int = 0
    sent: list[str] = field(default_factory=list)
    bytes_sent: int = 0      # the size of what was sent (rsync's progress: whole files, resumed parts too)
    wire_bytes: int = 0      # what rsync really sent over the connection (its stats): less when it resumed
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
    # which manifest the last copy-data verified on each node (a hint, never trusted as proof)
    held = state.data_on_nodes(cluster.name)

    def one(t: Transport) -> NodeCopy:
        names = needed[t.node.name]
        expected = {n: manifest["files"][n]["sha256"] for n in names if n in manifest["files"]}
        expected[MANIFEST_NAME] = manifest_sha
        verify = {"dir": remote_dir, "files": expected}
        result = NodeCopy(t.node.name, files=len(names), shared=shared)
        push = None
        if not shared and held.get(t.node.name) != manifest_sha:
            push = RsyncPush(t, data_dir, t.node.workspace + "/data", bwlimit)  # likely needed
        try:
            channel = Channel(t, timeout=60)
        except BaseException:
            if push is not None:
                push.cancel()
            raise
        try:
            first = channel.request("verify", verify, timeout=3600)
            stale = [n for n, status in first.files.items() if status != "ok"]
            if shared:
                if stale:
                    raise NodeError(f"{t.node.name}: shared data at {remote_dir} does not match the manifest: "
                                    + ", ".join(f"{n} {first.files[n]}" for n in stale[:5]))
                result.verified = True
                return result
            if not stale:
                result.verified = True
                return result
            need_bytes = sum(manifest["files"].get(n, {}).get("bytes", 0) for n in stale)
            if need_bytes > first.disk_free:
                raise NodeError(f"{t.node.name}: not enough disk for the data: {need_bytes >> 20} MiB to copy, "
                                f"{first.disk_free >> 20} MiB free in {t.node.workspace}")
            push = push or RsyncPush(t, data_dir, t.node.workspace + "/data", bwlimit)
            result.bytes_sent = push.send(stale, progress)
            result.wire_bytes = push.wire_bytes
            result.sent = stale
            # the files verify found right were not sent, so not touched: check what was sent
            second = channel.request("verify", {**verify, "files": {n: expected[n] for n in stale}}, timeout=3600)
            bad = [n for n, status in second.files.items() if status != "ok"]
            if bad:
                raise NodeError(f"{t.node.name}: after copying, {', '.join(bad[:5])} still differ from the manifest")
            result.verified = True
            return result
        finally:
            if push is not None:
                push.cancel()
            channel.close()

    replies = session.map(one, [cluster.node(n) for n in needed])
    if not shared:
        state.remember_data_on_nodes(cluster.name, {
            r.node: manifest_sha if r.ok and r.value.verified else None for r in replies})
    return replies


class RsyncPush:
    """One rsync of some files of source_dir into remote_dir on one node.

    It starts at once and reads the list of files on stdin (--files-from=-):
    rsync opens its SSH connection and starts the node's side before it reads
    the list, so that work overlaps whatever decides the list. send() gives
    the list and waits; cancel() stops an rsync that is no longer wanted."""

    def __init__(self, t: Transport, source_dir: Path, remote_dir: str, bwlimit: int | None = None):
        self.node = t.node.name
        options = ["--ignore-times", f"--partial-dir={PARTIAL_DIR}", "--files-from=-", "--from0",
                   "--info=progress2,stats1", "--no-inc-recursive", *([f"--bwlimit={bwlimit}"] if bwlimit else [])]
        self.rsync = Rsync(t, [f"{source_dir}/"], remote_dir, options, files_from_stdin=True)
        self.wire_bytes = 0  # what rsync says it sent over the wire (its stats line)

    def send(self, names: list[str], progress=None) -> int:
        """Copy these files (relative to source_dir); the bytes sent."""
        self.rsync.give_files(names)
        # Progress only for copies that take more than a second.
        sent, last_report = 0, time.time()
        for record in self.rsync.records():
            stats = re.match(rb"\s*sent ([\d,]+) bytes\s+received", record)  # --info=stats1's summary
            if stats:
                self.wire_bytes = int(stats.group(1).replace(b",", b""))
            m = re.match(rb"\s*([\d,]+)\s+(\d+)%\s+(\S+)", record)
            if m:
                sent = int(m.group(1).replace(b",", b""))
                if progress and time.time() - last_report >= 1.0:
                    last_report = time.time()
                    progress(f"{self.node}: {m.group(2).decode()}% {sent >> 20} MiB {m.group(3).decode()}")
        self.rsync.finish()
        return sent

    def cancel(self) -> None:
        """Stop it if it still runs (a no-op after send())."""
        self.rsync.cancel()
