"""A collective job of one stand-in trainer a node on the network-namespace nodes of tests/support/netns.py,
started by `fab` from the root namespace: what tests/sshd/test_partitions_netns.py and bench/partitions.py drive."""
from __future__ import annotations

import json
import re

from tests.support.procscan import wait_for
from tests.support.sshd import write_cluster

NODES = ("node1", "node2", "node3")
INTERVAL, GRACE = 1.0, 2.0
MASTER_PORT = 29500  # each node has its own network: no other test's port is in the way
TRAINER = "python tests/programs/fakejob.py --steps 0 --period 0.2"


def _started(pid: int) -> tuple[int, str]:
    """A process by its pid and start time (a pid is reused; the pair is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return pid, f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return pid, ""


class PartitionJob:
    """A collective job of one stand-in trainer a node, started by `fab` from the root namespace."""

    def __init__(self, fab, root, net, trainer_args="", **watchdog):
        self.fab_, self.net, self.root = fab, net, root
        self.ws = {n: root / f"ws-{n}" for n in NODES}
        wd = {"interval": INTERVAL, "grace": GRACE, "hang_timeout": 60, "port": 7180, **watchdog}
        self.path = write_cluster(root / "c.yaml", net, ssh_nodes=[(n, ["trainer"]) for n in NODES],
                                  job={"mode": "collective", "master_port": MASTER_PORT,
                                       "trainer": {"per_node": 1, "command": f"{TRAINER} {trainer_args}".strip()}, "watchdog": wd})
        deploy = () if (root / "ws-node1" / "code").exists() else ("deploy",)
        # What runs in the namespaces before the job starts is not the job's: the node side of an earlier
        # test's rsync, stranded by a cut on a connection that is gone, lives until the node's TCP gives up.
        self.before = {n: {_started(pid) for pid in net.pids(n)} for n in NODES}
        out = self.fab(*deploy, "start-trainers", check=True)
        self.job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
        assert wait_for(self.running, timeout=60), self.describe()

    def fab(self, *args, check=None, timeout=120):
        return self.fab_(*args, cluster=self.path, check=check, timeout=timeout)

    def jd(self, node):
        return self.ws[node] / "jobs" / self.job_id

    def events(self, node, kind=None):
        try:
            lines = (self.jd(node) / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [e for e in map(json.loads, filter(str.strip, lines)) if kind is None or e["kind"] == kind]

    def health(self, node):
        try:
            return json.loads((self.jd(node) / "health.json").read_text())
        except (OSError, ValueError):
            return {}

    def run_record(self, node, name):
        try:
            return json.loads((self.jd(node) / "run" / f"{name}.json").read_text())
        except (OSError, ValueError):
            return {}

    def running(self) -> bool:
        """Every trainer wrote a record and every agent has an answered beat (a lease)."""
        return all((self.jd(n) / "metrics" / f"trainer-{i}.jsonl").exists() and
                   (self.health(n).get("coordinator") or {}).get("lease") for i, n in enumerate(NODES))

    def job_pids(self, node) -> list[int]:
        """Every process of the node's namespace but sshd's (the listener and the sessions fab opens) and those
        that were there before the job started."""
        out = []
        for pid in self.net.pids(node):
            if _started(pid) in self.before[node]:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")[0]
            except OSError:
                continue
            if cmd and not cmd.startswith(b"sshd"):
                out.append(pid)
        return out

    def describe(self) -> str:
        out = []
        for n in NODES:
            out += [f"{n} {e['kind']}: {e.get('reason')}" for e in self.events(n)[-12:]]
            out.append(f"{n} pids {self.job_pids(n)}")
            for pid in self.job_pids(n):  # what each is, and under whom
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
                    with open(f"/proc/{pid}/stat") as f:
                        parent = f.read().rsplit(")", 1)[1].split()[1]
                except OSError:
                    continue
                out.append(f"{n}   {pid} (parent {parent}): {cmd}")
        return "\n".join(out)

    def end(self):
        """Healed, killed, and nothing of the job left in any namespace."""
        for n in NODES:
            self.net.heal(n)
        self.fab("kill-all", "--grace", "1")
        assert wait_for(lambda: not any(self.job_pids(n) for n in NODES), timeout=20), self.describe()


def stopped_at(job, node, name) -> float | None:
    """When the node's agent saw `name` end (its `killed` event)."""
    ends = [e["ts"] for e in job.events(node, "killed") if e.get("name") == name]
    return min(ends) if ends else None


