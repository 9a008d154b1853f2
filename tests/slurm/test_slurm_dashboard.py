"""The dashboard on a real Slurm cluster (tests/support/slurm_cluster.py): its Kill and its header go through
the cluster's backend, as `fab kill-all` and `fab watch` do, so Slurm's job ends CANCELLED (scancel), not
FAILED (a stop of the processes behind Slurm's back), and the job says who stopped it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.conftest import FAB, REPO
from tests.support.procscan import wait_for
from tests.support.slurm_job import SlurmJob
from tests.support.sshd import free_port

TOKEN = "slurm-dashboard-test-token"
BY = "the dashboard's Kill button"


@pytest.fixture(scope="module")
def job(slurm, tmp_path_factory):
    j = SlurmJob(tmp_path_factory.mktemp("project"), slurm)
    j.configure("python standin.py --period 0.2")
    j.fab("deploy", check=True)
    yield j
    j.fab("kill-all")


class Dashboard:
    """`fab dashboard` as a person runs it, with a token of the test's own; stopped by its pid."""

    def __init__(self, job: SlurmJob):
        self.port = free_port(["127.0.0.1"])
        self.proc = subprocess.Popen([FAB, "dashboard", f"--port={self.port}", "--interval=0.5"], cwd=REPO,
                                     env={**job.env(), "FABTRAIN_DASHBOARD_TOKEN": TOKEN}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def call(self, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method="POST" if body is not None else "GET",
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except (urllib.error.URLError, ConnectionError):
            return 0, {}

    def close(self) -> str:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)  # Ctrl+C: the dashboard stops, the job goes on
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
        return out


def test_the_dashboards_kill_cancels_the_slurm_job_as_kill_all_does_and_names_the_dashboard(job):
    job.submit()
    assert job.running(), job.describe()
    dashboard = Dashboard(job)
    try:
        # The header: Slurm's own line on the job, from the backend (as fab watch's).
        def header() -> str:
            return dashboard.call("/api/job")[1].get("scheduler") or ""

        wait_for(lambda: f"slurm job {job.slurm_job}: RUNNING" in header(), timeout=60, interval=0.5)
        assert f"slurm job {job.slurm_job}: RUNNING" in header(), (header(), dashboard.proc.poll())
        code, body = dashboard.call("/api/kill", {"grace": 2})
        assert code == 200 and body["ok"] is True, body
        assert body["nodes"] == [] and [line.split(",")[0] for line in body["place"]] == \
            [f"slurm job {job.slurm_job}: CANCELLED"], body
    finally:
        said = dashboard.close()
    assert job.wait_state("CANCELLED", "FAILED", "COMPLETED", timeout=30) == "CANCELLED", job.describe() + said
    assert wait_for(lambda: not job.leftovers(), timeout=5), job.leftovers()
    status = job.fab("status").stdout
    assert f"stopped by {BY}" in status and "CANCELLED" in status, status
    killed = [e for i in range(job.nodes) for e in job.events(i) if e.get("kind") == "killed"]
    assert killed and all(BY in str(e.get("reason")) for e in killed), killed
    assert not [e for i in range(job.nodes) for e in job.events(i) if "kill-all" in json.dumps(e)]
