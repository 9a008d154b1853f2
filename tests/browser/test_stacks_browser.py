"""A hang's stacks and a straggler in a real browser (Chromium, Playwright): the hang event expands to
each process's top frame and to every thread's stack as the node saved it, read through the
token-checked /api/stacks/<node>; the teardown event of another node says why it has no stack; the
trainers table marks the rank that fell behind.

The job's files are written directly (tests/support/synthetic.py) on two local nodes, as the agents
write them across a hang and the restart after it (on_failure restart): generation 0 hung with
trainer-0 on node1 in a spin loop, its stacks saved before the teardown; generation 1 runs, and the
coordinator's agent (node1) lists trainer-1 as a straggler. The dashboard is served by waitress as
`fab dashboard` serves it and reads the nodes through node ops."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.support.synthetic import SyntheticJob, dashboard, local_cluster

TOKEN = "stacks-browser-token-0123456789abcdef"
JOB = "20260104-020000-5a5a"
FRAME = "/ws/code/train.py:41 in all_reduce_spin"
STACK = ["Thread 0x00007f3a2b1ff640 (most recent call first):",
         '  File "/ws/code/train.py", line 88 in _heartbeat',
         "",
         "Current thread 0x00007f3a2c400740 (most recent call first):",
         '  File "/ws/code/train.py", line 41 in all_reduce_spin',
         '  File "/ws/code/train.py", line 120 in main']
GENERATION_1 = {"status": "running", "on_failure": "restart", "generation": 1, "restarts_left": 2}
pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture
def served(tmp_path):
    path = local_cluster(tmp_path, {"node1": ["pserver", "trainer"], "node2": ["trainer"]})
    nodes = {"node1": (str(tmp_path / "ws-node1"), ["trainer-0"]), "node2": (str(tmp_path / "ws-node2"), ["trainer-1"])}
    job = SyntheticJob(JOB, nodes).start(running=True)
    hung_at = time.time() - 30
    job.event("node1", kind="hang", name="trainer-0", role="trainer", rank=0, ts=hung_at, first="trainer-0",
              frame=FRAME, reason="no progress for 120 s (hang_timeout)", stacks={"trainer-0": {"frame": FRAME}})
    job.event("node2", kind="teardown", ts=hung_at + 0.2, reason="the job failed on node1: a hang",
              stacks={"trainer-1": {"why": "not a Python program"}})
    stacks = job.job_dir("node1") / "stacks"
    stacks.mkdir()
    (stacks / "trainer-0.txt").write_text("\n".join(STACK) + "\n")
    for node in nodes:
        job.event(node, kind="restarting", ts=hung_at + 0.5, generation=1, backoff=10.0, restarts_left=2,
                  reason="trainer-0 on node1 hung")
        job.event(node, kind="restarted", ts=hung_at + 11, generation=1)
    for node, (_, (name,)) in nodes.items():
        job.metrics(node, name, range(100, 160, 2), t0=hung_at + 12)
    behind = [{"node": "node2", "name": "trainer-1", "rate": 2.5, "median": 5.0, "since": hung_at + 14}]
    stop = threading.Event()

    def agents():  # each agent writes health.json every interval; the coordinator's (node1) names the straggler
        while True:
            job.health("node1", processes=[{"name": "trainer-0", "state": "running"}], job=GENERATION_1,
                       stragglers=behind)
            job.health("node2", processes=[{"name": "trainer-1", "state": "running"}], job=GENERATION_1)
            if stop.wait(0.5):
                return
    threading.Thread(target=agents, daemon=True).start()
    try:
        with dashboard(path, TOKEN, REFRESH_MS=500) as url:
            yield url
    finally:
        stop.set()
        job.close()


def test_the_hang_event_expands_to_every_ranks_stack_and_the_straggler_is_marked(served, browser):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{served}/?token={TOKEN}")
    page.wait_for_selector("#trainers tr[data-trainer='trainer-1'] .tag.straggler", timeout=30000)
    assert page.locator("#trainers tr[data-trainer='trainer-1'] .tag.straggler").inner_text() == \
        "STRAGGLER 2.5 vs median 5 steps/s"  # the words of fab status and fab watch
    assert page.locator("#trainers tr[data-trainer='trainer-0'] .tag.straggler").count() == 0

    # The hang event: closed at first, one click opens it on each process's top frame, then the
    # node's saved stack under it; it stays open across the page's redraws.
    page.wait_for_selector("#events li[data-kind='hang'] a.stacks-toggle", timeout=30000)
    toggle = page.locator("#events li[data-kind='hang'] a.stacks-toggle")
    assert toggle.inner_text() == "stacks of 1 process"
    toggle.click()
    hang = "#events li[data-kind='hang'] .stack[data-process='trainer-0']"
    page.wait_for_selector(f"{hang} pre.stack-text", timeout=30000)
    assert page.locator(f"{hang} .frame").inner_text().strip() == FRAME
    assert page.locator(f"{hang} pre.stack-text").inner_text() == "\n".join(STACK)
    page.wait_for_timeout(1500)  # redrawn at least twice since
    assert page.locator(f"{hang} pre.stack-text").count() == 1

    # Another node's teardown: why it has no stack, and no file on that node.
    page.locator("#events li[data-kind='teardown'] a.stacks-toggle").click()
    page.wait_for_function("() => (document.querySelector(\"#events li[data-kind='teardown'] .stacks\") || {})"
                           ".textContent?.includes('no stack file was saved on this node')", timeout=30000)
    assert page.locator("#events li[data-kind='teardown'] .stack[data-process='trainer-1'] .frame").inner_text() \
        .strip() == "no stack: not a Python program"
    assert not errors, errors

    # The stacks are behind the token like every /api/ view.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{served}/api/stacks/node1", timeout=10)
    assert refused.value.code == 401
