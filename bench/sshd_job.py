"""One job on real sshd nodes (root's account, 127.0.0.x), for the benchmarks that break a running job
(teardown.py, restart.py, elastic.py): the nodes, the cluster file, `fab` run as a user runs it, and a close that
leaves nothing behind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.procscan import live_marked  # noqa: E402
from tests.support.sshd import SshdCluster, free_port, write_cluster  # noqa: E402

FAB = str(Path(sys.executable).parent / "fab")


class SshdJob:
    def __init__(self, root: Path, count: int, roles, job: dict, cluster=SshdCluster, node_fields: dict | None = None):
        """count sshd nodes of `cluster` (an SshdCluster, or tests/support/netns.py's NetnsCluster: each node its
        own network); roles(names) -> [(node, [roles])]; job: the cluster file's job section, its watchdog's
        port chosen here unless it names one (a port of nodes with their own networks is not probed from here);
        node_fields: more keys of a node's entry, by name ({"node4": {"spare": True}})."""
        self.root, self.sshd = root, cluster(root / "sshd", count=count)
        self.names = [node.name for node in self.sshd.nodes]
        self.ws = {name: root / f"ws-{name}" for name in self.names}
        self.path = root / "cluster.yaml"
        self.env = {**os.environ, "FABTRAIN_CLUSTER": str(self.path), "FABTRAIN_STATE_DIR": str(root / "state")}
        if "port" not in job["watchdog"]:
            job["watchdog"]["port"] = free_port([node.address for node in self.sshd.nodes])
        write_cluster(self.path, self.sshd, ssh_nodes=roles(self.names), job=job, extra_node_fields=node_fields)
        self.job_id = None

    def fab(self, *args: str) -> str:
        out = subprocess.run([FAB, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"fab {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def jd(self, name: str) -> Path:
        """The job's directory on node `name`."""
        return self.ws[name] / "jobs" / self.job_id

    def run_record(self, node: str, name: str) -> dict:
        return json.loads((self.jd(node) / "run" / f"{name}.json").read_text())

    def first_record(self, node: str, name: str, since: float) -> dict | None:
        """The trainer's first metrics record written at or after `since` (a generation's start)."""
        try:
            lines = (self.jd(node) / "metrics" / f"{name}.jsonl").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r.get("step"), (int, float)) and r.get("ts", 0) >= since:
                return r
        return None

    def close(self) -> None:
        if live_marked(self.ws.values()):
            subprocess.run([FAB, "kill-all", "--grace", "1"], cwd=REPO, env=self.env, capture_output=True)
        self.sshd.close()
        shutil.rmtree(self.root, ignore_errors=True)
