"""The dashboard the morning after, in a real browser (Chromium, Playwright): for every outcome of a
job the page says what happened first, in the words `fab status` prints, links the event and the
log line where a failure began, disables a Kill button that cannot do anything (saying why), and
collapses a chart with nothing to show to one line that says why.

Each outcome's node files are written directly (tests/support/synthetic.py) on local nodes as the node ops
and the agents write them (a killed job is stopped by a real `kill-all`); the dashboard is served
by waitress as `fab dashboard` serves it; `fab status`'s text comes from its own code path over the
same nodes. With FABTRAIN_UPDATE_SCREENSHOT=1 the failed and restarting pages are saved to docs/
(dashboard-failed.png, dashboard-restarting.png); a plain run leaves them in artifacts/.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller import lifecycle, report
from fabtrain.remote.session import Session
from tests.support.synthetic import SyntheticJob, dashboard, local_cluster
from tests.support import REPO
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS

TOKEN = "outcomes-browser-token-0123456789abcdef"
JOB = "20260103-070000-0c0c"
NAMES = {"node1": ["pserver-0", "trainer-0"], "node2": ["trainer-1"]}
CAUSE = "trainer-1 on node2 killed by SIGKILL (exit code 137)"
pytestmark = [pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()


# -- the outcomes, as the nodes' files say them ------------------------------------------------------


def loss_only(job: SyntheticJob, node: str, name: str, steps: range, t0: float) -> None:
    """Metrics records with a loss and no samples/s (a job that does not report throughput)."""
    rank = int(name.rpartition("-")[2])
    job.append(node, f"metrics/{name}.jsonl", "".join(
        json.dumps({"ts": t0 + i, "role": "trainer", "rank": rank, "step": s, "loss": 7.0 - s / 100}) + "\n"
        for i, s in enumerate(steps)).encode())


def health(job: SyntheticJob, status: str, states: dict | None = None, records: bool = True, events=(), **fields):
    """Each node's health.json: the agent's view of the job and of its processes."""
    now = time.time()
    for node, names in NAMES.items():
        procs = [{"name": n, "state": (states or {}).get(n, "running"),
                  "last_record": now - 1 if records and n.startswith("trainer") else None} for n in names]
        job.health(node, processes=procs, events=[e for e in events if e["node"] == node],
                   job={"status": status, "on_failure": "kill-job", "generation": 0} | fields)


def teardown(job: SyntheticJob, at: float, failed_kind: str) -> list[dict]:
    """trainer-1 on node2 is killed by SIGKILL; the agents note it and stop the rest (exit 143)."""
    job.log("node2", "trainer-1", ["step 190 loss 5.10", "step 200 loss 5.00 (last words)"])
    job.exit("node2", "trainer-1", 137)
    job.event("node2", kind="exited", name="trainer-1", role="trainer", rank=1, exit_code=137, signal="SIGKILL",
              reason="killed by SIGKILL (exit code 137)", ts=at)
    for node in NAMES:
        job.event(node, kind=failed_kind, reason=CAUSE, origin="node2", on_failure="kill-job", ts=at + 0.2)
    for name in ("pserver-0", "trainer-0"):
        job.exit("node1", name, 143)
        job.event("node1", kind="killed", name=name, role=name.split("-")[0], rank=0, signal="SIGTERM",
                  reason="killed by SIGTERM (exit code 143): job failed", ts=at + 0.5)
    return [{"ts": at + 0.2, "node": node, "kind": failed_kind, "reason": CAUSE, "origin": "node2"} for node in NAMES]


def beat(job: SyntheticJob) -> None:
    """Each node's health.json written again, now, as an agent writes it every interval."""
    for node in NAMES:
        path = job.job_dir(node) / "health.json"
        doc = json.loads(path.read_text()) | {"ts": time.time()}
        tmp = path.with_name(f"health.json.{threading.get_ident()}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)



def keep_beating(job: SyntheticJob, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        beat(job)


ENDED = {"pserver-0": "killed", "trainer-0": "killed", "trainer-1": "killed"}


def running(job, now):
    for node, names in NAMES.items():
        for name in names:
            if name.startswith("trainer"):
                loss_only(job, node, name, range(0, 60, 2), now - 40)
    health(job, "running", startup_deadline=now - 60)


def starting(job, now):
    health(job, "running", records=False, startup_deadline=now + 300)


def restarting(job, now):
    for node, names in NAMES.items():
        job.metrics(node, names[-1], range(0, 210, 10), t0=now - 30)
    failed = teardown(job, now - 10, "failure")
    restart = [{"ts": now - 9.5, "node": node, "kind": "restarting", "generation": 1, "backoff": 300.0,
                "restarts_left": 2, "origin": "node2", "reason": f"job failed ({CAUSE}); restart 1 in 300 s"}
               for node in NAMES]
    for e in restart:
        job.event(**e)
    health(job, "restarting", ENDED, events=failed + restart, reason=CAUSE, origin="node2", on_failure="restart",
           generation=1, restarts_left=2)


def finished(job, now):
    for node, names in NAMES.items():
        job.metrics(node, names[-1], range(0, 100, 10), t0=now - 30)
    job.exit("node1", "trainer-0", 0)
    job.exit("node2", "trainer-1", 0)
    job.exit("node1", "pserver-0", 143)
    for node in NAMES:
        job.event(node, kind="finished", reason="every trainer exited with code 0", ts=now - 2)
    health(job, "finished", {"pserver-0": "killed", "trainer-0": "exited", "trainer-1": "exited"},
           reason="every trainer exited with code 0")


def failed(job, now):
    for node, names in NAMES.items():
        job.metrics(node, names[-1], range(0, 210, 10), t0=now - 30)
    events = teardown(job, now - 10, "job_failed")
    health(job, "failed", ENDED, events=events, reason=CAUSE, origin="node2")


def killed(job, now):
    running(job, now)


OUTCOMES = {  # outcome -> (files, the sentence as a pattern, whether Kill can do anything)
    "running": (running, r"job running: 3 of 3 processes on 2 nodes", True),
    "starting": (starting, r"job starting: waiting for the first metrics record of trainer-0, trainer-1", True),
    "restarting": (restarting, r"JOB RESTARTING after " + re.escape(CAUSE) +
                               r": generation 1 starts in 4m \d\ds, 2 restarts left after it", True),
    "finished": (finished, r"job finished: every trainer exited with code 0  \[node1, node2\]", False),
    "failed": (failed, "JOB FAILED: " + re.escape(CAUSE) +
                       r"; torn down on every node \(on_failure kill-job\)  \[node1, node2\]", False),
    "killed": (killed, r"job killed: stopped by fab kill-all", False),
    "lost node": (running, r"job running: 3 of 3 processes on 2 nodes; not reached: node3 "
                          r"\(what runs there is not seen\)", True),
}


@pytest.fixture
def outcome(request, tmp_path):
    name = request.param
    files, pattern, can_kill = OUTCOMES[name]
    path = local_cluster(tmp_path, {"node1": ["pserver", "trainer"], "node2": ["trainer"]},
                         unreachable={"node3": ["trainer"]} if name == "lost node" else None)
    job = SyntheticJob(JOB, {n: (str(tmp_path / f"ws-{n}"), names) for n, names in NAMES.items()}).start(running=True)
    files(job, time.time())
    session = Session(load_cluster(str(path)))
    agents = threading.Event()  # set: the agents have stopped (as they do once a job has ended)
    if name in ("running", "starting", "restarting", "lost node"):
        threading.Thread(target=keep_beating, args=(job, agents), daemon=True).start()
    try:
        if name == "killed":
            assert all(r.ok for r in lifecycle.kill_all(session, grace=1.0))  # the real kill-all
        with dashboard(path, TOKEN, REFRESH_MS=500) as url:
            yield {"name": name, "url": url, "pattern": pattern, "can_kill": can_kill, "session": session, "job": job}
    finally:
        agents.set()
        session.close()
        job.close()


def fab_status(session) -> list[str]:
    text, _ = report.status_text(lifecycle.status(session, health=True))
    return text.splitlines()


def same_words(a: str) -> str:
    """A sentence with the seconds left on a timer left out (two reads are a moment apart)."""
    return re.sub(r"\b\d+(m \d\ds|h \d\dm|s)\b", "<time>", a)


@pytest.fixture
def open_page(browser):
    """Opens the dashboard's printed URL in a new tab; closed before the dashboard stops."""
    pages = []

    def open_(url: str):
        page = browser.new_page()
        pages.append(page)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(f"{url}/?token={TOKEN}")
        return page, errors
    yield open_
    for page in pages:
        page.close()


@pytest.mark.parametrize("outcome", list(OUTCOMES), indirect=True)
def test_the_page_says_what_happened_first_in_the_words_of_fab_status(outcome, open_page):
    page, errors = open_page(outcome["url"])
    state = outcome["name"].replace("lost node", "running")
    page.wait_for_selector(f"#verdict[data-state='{state}']", timeout=30000)
    page.wait_for_function("p => new RegExp(p).test(document.querySelector('#verdict .sentence').textContent)",
                           arg=outcome["pattern"], timeout=30000)
    said = page.locator("#verdict .sentence").text_content()
    assert re.fullmatch(outcome["pattern"], said), said
    if outcome["name"] not in ("failed", "restarting"):  # no process where it began: nothing more to link
        assert page.locator("#verdict").text_content() == said
    # The same words as fab status, read from the same nodes.
    assert same_words(said) in map(same_words, fab_status(outcome["session"])), said
    # First on the page: above the cluster table, and in view without scrolling.
    box, table = page.locator("#verdict").bounding_box(), page.locator("#nodes").bounding_box()
    assert box["y"] < table["y"] and box["y"] + box["height"] < 1000

    kill = page.locator("#kill")
    if outcome["can_kill"]:
        assert kill.is_enabled() and "SIGTERM" in kill.get_attribute("title")
    else:
        assert kill.is_disabled()
        why = kill.get_attribute("title")
        assert why == f"nothing of job {JOB} runs any more ({state}): nothing to kill", why
        assert page.locator(".kill-wrap").get_attribute("title") == why  # hovering a disabled button shows it
    if outcome["name"] == "lost node":
        page.wait_for_selector("#nodes tr[data-node='node3'].down")
    assert not errors, errors


@pytest.mark.parametrize("outcome", ["failed", "restarting"], indirect=True)
def test_the_cause_links_to_its_event_and_its_log_line(outcome, open_page):
    page, errors = open_page(outcome["url"])
    page.wait_for_selector("#verdict a.cause-event", timeout=30000)
    link = page.locator("#verdict a.cause-event")
    assert "exited trainer-1 on node2" in link.inner_text() and link.get_attribute("title") == \
        "killed by SIGKILL (exit code 137)"
    # The event is marked in the list, and the link brings it into view.
    page.wait_for_selector("#events li.cause", timeout=30000)
    marked = page.locator("#events li.cause")
    assert marked.count() == 1 and marked.get_attribute("data-kind") == "exited" and "node2 trainer-1" in marked.inner_text()
    link.click()
    page.wait_for_selector("#events li.cause.flash")
    # The log line: shown in the banner, and the link follows that process's log.
    log_link = page.locator("#verdict a.cause-log")
    assert log_link.inner_text() == "log of trainer-1 on node2: step 200 loss 5.00 (last words)"
    log_link.click()
    page.wait_for_function("() => document.getElementById('log').textContent.includes('(last words)')", timeout=30000)
    assert page.locator("#log-select").input_value() == "node2/trainer-1"
    # The charts that have something to show, and the one line of those that do not.
    page.wait_for_function("() => (document.getElementById('chart-loss').data || []).length === 2", timeout=30000)
    assert page.locator("#chart-gpu").locator("xpath=..").get_attribute("class") == "chart empty"
    assert page.locator("#chart-gpu ~ .empty-line").inner_text() == \
        "node GPU utilisation % (mean of the node's GPUs)no GPUs on these nodes"
    beat(outcome["job"])  # the agents wrote last just now: no "agent 9s old" in the picture
    page.wait_for_timeout(1200)  # a poll and a refresh for the picture
    page.evaluate("window.scrollTo(0, 0)")
    shot = REPO / "artifacts" / f"dashboard-{outcome['name']}.png"
    shot.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(shot), full_page=False)
    if os.environ.get("FABTRAIN_UPDATE_SCREENSHOT") == "1":
        shutil.copy(shot, REPO / "docs" / shot.name)
    assert not errors, errors


@pytest.mark.parametrize("outcome", ["running"], indirect=True)
def test_charts_with_nothing_to_show_are_one_line_and_one_point_has_whole_seconds(outcome, open_page):
    page, errors = open_page(outcome["url"])
    page.wait_for_function("() => (document.getElementById('chart-cpu').data || []).length === 2", timeout=30000)
    # This job reports a loss but no samples/s, and its nodes have no GPU: one line each, saying so.
    page.wait_for_selector("#chart-sps ~ .empty-line")
    assert page.locator("#chart-sps ~ .empty-line").inner_text() == \
        'samples/s of each trainer, every recordthis job reports no samples/s (its metrics records have no "samples_per_s" field)'
    assert page.locator("#chart-gpu ~ .empty-line").inner_text().endswith("no GPUs on these nodes")
    for chart in ("chart-sps", "chart-gpu"):
        assert page.locator(f"#{chart}").locator("xpath=..").bounding_box()["height"] < 60
    assert page.locator("#chart-loss").bounding_box()["height"] > 200
    # One health snapshot a node: one point each, on a time axis in whole seconds or minutes.
    ticks = page.locator("#chart-cpu .xtick text").all_text_contents()
    assert ticks and all(re.match(r"\d\d:\d\d(:\d\d)?(\D|$)", t) for t in ticks), ticks
    assert not [t for t in ticks if re.search(r"\d\.\d", t)], ticks
    # A day and a week of points (as the thinned series of a long run): hours, then days.
    for days, label in ((1, r"\d\d:\d\d"), (7, r"[A-Z][a-z]{2} \d\d")):
        ticks = page.evaluate("""days => {
            const end = Date.now() / 1000, n = 600;
            const x = Array.from({length: n}, (_, i) => end - days * 86400 * (1 - i / (n - 1)));
            state.nodes.node1.cpu = {x, y: x.map((_, i) => 20 + i % 30), last: null};
            state.job.started_at = x[0];  // a job that has run that long: the node charts start at its start
            state.chartsDirty = true;
            drawCharts();
            return Array.from(document.querySelectorAll('#chart-cpu .xtick text'), t => t.textContent);
        }""", days)
        assert len(ticks) >= 3 and all(re.match(label, t) for t in ticks), (days, ticks)
    # A node's readings from before the job started are not on its chart. One synchronous turn of the page's
    # script: a poll that appends the node's live reading cannot come between setting the series and drawing it.
    kept = page.evaluate("""() => {
        const end = Date.now() / 1000, n = 600;
        const x = Array.from({length: n}, (_, i) => end - 7 * 86400 * (1 - i / (n - 1)));
        state.nodes.node1.cpu = {x, y: x.map(() => 20), last: null};
        state.job.started_at = x[400];
        state.chartsDirty = true;
        drawCharts();
        return document.getElementById('chart-cpu').data.find(t => t.name === 'node1').x.length;
    }""")
    assert kept == 200, kept
    # A few steps: whole steps, not halves.
    steps = page.locator("#chart-loss .xtick text").all_text_contents()
    assert steps and all(re.fullmatch(r"\d+", t) for t in steps), steps
    assert not errors, errors
