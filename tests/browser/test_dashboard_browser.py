"""The dashboard in a real browser, over a real job on real sshd nodes.

Headless Chromium (Playwright, /usr/bin/chromium) against the dashboard served
by waitress in a thread, watching a job started with `fab start-pserver
start-trainers` on three sshd nodes (127.0.0.2-4). The job's program is
tests/programs/dashboard_fake_trainer.py (metrics every 0.2 s). The node agent is
disabled for determinism; a stand-in thread writes each node's health.json
as the agent would (real CPU, made-up GPUs: this machine has none). Events
come from the kill, which runs `kill-all` on every node.

Leaves artifacts/dashboard.png; with FABTRAIN_UPDATE_SCREENSHOT=1 it also
refreshes docs/dashboard.png, the README's picture (a plain test run never
changes tracked files).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from fabtrain.dashboard import create_app
from fabtrain.dashboard.serve import MAX_POINTS, make_server
from fabtrain.controller.streaming import StreamingCollector
from tests.support.synthetic import SyntheticJob, gpu
from fabtrain.config.cluster import load_cluster
from fabtrain.remote.session import Session
from tests.support.sshd import free_port, write_cluster

from tests.support import REPO
FAKE = REPO / "tests" / "programs" / "dashboard_fake_trainer.py"
TOKEN = "browser-test-token-0123456789abcdef"
pytestmark = [pytest.mark.timeout(180)]


class StandInAgent(threading.Thread):
    """Writes health.json on each node every 0.5 s, in place of the node agent."""

    def __init__(self, job: SyntheticJob):
        super().__init__(daemon=True)
        self.job, self.stop = job, threading.Event()

    def run(self):
        k = 0
        while not self.stop.is_set():
            cpu = psutil.cpu_percent()
            for i, node in enumerate(self.job.nodes):
                wave = 0.5 + 0.5 * math.sin(k / 6 + i)
                self.job.health(node, cpu=min(100.0, cpu + 5 * i),
                                gpus=[gpu(0, round(60 + 35 * wave, 1), temp=55 + 10 * i),
                                      gpu(1, round(55 + 30 * wave, 1), temp=58 + 10 * i)])
            k += 1
            self.stop.wait(0.5)


@pytest.fixture
def live(sshd, fab, tmp_path):
    """A real job on three sshd nodes, the collector, and the dashboard under waitress."""
    command = f"python {FAKE} --seconds 170"
    cluster_file = write_cluster(tmp_path / "cluster.yaml", sshd, name="browser",
                                 ssh_nodes=[("node1", ["pserver", "trainer"]), ("node2", ["trainer"]), ("node3", ["trainer"])],
                                 job={"name": "fake", "mode": "pserver",
                                      "pserver": {"command": command}, "trainer": {"command": command},
                                      "watchdog": {"enabled": False}})
    cluster = load_cluster(cluster_file)
    fab("deploy", "start-pserver", "start-trainers", cluster=cluster_file, check=True)
    workspaces = {n.name: n.workspace for n in cluster.nodes}
    job_id = os.path.basename(os.path.realpath(os.path.join(workspaces["node1"], "current")))
    agent = StandInAgent(SyntheticJob(job_id, {n: (ws, []) for n, ws in workspaces.items()}))
    agent.start()

    session = Session(cluster)
    collector = StreamingCollector(session, max_points=MAX_POINTS)  # as fab dashboard
    collector.start(0.5)
    port = free_port(["127.0.0.1"])
    app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "REFRESH_MS": 500, "KILL_GRACE": 2.0,
                      "ALLOWED_HOSTS": [f"127.0.0.1:{port}"]})
    server = make_server(app, "127.0.0.1", port, threads=4)  # waitress, as fab dashboard runs it
    closing = threading.Event()

    def serve():
        try:
            server.run()
        except OSError:  # its select() on the sockets close() took from under it at the end: that is the end
            if not closing.is_set():
                raise
    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    try:
        yield {"url": f"http://127.0.0.1:{port}", "workspaces": workspaces, "job_id": job_id,
               "cluster_file": cluster_file, "collector": collector}
    finally:
        agent.stop.set()
        closing.set()
        server.close()
        serving.join(5)
        collector.stop()
        fab("kill-all", "--grace", "1", cluster=cluster_file)  # whatever the test did, nothing is left
        session.close()


def program_pid(workspace: str, job_id: str, name: str) -> int:
    """The training program itself: the child of the launch wrapper recorded in run/<name>.json."""
    run = json.loads(Path(workspace, "jobs", job_id, "run", f"{name}.json").read_text())
    (child,) = psutil.Process(run["pid"]).children()
    return child.pid


def alive(workspaces: dict, job_id: str) -> list[str]:
    out = []
    for ws in workspaces.values():
        for f in Path(ws, "jobs", job_id, "run").glob("*.json"):
            run = json.loads(f.read_text())
            try:
                if psutil.Process(run["pid"]).status() != psutil.STATUS_ZOMBIE:
                    out.append(run["name"])
            except psutil.NoSuchProcess:
                pass
    return sorted(out)


def test_the_page_shows_a_live_job_follows_a_fault_and_kills_with_the_token(live, browser):
    url, workspaces, job_id = live["url"], live["workspaces"], live["job_id"]
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    requests, api_auth = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("request", lambda r: api_auth.append(r.headers.get("authorization")) if "/api/" in r.url else None)

    # Without the token: the page is there, but nothing to see and nothing to press.
    page.goto(url + "/")
    page.wait_for_function("() => document.getElementById('banner').textContent.includes('this page has no token')")
    assert "open the URL that fab dashboard printed" in page.inner_text("#banner")
    assert page.locator("#kill").is_hidden() and not [u for u in requests if "/api/" in u]

    # With it: kept in this tab's sessionStorage (per origin: scheme, host AND port), gone from the
    # address bar and the history, and no cookie (cookies ignore ports).
    page.goto(f"{url}/?token={TOKEN}")
    assert page.url == url + "/"
    assert page.evaluate("sessionStorage.getItem('fabtrain-dashboard-token')") == TOKEN
    assert page.evaluate("document.cookie") == "" and browser.cookies() == []

    # Every node, with its processes.
    page.wait_for_function("() => document.querySelectorAll('#nodes tbody tr[data-node]').length === 3")
    assert page.locator("#nodes tbody tr[data-node]").evaluate_all("rs => rs.map(r => r.dataset.node)") == ["node1", "node2", "node3"]
    page.wait_for_selector('.chip[data-node="node1"][data-process="pserver-0"][data-state="running"]')
    page.wait_for_selector('.chip[data-node="node3"][data-process="trainer-2"][data-state="running"]')
    assert page.inner_text("#job-state").lower() == "running"
    assert page.inner_text("#job-id") == job_id

    # The charts have points: loss per trainer, and the nodes' CPU and GPU over time.
    page.wait_for_function("""() => {
        const d = id => document.getElementById(id).data || [];
        return d('chart-loss').length === 3 && d('chart-loss').every(t => t.x.length >= 5)
            && d('chart-sps').length === 3 && d('chart-cpu').length === 3 && d('chart-gpu').length === 3
            && d('chart-gpu').every(t => t.x.length >= 2);
    }""", timeout=30000)
    assert page.locator("#chart-loss .scatterlayer .trace").count() == 3
    # ... and keep being redrawn as the job goes on (the x axis follows the steps).
    drawn_to = "() => document.getElementById('chart-loss')._fullLayout.xaxis.range[1]"
    first_range = page.evaluate(drawn_to)
    page.wait_for_function(f"() => ({drawn_to})() >= {first_range + 10}", timeout=20000)
    page.wait_for_function("() => Number(document.querySelector('#trainers tr[data-trainer=\"trainer-1\"] td:nth-child(4)').textContent.replace(/,/g, '')) >= 10")

    # Every API request carried the token as a header.
    assert api_auth and set(api_auth) == {f"Bearer {TOKEN}"}, set(api_auth)

    # A reload (no token in the URL now) goes on from sessionStorage.
    page.reload()
    page.wait_for_function("() => document.querySelectorAll('#nodes tbody tr[data-node]').length === 3")
    assert page.locator("#kill").is_visible()

    # Another web app on 127.0.0.1, another port: it gets no token, neither sent nor stored.
    with OtherApp() as other:
        page.goto(other.url)
        page.wait_for_load_state()
        assert page.evaluate("sessionStorage.getItem('fabtrain-dashboard-token')") is None
        assert other.headers and not any(TOKEN in str(h) for h in other.headers), other.headers
    page.goto(url + "/")
    page.wait_for_function("() => document.querySelectorAll('#nodes tbody tr[data-node]').length === 3")

    # Nobody picked a log yet: the panel follows the first trainer's, whose lines are its progress.
    page.wait_for_function("() => /step \\d+ epoch \\d+ loss/.test(document.getElementById('log').textContent)")
    assert page.locator("#log-select").input_value() == "node1/trainer-0"
    # A log line, following: click the process in the cluster table.
    # (the table is redrawn at every refresh: on a loaded machine a chip seldom stays put long enough
    # for a pointer click, so the click event goes to it directly)
    page.locator('.chip[data-node="node2"][data-process="trainer-1"]').dispatch_event("click")
    page.wait_for_function("() => /step \\d+ epoch \\d+ loss/.test(document.getElementById('log').textContent)")
    first = page.inner_text("#log").splitlines()[-1]
    page.wait_for_function(f"() => document.getElementById('log').textContent.trim().split('\\n').pop() !== {json.dumps(first)}")
    assert page.locator("#log-select").input_value() == "node2/trainer-1"  # a refresh keeps what was picked
    _artifacts().joinpath("dashboard-running.png").write_bytes(page.screenshot(full_page=True))

    # The kill button without the token: refused, the job goes on.
    page.on("dialog", lambda d: d.accept())
    page.route("**/api/kill", lambda route: route.continue_(
        headers={k: v for k, v in route.request.headers.items() if k.lower() != "authorization"}))
    page.click("#kill")
    page.wait_for_selector("#kill-result:not([hidden])")
    page.wait_for_function("() => document.getElementById('kill-result').textContent.includes('kill refused')")
    assert "Authorization: Bearer" in page.inner_text("#kill-result")
    page.unroute("**/api/kill")
    # Nor without any header (all a cross-site form could send).
    status = page.evaluate("fetch('/api/kill', {method: 'POST'}).then(r => r.status)")
    assert status == 401
    time.sleep(1.0)
    assert alive(workspaces, job_id) == ["pserver-0", "trainer-0", "trainer-1", "trainer-2"]
    assert page.inner_text("#job-state").lower() == "running"

    # A fault: kill -9 of trainer-1's program. Its wrapper records 137: killed by SIGKILL.
    os.kill(program_pid(workspaces["node2"], job_id, "trainer-1"), signal.SIGKILL)
    chip = page.locator('.chip[data-node="node2"][data-process="trainer-1"]')
    page.wait_for_selector('.chip[data-node="node2"][data-process="trainer-1"][data-state="killed"]')
    assert chip.inner_text() == "trainer-1: killed (SIGKILL)"
    page.wait_for_function("() => document.getElementById('job-state').textContent === 'failed'")
    # What happened, first, in fab status's words; with no agent to tear the job down the rest still
    # runs, so Kill stays live.
    page.wait_for_function("""() => document.querySelector('#verdict .sentence')?.textContent ===
                                    'JOB FAILED: trainer-1 on node2 killed by SIGKILL'""", timeout=15000)
    assert page.locator("#verdict a.cause-log").inner_text().startswith("log of trainer-1 on node2")
    assert page.locator("#kill").is_enabled()

    # The kill button with the token ends the job; kill-all's events show up, newest first.
    with page.expect_response("**/api/kill", timeout=60000) as answer:
        page.click("#kill")
    killed = [(n["node"], k["name"], k.get("child"), k.get("orphan")) for n in answer.value.json()["nodes"]
              for k in n.get("killed") or ()]
    page.wait_for_function("() => document.getElementById('kill-result').textContent.startsWith('kill: ')", timeout=60000)
    assert "3 processes stopped on 3 nodes" in page.inner_text("#kill-result"), killed
    page.wait_for_function("() => document.getElementById('job-state').textContent === 'killed'", timeout=15000)
    page.wait_for_function("() => document.querySelectorAll('#events li[data-kind=\"killed\"]').length >= 3", timeout=15000)
    assert "the dashboard's Kill button" in page.inner_text("#events")  # who stopped it, in every killed event
    for name in ("pserver-0", "trainer-0", "trainer-2"):
        page.wait_for_selector(f'.chip[data-process="{name}"][data-state="killed"]')
    assert alive(workspaces, job_id) == []
    # Nothing left to kill: the button says so instead of pretending.
    page.wait_for_function("() => document.getElementById('kill').disabled", timeout=15000)
    assert page.locator("#kill").get_attribute("title") == f"nothing of job {job_id} runs any more (killed): nothing to kill"
    page.wait_for_function("""() => document.querySelector('#verdict .sentence').textContent ===
                                    "job killed: stopped by the dashboard's Kill button"
                           """, timeout=15000)
    page.wait_for_timeout(600)  # one more refresh for the picture

    page.screenshot(path=str(_artifacts() / "dashboard.png"), full_page=True)
    if os.environ.get("FABTRAIN_UPDATE_SCREENSHOT") == "1":
        shutil.copy(_artifacts() / "dashboard.png", REPO / "docs" / "dashboard.png")
    assert not [e for e in errors if "401" not in e], errors  # the refused kill logs a 401; nothing else
    others = [u for u in requests if not u.startswith(url) and not u.startswith("http://127.0.0.1:%d" % OtherApp.last_port)]
    assert not others, others  # no CDN


class OtherApp:
    """Some other local web app on another port: records the headers each request brings."""
    last_port = 0

    def __enter__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        headers = self.headers = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                headers.append(dict(self.headers))
                body = b"<!doctype html><title>other</title><p>another app"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        OtherApp.last_port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{OtherApp.last_port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _artifacts() -> Path:
    (REPO / "artifacts").mkdir(exist_ok=True)
    return REPO / "artifacts"
