"""A job on local nodes (no SSH), driven through `fab` as a user would: its files, events and pids."""
import json
import os
import re
import subprocess
from pathlib import Path

from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked
from tests.support.sshd import free_port, write_cluster

FAKE = "python tests/programs/fakejob.py"


class LocalJob:
    def __init__(self, root: Path, nodes, job):
        self.root = root
        self.path = write_cluster(root / "cluster.yaml", None, local_nodes=nodes, job=job)
        self.ws = {n: root / f"ws-{n}" for n, _ in nodes}
        self.state = root / "state"
        self.job_id = None

    def fab(self, *args, check=None, timeout=90):
        env = {**os.environ, "FABTRAIN_CLUSTER": str(self.path), "FABTRAIN_STATE_DIR": str(self.state)}
        out = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert (out.returncode == 0) == check, f"fab {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
        m = re.search(r"job (\S+): \w+ started", out.stdout)
        if m:
            self.job_id = m.group(1)
        return out

    def jd(self, node):
        return self.ws[node] / "jobs" / self.job_id

    def health(self, node):
        try:
            return json.loads((self.jd(node) / "health.json").read_text())
        except (OSError, ValueError):
            return None

    def events(self, node):
        try:
            return [json.loads(x) for x in (self.jd(node) / "events.jsonl").read_text().splitlines()]
        except OSError:
            return []

    def program(self, node, name):
        """The pid fabtrain shows: the program its launcher started (run/<name>.json)."""
        return json.loads((self.jd(node) / "run" / f"{name}.json").read_text())["program_pid"]

    def cleanup(self):
        if live_marked(self.ws.values()):
            self.fab("kill-all", "--grace", "1")


def watched_job(local_job, command: str, hang_timeout: float, **env: str):
    """`command` as the one trainer of a collective job on one local node (the `local_job` fixture's maker),
    watched closely: interval 0.5 s, `hang_timeout`, grace 1 s, startup_timeout 300 s."""
    return local_job([("n0", ["trainer"])], mode="collective", master_port=free_port(["127.0.0.1"]), env=env,
                     trainer={"command": command},
                     watchdog={"interval": 0.5, "hang_timeout": hang_timeout, "grace": 1, "startup_timeout": 300,
                               "port": free_port(["127.0.0.1"])})
