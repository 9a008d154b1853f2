"""A job on the tests' real Slurm cluster in the dashboard, in Chromium: the dashboard reads the node
workspaces on the shared filesystem like any nodes', so it shows the job, its trainers, its end and its place
in the jobs history, and Slurm's own state of it beside fabtrain's."""
from __future__ import annotations

import pytest

from tests.support.procscan import wait_for
from tests.support.slurm_job import SlurmJob
from tests.support.synthetic import dashboard

TOKEN = "slurm-browser-token-0123456789abcdef"
pytestmark = [pytest.mark.timeout(300)]


def test_the_dashboard_shows_a_slurm_job_running_then_killed(slurm, tmp_path, browser, monkeypatch):
    job = SlurmJob(tmp_path, slurm)
    for name in ("SLURM_CONF", "FABTRAIN_STATE_DIR"):  # the dashboard runs here, as `fab dashboard` would
        monkeypatch.setenv(name, job.env()[name])
    job.configure("python standin.py --period 0.2")
    job.fab("deploy", check=True)
    job.submit()
    try:
        assert job.running(), job.describe()
        with dashboard(job.path, TOKEN) as url:
            page = browser.new_page()
            page.goto(f"{url}/?token={TOKEN}")
            page.wait_for_function("() => document.getElementById('job-state').textContent === 'running'",
                                   timeout=60000)
            assert page.locator("#job-id").inner_text() == job.job_id
            page.wait_for_function("() => document.querySelectorAll('#trainers tbody tr').length === 3", timeout=30000)
            page.wait_for_function("() => document.querySelectorAll('#nodes tbody tr').length === 3", timeout=30000)
            nodes = page.locator("#nodes tbody").inner_text()
            assert all(f"node{i}" in nodes for i in range(3)), nodes
            # Slurm's own word on the job, read with squeue, beside fabtrain's state.
            running = f"slurm job {job.slurm_job}: RUNNING on n[1-3]"
            page.wait_for_function(f"() => document.getElementById('job-scheduler').textContent === {running!r}",
                                   timeout=30000)
            job.fab("kill-all", check=True)
            page.wait_for_function("() => document.getElementById('job-state').textContent === 'killed'",
                                   timeout=60000)
            page.wait_for_function("() => document.getElementById('job-scheduler').textContent"
                                   f".startsWith('slurm job {job.slurm_job}: CANCELLED')", timeout=30000)
            # The jobs history lists it, read from the nodes' workspaces on the shared filesystem.
            state = page.locator(f"#jobs tbody tr[data-job='{job.job_id}'] td:nth-child(5)")

            def listed_killed():  # the list is read again on Refresh (the server reuses an answer for 5 s)
                page.locator("#jobs-refresh").click()
                page.wait_for_timeout(500)
                return state.count() == 1 and state.inner_text().lower() == "killed"
            assert wait_for(listed_killed, timeout=30, interval=1), page.locator("#jobs tbody").inner_text()
    finally:
        job.fab("kill-all")
    assert not job.leftovers()
