"""A fabtrain project on the tests' Slurm cluster (tests/support/slurm_cluster.py): a cluster file with a
`scheduler:` section, its code, a workspace the "compute nodes" share with `fab` (one machine), and fab
run as a user would, with SLURM_CONF pointing at the test cluster."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port

PROGRAMS = REPO / "tests" / "programs"


class SlurmJob:
    def __init__(self, root: Path, slurm, nodes: int = 3):
        self.root, self.slurm, self.nodes = root, slurm, nodes
        self.path = root / "cluster.yaml"
        self.state = root / "controller-state"
        self.ws = root / "ws"
        self.code = root / "code"
        self.code.mkdir(parents=True, exist_ok=True)
        for program in PROGRAMS.glob("*.py"):  # the test programs and what they import
            shutil.copy(program, self.code / program.name)
        self.job_id: str | None = None
        self.slurm_job: str | None = None

    def configure(self, command: str, nodes: int | None = None, mode: str = "collective", scheduler: dict | None = None,
                  pserver: str | None = None, job: dict | None = None, **watchdog) -> None:
        port = free_port(["127.0.0.1"])
        doc = {
            "cluster": {"name": "slurmtest", "workspace": str(self.ws)},
            "scheduler": {"kind": "slurm", "nodes": nodes or self.nodes, "partition": "debug", "time": "10:00",
                          **(scheduler or {})},
            "job": {"name": "onslurm", "mode": mode, "master_port": port, "code": str(self.code),
                    "trainer": {"command": command},
                    "watchdog": {"interval": 0.5, "hang_timeout": 30, "grace": 2, "port": port + 1, **watchdog}},
        }
        if mode == "pserver":
            doc["job"]["pserver"] = {"port": port + 2, "command": pserver or command}
        doc["job"].update(job or {})
        self.path.write_text(yaml.safe_dump(doc))

    def env(self) -> dict:
        return self.slurm.env({**os.environ, "FABTRAIN_CLUSTER": str(self.path),
                               "FABTRAIN_STATE_DIR": str(self.state)})

    def fab(self, *args, timeout: float = 120, check: bool | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run([FAB, *args], cwd=REPO, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert (out.returncode == 0) == check, f"fab {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out

    def submit(self, *args: str) -> subprocess.CompletedProcess:
        out = self.fab("start-trainers", *args, check=True)
        self.job_id, self.slurm_job = re.search(r"job (\S+): submitted as slurm job (\d+)", out.stdout).groups()
        return out

    # -- what is on the shared filesystem ------------------------------------------------------------

    def node_ws(self, i: int) -> Path:
        return self.ws / f"node{i}"

    def jd(self, i: int) -> Path:
        return self.node_ws(i) / "jobs" / self.job_id

    def health(self, i: int) -> dict | None:
        try:
            return json.loads((self.jd(i) / "health.json").read_text())
        except (OSError, ValueError):
            return None

    def run_record(self, i: int, name: str) -> dict | None:
        try:
            return json.loads((self.jd(i) / "run" / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    def program(self, i: int, name: str) -> int:
        """The pid of a process's program (its run record names it once the launcher has forked it)."""
        found = wait_for(lambda: (self.run_record(i, name) or {}).get("program_pid"), timeout=10)
        assert found, f"{name} on node{i}: no program in its run record"
        return found

    def events(self, i: int) -> list[dict]:
        try:
            return [json.loads(line) for line in (self.jd(i) / "events.jsonl").read_text().splitlines() if line]
        except OSError:
            return []

    def slurm_state(self) -> str:
        """Slurm's state of the job, read as an admin would (scontrol)."""
        out = self.slurm.run("scontrol", "show", "job", "-o", self.slurm_job, check=False).stdout
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else "?"

    def wait_state(self, *states: str, timeout: float = 60) -> str:
        wait_for(lambda: self.slurm_state() in states, timeout=timeout, interval=0.2)
        return self.slurm_state()

    def running(self, timeout: float = 60) -> bool:
        """Every trainer has written a metrics record and every agent knows every peer."""
        def up():
            return all((self.jd(i) / "metrics" / f"trainer-{i}.jsonl").exists()
                       and (self.jd(i) / "metrics" / f"trainer-{i}.jsonl").stat().st_size > 0
                       and len((self.health(i) or {}).get("peers") or {}) == self.nodes for i in range(self.nodes))
        return bool(wait_for(up, timeout=timeout, interval=0.1))

    def starts(self, i: int) -> list[dict]:
        """What tests/programs/resumable.py on node i wrote at each of its starts: the restart count it was
        given and the step its checkpoint let it resume from."""
        path = self.jd(i) / "checkpoints" / f"trainer-{i}.starts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def requeued_and_back(self, timeout: float = 30) -> None:
        """The job went back to PENDING; Slurm's hold before it runs again (BeginTime) lifted as an admin would."""
        assert self.wait_state("PENDING", timeout=timeout) == "PENDING", self.describe()
        # Slurm's hold is there for a reason: each slurmd revoked the last attempt's credential at the requeue, to
        # the second, and refuses (fails the job: "Job credential revoked") a launch whose credential is of that
        # same second. An admin lifts it after the old allocation is gone, in a later second.
        assert wait_for(lambda: "COMPLETING" not in self.slurm.run("scontrol", "show", "job", "-o", self.slurm_job,
                                                                   check=False).stdout, timeout=30), self.describe()
        time.sleep(1.5)
        self.slurm.run("scontrol", "update", f"jobid={self.slurm_job}", "StartTime=now")

    def leftovers(self) -> list:
        return live_marked([self.node_ws(i) for i in range(self.nodes)])

    def slurm_output(self) -> str:
        folder = self.ws / "slurm" / (self.job_id or "")
        return "\n".join(p.read_text() for p in sorted(folder.glob("slurm-*.out")))

    def describe(self) -> str:
        return f"slurm: {self.slurm_state()}\n{self.slurm_output()}\n" + self.fab("status").stdout
