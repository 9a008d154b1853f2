"""A restarted job (on_failure restart) in a real browser (Chromium, Playwright): the generation and
the restarts left in the header, a mark at the restart on the loss and throughput charts, the
restart's events in their own colour.

The job's files are written directly (tests/support/synthetic.py) on two local nodes, as the agents write
them across a restart: metrics up to step 200, the `restarting` and `restarted` events, then the
next generation's records from step 210 (it resumed from a checkpoint). The dashboard is served by
waitress as `fab dashboard` serves it and reads the nodes through node ops."""
from __future__ import annotations

import time

import pytest

from tests.support.synthetic import SyntheticJob, dashboard, local_cluster

TOKEN = "restart-browser-token-0123456789abcdef"
JOB = "20260102-100000-4e57"
REASON = "trainer-1 on node2 killed by SIGKILL"
pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture
def served(tmp_path):
    path = local_cluster(tmp_path, {"node1": ["pserver", "trainer"], "node2": ["trainer"]})
    nodes = {"node1": (str(tmp_path / "ws-node1"), ["trainer-0"]), "node2": (str(tmp_path / "ws-node2"), ["trainer-1"])}
    job = SyntheticJob(JOB, nodes).start(running=True)
    now = time.time()
    failed_at = now - 20
    for node, (_, (name,)) in nodes.items():
        job.metrics(node, name, range(0, 210, 10), t0=failed_at - 21 * 0.2)  # generation 0: steps 0..200
    for node in nodes:
        job.event(node, kind="restarting", ts=failed_at + 0.1, generation=1, backoff=10.0, restarts_left=2,
                  reason=REASON)
        job.event(node, kind="restarted", ts=failed_at + 10.5, generation=1)
    for node, (_, (name,)) in nodes.items():
        job.metrics(node, name, range(210, 400, 10), t0=failed_at + 12)  # generation 1 resumed at step 210
        job.health(node, job={"status": "running", "on_failure": "restart", "generation": 1, "restarts_left": 2})
    try:
        with dashboard(path, TOKEN, REFRESH_MS=500) as url:
            yield url
    finally:
        job.close()


def test_a_restart_is_marked_on_the_charts_in_the_header_and_in_the_events(served, browser):
    page = browser.new_page()
    page.goto(f"{served}/?token={TOKEN}")
    page.wait_for_function("() => document.getElementById('job-id').textContent === '%s'" % JOB, timeout=30000)
    page.wait_for_function("() => document.getElementById('job-counts').textContent.includes('generation 1')",
                           timeout=30000)
    assert "generation 1, 2 restarts left" in page.locator("#job-counts").inner_text()
    page.wait_for_selector("#verdict[data-state='running']")
    assert page.locator("#verdict .sentence").text_content() == \
        "job running: 2 of 2 processes on 2 nodes (generation 1, 2 restarts left)"
    for chart in ("chart-loss", "chart-sps"):
        # The mark sits at the first step recorded after the restart: 210, not the failure's 200.
        page.wait_for_function("""id => {
            const l = (document.getElementById(id) || {}).layout || {};
            return (l.shapes || []).some(s => s.x0 === 210) &&
                   (l.annotations || []).some(a => a.text === 'restart 1' && a.hovertext.includes('SIGKILL'));
        }""", arg=chart, timeout=30000)
        assert page.locator(f"#{chart} .annotation-text", has_text="restart 1").count() == 1  # drawn, not only data
    page.wait_for_function("() => document.querySelectorAll('#events li[data-kind=restarting]').length === 2",
                           timeout=30000)
    restarting = page.locator("#events li[data-kind=restarting]").first
    assert REASON in restarting.inner_text()
    assert page.locator("#events li[data-kind=restarted]").count() == 2
    # Both read in one go: the list is redrawn at every refresh, and a replaced item has no style.
    colours = page.evaluate("""() => ['restarting', 'restarted'].map(k =>
        getComputedStyle(document.querySelector(`#events li[data-kind=${k}] .kind`)).color)""")
    assert colours == ["rgb(224, 160, 48)"] * 2  # the restart colour, the charts' mark's
