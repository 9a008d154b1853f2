"""The jobs list and an overlay of two runs, in a real browser (Chromium, Playwright).

Two ended jobs' files are written directly (tests/support/synthetic.py) on two local
nodes, differing in one job.env value; the dashboard is served by waitress as
`fab dashboard` serves it, its history read from the nodes by node ops."""
from __future__ import annotations

import json

import pytest

from tests.support.synthetic import SyntheticJob, dashboard, local_cluster

TOKEN = "history-browser-token-0123456789abcdef"
pytestmark = [pytest.mark.timeout(180)]
A, B = "20260101-100000-aaaa", "20260101-110000-bbbb"


def ended_job(root, job_id, lr, outcome):
    nodes = {"node1": (str(root / "ws-node1"), ["trainer-0"]), "node2": (str(root / "ws-node2"), ["trainer-1"])}
    job = SyntheticJob(job_id, nodes).start(running=True)
    for node, (_, names) in nodes.items():
        path = job.job_dir(node) / "job.json"
        doc = json.loads(path.read_text())
        for p in doc["processes"]:
            p["env"] = {"LR": lr, "FABTRAIN_JOB_ID": job_id}
        doc["nodes"] = [{"name": "node1"}, {"name": "node2"}]
        path.write_text(json.dumps(doc))
        job.metrics(node, names[0], range(0, 300, 10))
        job.exit(node, names[0], 0 if outcome == "finished" else 3)
    return job


@pytest.fixture
def served(tmp_path):
    path = local_cluster(tmp_path, {"node1": ["pserver", "trainer"], "node2": ["trainer"]})
    jobs = [ended_job(tmp_path, A, "0.1", "finished"), ended_job(tmp_path, B, "0.01", "failed")]
    try:
        with dashboard(path, TOKEN) as url:
            yield url
    finally:
        for j in jobs:
            j.close()


def test_jobs_list_open_one_and_overlay_two(served, browser):
    page = browser.new_page()
    page.goto(f"{served}/?token={TOKEN}")
    page.wait_for_function("() => document.querySelectorAll('#jobs tbody tr').length === 2", timeout=30000)
    rows = page.locator("#jobs tbody tr")
    assert rows.nth(0).get_attribute("data-job") == B  # newest first
    assert rows.nth(0).locator("td").nth(4).inner_text().lower() == "failed"
    assert rows.nth(1).locator("td").nth(4).inner_text().lower() == "finished"
    assert "trainer-1 on node2 exited with code 3" in rows.nth(0).locator(".badge").get_attribute("title")

    rows.nth(1).locator("a.open").click()  # an old job: its charts, events, logs
    page.wait_for_function("() => document.querySelectorAll('#history-loss .scatterlayer .trace').length === 1")
    assert page.locator("#history-title").inner_text() == A

    # "compare checked" can do nothing until two jobs are checked, and its tooltip says so.
    compare = page.locator("#jobs-compare")
    assert compare.is_disabled() and compare.get_attribute("title") == "check two jobs or more to compare them (0 checked)"
    rows.nth(0).locator("input.pick").check()
    assert compare.is_disabled() and page.locator(".compare-wrap").get_attribute("title").endswith("(1 checked)")
    rows.nth(1).locator("input.pick").check()
    assert compare.is_enabled()
    compare.click()
    page.wait_for_function("() => document.querySelectorAll('#history-loss .scatterlayer .trace').length === 2")
    legend = page.locator("#history-loss .legend").text_content()
    assert f"{A} (LR=0.1)" in legend and f"{B} (LR=0.01)" in legend  # labelled by what differed
    assert page.locator("#history-sps .scatterlayer .trace").count() == 2
    page.locator("#history-x").select_option("wall")
    page.wait_for_function("() => document.querySelector('#history-loss .xtitle').textContent.includes('seconds')")
