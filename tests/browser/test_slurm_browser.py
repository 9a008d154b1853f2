"""A job on the tests' real Slurm cluster in the dashboard, in Chromium: the dashboard reads the node
workspaces on the shared filesystem like any nodes', so it shows the job, its trainers and its end."""
from __future__ import annotations

import pytest

from tests.support.slurm_job import SlurmJob
from tests.support.synthetic import dashboard

TOKEN = "slurm-browser-token-0123456789abcdef"
pytestmark = [pytest.mark.timeout(300)]


def test_the_dashboard_shows_a_slurm_job_running_then_killed(slurm, tmp_path, browser):
    job = SlurmJob(tmp_path, slurm)
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
            job.fab("kill-all", check=True)
            page.wait_for_function("() => document.getElementById('job-state').textContent === 'killed'",
                                   timeout=60000)
    finally:
        job.fab("kill-all")
    assert not job.leftovers()
