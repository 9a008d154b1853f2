"""The node-ops call protocol on real sshd nodes and a local node: what it shows
to other users of the machines, and how it tells a slow node from a lost one."""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import subprocess
import sys
import threading
import time
import zlib

import pytest
import yaml

from fabtrain.config.cluster import load_cluster
from fabtrain.controller import lifecycle, report, watch
from fabtrain.controller.collector import Collector
from fabtrain.dashboard import create_app
from fabtrain.remote import rpc
from fabtrain.remote.session import Session
from fabtrain.remote.transport import NO_REPLY, UNREACHABLE
from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(180)]

TICKER = "python tests/programs/ticker.py --pservers={pservers} --id={trainer_id}"


class CmdlineSampler(threading.Thread):
    """Reads /proc/<pid>/cmdline of every process on the machine every few ms,
    as any local user can, and keeps every distinct command line seen."""

    def __init__(self):
        super().__init__(daemon=True)
        self.seen: set[bytes] = set()
        self.launched = set()  # "ssh" / "local": where node-side processes were seen started from
        self.scans = 0
        self.halt = threading.Event()

    def run(self):
        me = str(os.getpid())
        while not self.halt.is_set():
            for name in os.listdir("/proc"):
                if name.isdigit() and name != me:
                    try:
                        with open(f"/proc/{name}/cmdline", "rb") as f:
                            data = f.read()
                    except OSError:
                        continue
                    if data:
                        self.seen.add(data)
                    if rpc.LAUNCHER.encode() in data:
                        self.launched.add("ssh" if b"SSH_CONNECTION=" in environ(name) else "local")
            self.scans += 1
            time.sleep(0.002)

    def stop(self):
        self.halt.set()
        self.join(10)


