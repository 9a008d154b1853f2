"""A job on three real sshd nodes, as the fault tests drive it (tests/sshd/test_faults_ssh.py,
tests/sshd/test_watchdog_ssh.py, tests/sshd/test_restart_ssh.py): pserver on node1 (the coordinator's node), trainers on node2
and node3, each node its own workspace, the agents on."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from fabtrain.node import procfs
from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port, write_cluster

NODES = ("node1", "node2", "node3")
HANG_TIMEOUT = 3.0


class Job:
    """The module's cluster: one cluster file, three workspaces, deployed once."""

    def __init__(self, root: Path, sshd, program: str):
        self.root, self.sshd, self.program_cmd = root, sshd, program
        self.path = root / "cluster.yaml"
        self.state = root / "controller-state"
        self.watchdog_port = free_port([n.address for n in sshd.nodes])
        self.pserver_port = free_port([n.address for n in sshd.nodes])
        self.ws = {n: root / f"ws-{n}" for n in NODES}
        self.job_id = None
        self.seen: dict[tuple[int, int], bool] = {}  # (pid, start ticks) -> is an agent's: every job process named

    def configure(self, trainer_args: str = "", pserver_args: str = "", **watchdog) -> None:
        wd = {"interval": 1, "hang_timeout": HANG_TIMEOUT, "grace": 2, "port": self.watchdog_port, **watchdog}
        write_cluster(self.path, self.sshd, ssh_nodes=[("node1", ["pserver"]), ("node2", ["trainer"]),
                                                       ("node3", ["trainer"])],
                      job={"name": "faults",
                           "pserver": {"port": self.pserver_port, "command": f"{self.program_cmd} {pserver_args}".strip()},
                           "trainer": {"command": f"{self.program_cmd} {trainer_args}".strip()}, "watchdog": wd})

    def fab(self, *args, timeout=90, check=None):
        env = {**os.environ, "FABTRAIN_CLUSTER": str(self.path), "FABTRAIN_STATE_DIR": str(self.state)}
        out = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert (out.returncode == 0) == check, f"fab {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out

    def start(self, trainer_args: str = "", pserver_args: str = "", wait: bool = True, **watchdog) -> str:
        self.configure(trainer_args, pserver_args, **watchdog)
        assert not self.leftovers(), f"a previous test left processes behind: {self.leftovers()}"
        for ws in self.ws.values():
            for f in ws.glob("*.pid"):
                f.unlink()
        out = self.fab("start-pserver", "start-trainers", check=True)
        assert "warning" not in out.stdout, out.stdout
        self.job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
        if not wait:
            return self.job_id
        # Running: every trainer has written metrics and every agent has met the coordinator.
        assert wait_for(lambda: all(len(self.metrics(n, f"trainer-{i}")) >= 2 for i, n in enumerate(("node2", "node3")))
                        and all(set((self.health(n) or {}).get("peers") or {}) == set(NODES) for n in NODES),
                        timeout=20), self.describe()
        self.collect()
        return self.job_id

    def collect(self) -> None:
        """Remember every process of the job a test can name: launchers and programs from the run
        records, and what the stand-in wrote to <workspace>/*.pid (its child, an escaped descendant)."""
        for n in NODES:
            for f in self.jd(n).glob("run/*.json") if self.job_id else []:
                try:
                    record = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                for pid in (record.get("pid"), record.get("program_pid")):
                    self._remember(pid, f.stem == "agent")
            for f in self.ws[n].glob("*.pid"):
                self._remember(int(f.read_text().strip() or 0), False)

    def _remember(self, pid, agent: bool) -> None:
        p = procfs.stat(pid) if pid else None
        if p is not None and not p.dead:
            self.seen[(pid, p.start_ticks)] = agent

    def known_alive(self, agents: bool = True) -> list[tuple[int, str]]:
        """Named job processes still in /proc (whatever their environment or session)."""
        out = []
        for (pid, ticks), agent in sorted(self.seen.items()):
            p = procfs.stat(pid)
            if p is not None and p.start_ticks == ticks and not (p.dead and p.ppid == 1) and (agents or not agent):
                out.append((pid, f"{p.state} {' '.join(procfs.cmdline(pid))}"))
        return out

    def jd(self, node: str) -> Path:
        return self.ws[node] / "jobs" / self.job_id

    def run(self, node: str, name: str) -> dict:
        return json.loads((self.jd(node) / "run" / f"{name}.json").read_text())

    def program(self, node: str, name: str) -> int:
        """The pid fabtrain shows: the program its launcher started (run/<name>.json's program_pid)."""
        pid = wait_for(lambda: self.run(node, name).get("program_pid"), timeout=5)
        assert pid and ppid(pid) == self.run(node, name)["pid"], f"{name} on {node}: no program under its launcher"
        return pid

    def agent(self, node: str) -> int:
        return self.program(node, "agent")

    def metrics(self, node: str, name: str) -> list[dict]:
        try:
            return [json.loads(line) for line in (self.jd(node) / "metrics" / f"{name}.jsonl").read_text().splitlines()]
        except (OSError, ValueError):
            return []

    def health(self, node: str) -> dict | None:
        try:
            return json.loads((self.jd(node) / "health.json").read_text())
        except (OSError, ValueError):
            return None

    def events(self, node: str | None = None) -> list[dict]:
        out = []
        for n in [node] if node else NODES:
            try:
                out += [json.loads(line) for line in (self.jd(n) / "events.jsonl").read_text().splitlines()]
            except OSError:
                pass
        return sorted(out, key=lambda e: e["ts"])

    def kinds(self, node: str | None = None) -> list[str]:
        return [e["kind"] for e in self.events(node)]

    def clean(self) -> None:
        """Whatever a test left running (it failed half-way): gone before the next one."""
        if self.leftovers():
            self.fab("kill-all", "--grace", "1")

    def leftovers(self, agents: bool = True) -> list:
        """Job processes alive: by the job marker, and every process the test named (/proc, not only the marker)."""
        found = live_marked(self.ws.values())
        if not agents:
            found = [f for f in found if "fabtrain.node.agent" not in f[1] and "fabtrain-keeper" not in f[1]]
        return sorted(set(found) | set(self.known_alive(agents)))

    def wait_gone(self, since: float, timeout: float = 15.0) -> float:
        """Seconds from `since` until no job process (agents aside) is alive on any node; then the agents go too."""
        self.collect()
        assert wait_for(lambda: not self.leftovers(agents=False), timeout=timeout, interval=0.02), self.describe()
        gone = time.time() - since
        assert wait_for(lambda: not self.leftovers(), timeout=timeout), self.describe()
        return gone

    def describe(self) -> str:
        lines = [f"leftovers: {self.leftovers()}"]
        for n in NODES:
            for f in sorted(self.jd(n).glob("logs/*.log")) if self.job_id else []:
                lines.append(f"--- {n} {f.name}\n{f.read_text()[-1500:]}")
        lines += [json.dumps(e) for e in self.events()] if self.job_id else []
        return "\n".join(lines)


@contextmanager
def deployed(root: Path, sshd, program: str):
    """A test module's Job: configured with the defaults, deployed once, cleaned at the end."""
    job = Job(root, sshd, program)
    job.configure()
    job.fab("deploy", check=True)
    try:
        yield job
    finally:
        job.clean()


def pids():
    return procfs.pids()


def ppid(pid: int) -> int | None:
    p = procfs.stat(pid)
    return p.ppid if p else None


def assert_failed_status(job: Job, *needles: str) -> str:
    out = job.fab("status")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "JOB FAILED" in out.stdout, out.stdout
    for needle in needles:
        assert needle in out.stdout, out.stdout
    return out.stdout