def environ(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def renderings(cmdline: bytes):
    """The command line's arguments, and whatever base64 (or base64 of zlib) in them decodes to."""
    for arg in cmdline.split(b"\0"):
        yield arg
        for token in re.findall(rb"[A-Za-z0-9+/=]{16,}", arg):
            for start in range(4):  # the payload need not start on a 4-character boundary
                chunk = token[start:]
                chunk = chunk[:len(chunk) // 4 * 4]
                try:
                    raw = base64.b64decode(chunk)
                except (binascii.Error, ValueError):
                    continue
                yield raw
                try:
                    yield zlib.decompress(raw)
                except zlib.error:
                    pass


def test_the_jobs_secret_never_appears_in_any_command_line(tmp_path, sshd):
    """`fab deploy start-pserver start-trainers` on two sshd nodes and a local one,
    watched from the side: no argv on this machine (controller, sshd's shells,
    the node-side python, the job's processes) ever carries the secret."""
    port = free_port([n.address for n in sshd.nodes])
    pserver_port = free_port([n.address for n in sshd.nodes])
    job = {"name": "argv", "mode": "pserver",
           "pserver": {"port": pserver_port, "command": TICKER.replace(" --id={trainer_id}", "")},
           "trainer": {"command": TICKER}, "watchdog": {"enabled": True, "port": port, "interval": 1}}
    path = write_cluster(tmp_path / "cluster.yaml", sshd, job=job, local_nodes=[("local0", ["trainer"])],
                         ssh_nodes=[("node1", ["pserver"]), ("node2", ["trainer"])])
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(tmp_path / "state")}
    workspaces = [tmp_path / f"ws-{n}" for n in ("local0", "node1", "node2")]
    sampler = CmdlineSampler()
    sampler.start()
    try:
        out = subprocess.run([FAB, "deploy", "start-pserver", "start-trainers"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "warning" not in out.stdout, out.stdout  # the agents (which use the secret) started
        job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
        # Let the agents start and exchange a beat or two while the sampler watches.
        wait_for(lambda: all((ws / "jobs" / job_id / "health.json").exists() for ws in workspaces), timeout=20)
    finally:
        sampler.stop()
        subprocess.run([FAB, "kill-all", "--grace", "1"], cwd=REPO, env=env, capture_output=True, timeout=120)
    assert not live_marked(workspaces)
    secrets = {json.loads((ws / "jobs" / job_id / "job.json").read_text())["watchdog"]["coordinator"]["secret"]
               for ws in workspaces}
    assert len(secrets) == 1 and len(next(iter(secrets))) >= 16
    secret = next(iter(secrets)).encode()
    leaks = [c for c in sampler.seen if any(secret in r for r in renderings(c))]
    assert not leaks, f"the secret is in {len(leaks)} command line(s), e.g. {leaks[0][:300]!r}"
    # The sampler did see the node-side processes it is meant to catch (else it proves nothing).
    seen = [c.replace(b"\0", b" ").decode(errors="replace") for c in sampler.seen]
    assert sampler.scans > 50
    assert sum("fabtrain.node.agent" in c for c in seen) >= 3, "the sampler missed the agents"
    assert any(str(tmp_path) in c and "rsync" in c for c in seen), "the sampler missed deploy's rsync"
    assert sampler.launched == {"ssh", "local"}, "the sampler missed the node-side calls"


def test_a_node_that_connects_but_answers_slowly_is_slow_not_unreachable(tmp_path, sshd):
    """A node that connects but answers after fab status's timeout is NO REPLY, never UNREACHABLE.
    Here a node's python waits before it starts (an sshd node and a local one) until the test lets it go
    (a file; at most 60 s), next to a node with no sshd at all: only that one is unreachable."""
    slow, release = tmp_path / "slow-python", tmp_path / "release"
    slow.write_text(f"#!/bin/sh\ni=0\nwhile [ ! -e {release} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\n"
                    f"exec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"])],
                         local_nodes=[("local0", ["trainer"])], job={"mode": "collective"},
                         extra_node_fields={"node1": {"python": str(slow)}, "local0": {"python": str(slow)}})
    doc = yaml.safe_load(path.read_text())
    doc["nodes"].append({"name": "gone", "host": "127.0.0.9", "roles": ["trainer"], "workspace": str(tmp_path / "ws-gone")})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    session = Session(load_cluster(path))
    try:
        replies = {r.node: r for r in lifecycle.status(session, timeout=4)}
        for name in ("node1", "local0"):
            assert not replies[name].ok and replies[name].kind == NO_REPLY, replies[name]
            assert replies[name].error.startswith(f"{name}: connected, no reply within 4 s (status"), replies[name].error
        assert replies["node2"].ok
        assert replies["gone"].kind == UNREACHABLE and "unreachable: connection refused" in replies["gone"].error
        text, failed = report.status_text(list(replies.values()))
        assert failed
        assert re.search(r"^node1\s+-\s+NO REPLY", text, re.M) and re.search(r"^local0\s+-\s+NO REPLY", text, re.M), text
        assert re.search(r"^gone\s+-\s+UNREACHABLE", text, re.M) and re.search(r"^node2\s+-\s+no job", text, re.M), text
        # fab check, fab watch and the dashboard say it the same way.
        probes = {c.node: c for c in lifecycle.check(session, timeout=4)}
        text = report.check_text(list(probes.values()))
        assert re.search(r"^node1\s+NO REPLY", text, re.M) and re.search(r"^gone\s+UNREACHABLE", text, re.M), text
        collector = Collector(session)
        session.map(lambda t: collector.poll_node(t.node.name, timeout=4))  # in parallel, as fab watch polls
        text = "\n".join(watch.frame(collector.snapshot(), time.time(), time.time()))
        assert re.search(r"^node1\s+NO REPLY", text, re.M) and re.search(r"^gone\s+UNREACHABLE", text, re.M), text
        app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": "t" * 32})
        nodes = {n["name"]: n for n in app.test_client().get(
            "/api/cluster", headers={"Authorization": "Bearer " + "t" * 32, "Host": "127.0.0.1"}).get_json()["nodes"]}
        assert (nodes["node1"]["down"], nodes["gone"]["down"], nodes["node2"]["down"]) == ("no reply", "unreachable", None)
        # Slow no more, the slow nodes answer.
        release.touch()
        replies = {r.node: r for r in lifecycle.status(session, timeout=30)}
        assert replies["node1"].ok and replies["local0"].ok, replies
    finally:
        session.close()
