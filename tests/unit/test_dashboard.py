"""The dashboard's HTTP surface with Flask's test client, over a real Collector.

The job is synthetic (tests.synthetic writes the node files, with live
`sleep` stand-ins for running processes) on three local nodes, plus one SSH
node that refuses connections, so the collector, node ops `collect` and the
views are all real. The browser tests are in test_dashboard_browser.py.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fabtrain.contract.opreplies import Kill, Killed
from fabtrain.dashboard import create_app
from fabtrain.dashboard.serve import allowed_hosts, make_token, url_for
from tests.support import REPO
from tests.support.synthetic import SyntheticJob, gpu
from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.remote.session import Session
from fabtrain.remote.transport import Reply

pytestmark = pytest.mark.timeout(60)

TOKEN = "t0k3n-for-tests-0123456789abcdef"
HOST = "127.0.0.1:8265"
JOB = "20261122-014600-ab12"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def write_cluster(root: Path) -> Path:
    nodes = [{"name": f"node{i}", "host": "local", "roles": roles, "workspace": str(root / f"ws-node{i}")}
             for i, roles in enumerate((["pserver"], ["trainer"], ["trainer"]))]
    (root / "known_hosts").write_text("")
    # A node nobody answers for: connection refused at once.
    nodes.append({"name": "node3", "host": "127.0.0.1", "port": 1, "roles": ["trainer"],
                  "workspace": str(root / "ws-node3"), "known_hosts": str(root / "known_hosts"),
                  "connect_timeout": 2})
    doc = {"cluster": {"name": "testdash", "python": sys.executable}, "nodes": nodes,
           "job": {"trainer": {"command": "python -m workload.trainer"}}}
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dash")
    cluster = load_cluster(write_cluster(root))
    nodes = {n.name: (n.workspace, names) for n, names in zip(
        cluster.nodes, (["pserver-0"], ["trainer-0"], ["trainer-1"]))}
    job = SyntheticJob(JOB, nodes).start()
    job.metrics("node1", "trainer-0", range(0, 300))
    job.metrics("node2", "trainer-1", range(0, 200), t0=time.time() - 600)  # last record 10 minutes old: stale
    job.log("node1", "trainer-0", [f"step {i} loss {7 - i / 100:.3f}" for i in range(0, 300, 10)])
    job.log("node0", "pserver-0", ["pserver listening on 7164"])
    for i, node in enumerate(("node0", "node1", "node2")):
        job.health(node, cpu=20.0 + 10 * i, gpus=[gpu(0, 85.0), gpu(1, 70.0)] if node != "node0" else [],
                   processes=[{"name": "trainer-0", "cpu_percent": 97.0, "rss": 1 << 30,
                               "last_progress": time.time() - 1, "step_rate": 12.5}] if node == "node1" else [])
    job.event("node2", kind="hang", role="trainer", rank=1, reason="no progress for 120 s (hang_timeout)", ts=time.time() - 5)
    job.event("node1", kind="started", role="trainer", rank=0, reason="launched", ts=time.time() - 60)
    session = Session(cluster)
    collector = Collector(session, max_points=50)
    collector.poll()
    yield {"root": root, "cluster": cluster, "job": job, "collector": collector, "session": session}
    job.close()
    session.close()


@pytest.fixture
def kills():
    return []


@pytest.fixture
def app(world, kills):
    def fake_kill(grace):
        kills.append(grace)
        stopped = Killed(name="pserver-0", pid=1, signal="SIGTERM", job_id=JOB)
        return [Reply("node0", True, Kill(killed=[stopped], left=[], untrusted=[])),
                Reply("node3", False, error="node3 (127.0.0.1:1): unreachable: connection refused")]
    return create_app({"COLLECTOR": world["collector"], "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                       "KILL": fake_kill, "TESTING": True})


@pytest.fixture
def client(app):
    return app.test_client()


def get(client, path, headers=AUTH, **kw):
    return client.get(path, headers={"Host": HOST, **(headers or {})}, **kw)


def post(client, path, headers=AUTH, **kw):
    return client.post(path, headers={"Host": HOST, **(headers or {})}, **kw)


ENDPOINTS = ["/api/cluster", "/api/job", "/api/metrics", "/api/events", "/api/logs/node1/trainer-0", "/metrics"]


# -- the token, CSRF and Host guards ------------------------------------------------------------


def test_the_page_is_code_without_data_and_a_token_in_its_url_must_be_right(client):
    r = get(client, "/", headers=None)  # a reload: the page takes its token from sessionStorage
    assert r.status_code == 200 and "Set-Cookie" not in r.headers
    page = r.get_data(as_text=True)
    assert TOKEN not in page and "testdash" not in page and "node1" not in page  # no secret, no data
    assert '<script src="/static/plotly.min.js"' in page and "cdn" not in page.lower()
    assert r.headers["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
    assert r.headers["Referrer-Policy"] == "no-referrer"  # the ?token= URL never leaves as a Referer

    r = get(client, f"/?token={TOKEN}", headers=None)  # the URL fab dashboard prints
    assert r.status_code == 200 and "Set-Cookie" not in r.headers and TOKEN not in r.get_data(as_text=True)
    r = get(client, "/?token=wrong", headers=None)
    assert r.status_code == 403 and b"wrong token" in r.data


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_read_endpoint_needs_the_token_in_a_header(client, path):
    r = get(client, path, headers=None)
    assert r.status_code == 401 and "token required" in r.get_json()["error"]
    r = get(client, path, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 403 and r.get_json()["error"] == "wrong token"
    assert get(client, path, headers={"X-Fabtrain-Token": "nope"}).status_code == 403
    assert get(client, path).status_code == 200  # Authorization: Bearer
    assert get(client, path, headers={"X-Fabtrain-Token": TOKEN}).status_code == 200
    # The URL's token is for the first page load only, and no cookie is read: cookies ignore
    # ports, so a cookie for 127.0.0.1 would reach every other web app on this machine.
    assert get(client, f"{path}?token={TOKEN}", headers=None).status_code == 401
    client.set_cookie("fabtrain_token", TOKEN, domain="127.0.0.1")
    assert get(client, path, headers=None).status_code == 401


def test_a_big_body_is_refused_and_without_the_token_it_is_401_first(client, kills):
    big = b"x" * (64 << 10)
    r = post(client, "/api/kill", headers=None, data=big)
    assert r.status_code == 401
    r = post(client, "/api/kill", data=big)
    assert r.status_code == 413 and "at most 16384" in r.get_json()["error"]
    assert kills == []


def test_static_files_need_no_token_and_plotly_comes_from_the_package(client):
    import plotly

    shipped = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    r = get(client, "/static/plotly.min.js", headers=None)
    assert r.status_code == 200 and r.data == shipped and r.mimetype == "text/javascript"
    r = get(client, "/static/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert r.headers["Content-Encoding"] == "gzip" and gzip.decompress(r.data) == shipped
    assert get(client, "/static/app.js", headers=None).status_code == 200


@pytest.mark.parametrize("path", ["/", "/api/cluster", "/static/app.js", "/metrics"])
def test_a_foreign_host_header_is_refused_even_with_the_token(client, path):
    # DNS rebinding: evil.example resolves to 127.0.0.1, the browser sends Host: evil.example:8265.
    r = client.get(path, headers={"Host": "evil.example:8265", **AUTH})
    assert r.status_code == 403 and b"DNS rebinding" in r.data
    assert client.get(path, headers={"Host": "127.0.0.1:9999", **AUTH}).status_code == 403


def test_kill_needs_a_post_with_the_bearer_header(client, kills):
    # GET never changes state.
    r = get(client, "/api/kill")
    assert r.status_code == 405 and r.get_json()["error"] == "GET is not allowed on /api/kill" and kills == []
    # Neither a cookie (what a cross-site form would carry) nor ?token= will do.
    client.set_cookie("fabtrain_token", TOKEN, domain="127.0.0.1")
    r = post(client, "/api/kill", headers=None)
    assert r.status_code == 401 and "Authorization: Bearer" in r.get_json()["error"]
    assert post(client, f"/api/kill?token={TOKEN}", headers=None).status_code == 401
    assert post(client, "/api/kill", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert post(client, "/api/kill", headers={**AUTH, "Origin": "http://evil.example"}).status_code == 403
    assert kills == []

    r = post(client, "/api/kill", headers={**AUTH, "Origin": f"http://{HOST}"})
    assert r.status_code == 200 and kills == [5.0]
    body = r.get_json()
    assert body["ok"] is False  # node3 could not be reached: said, not hidden
    assert body["nodes"][0] == {"node": "node0", "ok": True, "left": [],
                                "killed": [{"name": "pserver-0", "pid": 1, "signal": "SIGTERM", "job_id": JOB}]}
    assert body["nodes"][1]["error"].endswith("connection refused")

    assert post(client, "/api/kill", json={"grace": 1}).status_code == 200 and kills[-1] == 1.0
    for bad in ({"grace": "soon"}, {"grace": -1}, {"grace": True}, {"force": 1}, [1]):
        r = post(client, "/api/kill", json=bad)
        assert r.status_code == 400 and "error" in r.get_json(), bad
    assert len(kills) == 2


# -- the JSON API ------------------------------------------------------------------------------------


def test_cluster_shows_every_node_its_health_and_processes(client):
    c = get(client, "/api/cluster").get_json()
    assert c["cluster"] == "testdash"
    nodes = {n["name"]: n for n in c["nodes"]}
    assert list(nodes) == ["node0", "node1", "node2", "node3"]
    n1 = nodes["node1"]
    assert n1["up"] is True and n1["since"] and n1["job_id"] == JOB and n1["roles"] == ["trainer"]
    assert n1["health"]["host"]["cpu_percent"] == 30.0 and n1["health"]["host"]["disk_free"] == 410 << 30
    assert n1["health"]["host"]["net_rx_bps"] == 12.5e6 and n1["health"]["stale"] is False
    assert [g["util"] for g in n1["health"]["gpus"]] == [85.0, 70.0] and n1["health"]["gpus"][0]["temp"] == 60
    (p,) = n1["processes"]
    assert p["name"] == "trainer-0" and p["state"] == "running" and p["label"] == "running"
    assert p["cpu_percent"] == 97.0 and p["pid"] > 1  # merged from health.json
    assert p["step_rate"] == 12.5 and p["launcher_pid"] > 1  # the agent's rate; node ops' launcher
    n3 = nodes["node3"]
    assert n3["up"] is False and n3["since"] and "connection refused" in n3["error"] and n3["processes"] == []


def test_job_shows_state_progress_and_a_stale_trainer(client):
    j = get(client, "/api/job").get_json()
    assert j["job_id"] == JOB and j["state"] == "running" and j["elapsed"] >= 0
    assert j["unreachable"] == ["node3"]
    t = {t["name"]: t for t in j["trainers"]}
    assert list(t) == ["trainer-0", "trainer-1"]
    assert t["trainer-0"]["step"] == 299 and t["trainer-0"]["epoch"] == 0 and t["trainer-0"]["node"] == "node1"
    assert t["trainer-0"]["loss"] > 0 and t["trainer-0"]["samples_per_s"] >= 800 and t["trainer-0"]["stale"] is False
    assert t["trainer-1"]["stale"] is True and t["trainer-1"]["age"] > 500 and j["stale"] == ["trainer-1"]
    assert j["processes"] == {"total": 3, "running": 3, "exited_ok": 0, "failed": 0, "killed": 0}


def test_metrics_are_downsampled_and_incremental(world, client):
    full = get(client, "/api/metrics").get_json()
    assert full["full"] is True
    loss = full["trainers"]["trainer-0"]["loss"]
    # 300 records thinned by stride doubling to at most 2 x max_points (50), plus the latest
    assert len(loss["x"]) < 100 and loss["stride"] >= 4 and loss["x"][0] == 0
    assert loss["x"][-1] == 299 or loss["last"][0] == 299
    assert set(full["trainers"]) == {"trainer-0", "trainer-1"}
    assert set(full["nodes"]["node1"]) == {"cpu", "mem", "gpu"} and full["nodes"]["node1"]["gpu"]["y"] == [77.5]

    again = get(client, f"/api/metrics?since={full['cursor']}").get_json()
    assert again["full"] is False and again["trainers"] == {} and again["nodes"] == {}  # nothing new

    world["job"].metrics("node1", "trainer-0", range(300, 310))
    world["collector"].poll_node("node1")
    delta = get(client, f"/api/metrics?since={again['cursor']}").get_json()
    series = delta["trainers"]["trainer-0"]["loss"]
    assert list(delta["trainers"]) == ["trainer-0"] and series["last"][0] == 309
    assert series["reset"] or len(series["x"]) <= 10  # only what is new, unless the stride doubled
    assert len(json.dumps(delta)) < len(json.dumps(full)) / 5

    assert get(client, "/api/metrics?since=abc-99999").get_json()["full"] is True  # unknown cursor: everything
    r = get(client, "/api/metrics?since=../../etc")
    assert r.status_code == 400 and "cursor" in r.get_json()["error"]


def test_a_trainers_samples_per_s_is_its_last_rate_and_the_charts_last_point(world, client):
    """An evaluation's record has no rate: the table keeps the last one, the chart's last point, not 0 or -."""
    world["job"].metrics("node1", "trainer-0", range(310, 312))
    rate = json.loads((world["job"].job_dir("node1") / "metrics" / "trainer-0.jsonl").read_text().splitlines()[-1])["samples_per_s"]
    world["job"].append("node1", "metrics/trainer-0.jsonl", json.dumps(
        {"ts": time.time(), "role": "trainer", "rank": 0, "step": 312, "epoch": 0, "loss": 1.5, "eval_loss": 1.4}).encode() + b"\n")
    world["collector"].poll_node("node1")
    t = {t["name"]: t for t in get(client, "/api/job").get_json()["trainers"]}
    assert t["trainer-0"]["step"] == 312 and t["trainer-0"]["samples_per_s"] == rate
    sps = get(client, "/api/metrics").get_json()["trainers"]["trainer-0"]["samples_per_s"]
    assert (sps["last"] or [sps["x"][-1], sps["y"][-1]])[1] == rate


def test_events_newest_first_with_reasons(client):
    ev = get(client, "/api/events").get_json()["events"]
    assert [e["kind"] for e in ev[:2]] == ["hang", "started"]
    assert ev[0]["reason"] == "no progress for 120 s (hang_timeout)" and ev[0]["node"] == "node2"
    assert len(get(client, "/api/events?limit=1").get_json()["events"]) == 1
    recent = get(client, f"/api/events?since={time.time() - 30}").get_json()["events"]
    assert [e["kind"] for e in recent] == ["hang"]


def test_logs_follow_a_process_and_report_unchanged(world, client):
    first = get(client, "/api/logs/node1/trainer-0").get_json()
    assert first["node"] == "node1" and first["process"] == "trainer-0"
    world["collector"].poll_node("node1")  # the collector now follows that log
    r = get(client, "/api/logs/node1/trainer-0").get_json()
    assert r["lines"][-1] == "step 290 loss 4.100" and r["offset"] > 0
    same = get(client, f"/api/logs/node1/trainer-0?offset={r['offset']}").get_json()
    assert same["unchanged"] is True and same["lines"] == []
    world["job"].log("node1", "trainer-0", ["step 300 loss 4.000"])
    world["collector"].poll_node("node1")
    newer = get(client, f"/api/logs/node1/trainer-0?offset={r['offset']}").get_json()
    assert newer["unchanged"] is False and newer["lines"][-1] == "step 300 loss 4.000"


@pytest.mark.parametrize("path,status,message", [
    ("/api/logs/node9/trainer-0", 404, "unknown node 'node9'; nodes: node0, node1, node2, node3"),
    ("/api/logs/node1/trainer-7", 404, "no process 'trainer-7' on node 'node1'; processes: trainer-0"),
    ("/api/logs/node3/trainer-0", 404, "no process 'trainer-0' on node 'node3' (no job seen there yet)"),
    ("/api/logs/node1/..", 400, "bad process name '..'"),
    ("/api/logs/node1/trainer-0?offset=x", 400, "parameter 'offset' must be an integer, got 'x'"),
    ("/api/events?limit=0", 400, "parameter 'limit' must be between 1 and 10000, got 0"),
    ("/api/events?limit=ten", 400, "parameter 'limit' must be an integer, got 'ten'"),
    ("/api/events?since=nan", 400, "parameter 'since' must be a finite number"),
    ("/api/cluster?verbose=1", 400, "unknown parameter 'verbose'; this endpoint takes: none"),
    ("/api/nothing", 404, "no such endpoint: GET /api/nothing"),
])
def test_bad_requests_get_a_clear_json_error(client, path, status, message):
    r = get(client, path)
    assert r.status_code == status and r.mimetype == "application/json"
    assert r.get_json() == {"error": message, "status": status}


def test_an_internal_error_is_json_without_a_traceback(world):
    class Broken:
        def __getattr__(self, name):
            return getattr(world["collector"], name)

        def snapshot(self):
            raise KeyError("boom")

    app = create_app({"COLLECTOR": Broken(), "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST]})
    r = get(app.test_client(), "/api/job")
    assert r.status_code == 500 and r.get_json() == {"error": "internal error: KeyError", "status": 500}


def test_prometheus_text_format(client):
    r = get(client, "/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = r.get_data(as_text=True)
    sample = re.compile(r'^fabtrain_[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? (-?[0-9.e+-]+|NaN|[+-]Inf)$')
    for line in text.splitlines():
        assert line.startswith("# HELP fabtrain_") or line.startswith("# TYPE fabtrain_") or sample.match(line), line
    assert 'fabtrain_node_up{cluster="testdash",node="node1"} 1' in text
    assert 'fabtrain_node_up{cluster="testdash",node="node3"} 0' in text
    assert 'fabtrain_node_cpu_percent{cluster="testdash",node="node2"} 40.0' in text
    assert 'fabtrain_gpu_util_percent{cluster="testdash",node="node1",gpu="0"} 85.0' in text
    assert 'fabtrain_process_state{cluster="testdash",node="node1",process="trainer-0",role="trainer",state="running"} 1' in text
    assert 'fabtrain_process_state{cluster="testdash",node="node1",process="trainer-0",role="trainer",state="exited"} 0' in text
    step = re.search(r'fabtrain_trainer_step\{cluster="testdash",node="node1",process="trainer-0"\} (\d+)\n', text)
    assert step and int(step[1]) >= 299, step  # 299, or 309 after the test that adds records
    assert 'fabtrain_trainer_samples_per_second{' in text and 'fabtrain_trainer_loss{' in text
    assert f'fabtrain_job_state{{cluster="testdash",job="{JOB}",state="running"}} 1' in text


def test_gzip_for_large_replies(client):
    plain = get(client, "/api/metrics")
    zipped = get(client, "/api/metrics", headers={**AUTH, "Accept-Encoding": "gzip"})
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(zipped.data))["trainers"].keys() == plain.get_json()["trainers"].keys()
    assert len(zipped.data) < len(plain.data)


def test_a_process_that_dies_shows_its_exit_code_and_signal(world, client, kills):
    job = world["job"]
    job.exit("node2", "trainer-1", 137)
    job.event("node2", kind="killed", role="trainer", rank=1, reason="fab kill-all", signal="SIGKILL")
    world["collector"].poll_node("node2")
    nodes = {n["name"]: n for n in get(client, "/api/cluster").get_json()["nodes"]}
    (p,) = nodes["node2"]["processes"]
    # Exit code 137 is a death by SIGKILL: killed, as the node agent says, not an exit.
    assert (p["state"], p["exit_code"], p["signal"], p["label"]) == ("killed", 137, "SIGKILL", "killed (SIGKILL)")
    j = get(client, "/api/job").get_json()
    assert j["state"] == "failed" and j["processes"]["killed"] == 1
    assert j["reason"] == "trainer-1 on node2 killed by SIGKILL"
    # The banner's sentence: the cause, and the node it cannot see; the process where it began, and the
    # first event of that process (the hang noted before the kill) and its log line.
    assert j["sentence"] == "JOB FAILED: trainer-1 on node2 killed by SIGKILL; not reached: node3 " \
                            "(what runs there is not seen)"
    assert (j["cause"]["node"], j["cause"]["process"], j["cause"]["event"]["kind"]) == ("node2", "trainer-1", "hang")
    # pserver-0 and trainer-0 still run (no agent here tears a job down), and node3 may hold more: Kill stays live.
    assert j["kill"]["enabled"] is True
    assert not next(t for t in j["trainers"] if t["name"] == "trainer-1")["stale"]  # dead, not stale
    assert get(client, "/api/events").get_json()["events"][0]["kind"] == "killed"
    assert 'state="failed"} 1' in get(client, "/metrics").get_data(as_text=True)


# -- the kill's default: fabtrain.controller.lifecycle.kill_all over the real nodes ---------------------


def test_default_kill_calls_kill_all_on_the_collectors_session(tmp_path):
    cluster = load_cluster(write_cluster(tmp_path))
    local = {n.name: (n.workspace, [f"trainer-{i}"]) for i, n in enumerate(cluster.nodes[:3])}
    job = SyntheticJob("20261122-020000-cafe", local).start()
    session = Session(cluster)
    try:
        collector = Collector(session)
        app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST]})
        pids = [p.pid for p in job.sleepers.values()]
        r = post(app.test_client(), "/api/kill", json={"grace": 2})
        body = r.get_json()
        assert r.status_code == 200 and body["ok"] is False  # node3 unreachable
        killed = {n["node"]: [k["name"] for k in n["killed"]] for n in body["nodes"] if n["ok"]}
        assert killed == {"node0": ["trainer-0"], "node1": ["trainer-1"], "node2": ["trainer-2"]}
        for p in job.sleepers.values():
            assert p.wait(5) is not None
        assert all(not os.path.exists(f"/proc/{pid}/stat") or open(f"/proc/{pid}/stat").read().split()[2] == "Z" for pid in pids)
        collector.poll()
        verdict = collector.verdict()
        assert verdict.state == "killed" and verdict.reason == "stopped by the dashboard's Kill button"
        events = get(app.test_client(), "/api/events").get_json()["events"]
        assert {e["reason"] for e in events} == {"the dashboard's Kill button"} and len(events) == 3
    finally:
        job.close()
        session.close()


# -- app factory and serve helpers --------------------------------------------------------------------


def test_create_app_needs_a_collector_and_a_token(world):
    with pytest.raises(ValueError, match="COLLECTOR"):
        create_app({"DASHBOARD_TOKEN": TOKEN})
    with pytest.raises(ValueError, match="DASHBOARD_TOKEN"):
        create_app({"COLLECTOR": world["collector"]})


def test_token_url_and_hosts(monkeypatch):
    monkeypatch.delenv("FABTRAIN_DASHBOARD_TOKEN", raising=False)
    a, b = make_token(), make_token()
    assert a != b and re.fullmatch(r"[0-9a-f]{48}", a)
    monkeypatch.setenv("FABTRAIN_DASHBOARD_TOKEN", TOKEN)
    assert make_token() == TOKEN
    assert url_for("127.0.0.1", 8265, TOKEN) == f"http://127.0.0.1:8265/?token={TOKEN}"
    assert allowed_hosts("127.0.0.1", 8265) == {"127.0.0.1:8265", "localhost:8265", "[::1]:8265"}
    assert allowed_hosts("10.0.0.5", 80) == {"10.0.0.5:80", "10.0.0.5"}


@pytest.mark.timeout(90)
def test_fab_dashboard_serves_with_waitress_and_prints_the_url(tmp_path):
    cluster = write_cluster(tmp_path)
    from tests.support.sshd import free_port

    port = free_port(["127.0.0.1"])
    env = {**os.environ, "FABTRAIN_CLUSTER": str(cluster), "FABTRAIN_DASHBOARD_TOKEN": TOKEN}
    fab = str(Path(sys.executable).parent / "fab")
    proc = subprocess.Popen([fab, "dashboard", "--port", str(port), "--interval", "0.5"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.time() + 30
        while time.time() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "?token=" in line or not line:
                break
        assert lines[-1].strip() == f"http://127.0.0.1:{port}/?token={TOKEN}", "".join(lines)
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/cluster", headers=AUTH)
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Server"] == "fabtrain"  # waitress's ident, not Werkzeug's dev server
            assert [n["name"] for n in json.load(r)["nodes"]] == ["node0", "node1", "node2", "node3"]
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([fab, "dashboard", "--port", "99999"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--port: must be a whole number from 1 to 65535, got '99999'" in bad.stderr


def test_metrics_cursor_deltas_rebuild_the_full_series_through_resets():
    """Merging deltas as app.js does gives exactly the full reply, across stride doublings and a new job."""
    import random

    from fabtrain.controller.series import TRAINERS, SeriesBook
    from fabtrain.dashboard.api import MetricsCursor

    class Fake:  # what the dashboard needs of a collector for /api/metrics
        book = SeriesBook(8)

        def series_since(self, cursor=None):
            return self.book.since(cursor)

    fake = Fake()
    rng = random.Random(7)
    cursor = MetricsCursor()
    client: dict = {}
    since = None
    step = 0
    for round_ in range(60):
        if round_ == 40:  # a new job: the series are replaced, trainer-1 is gone
            fake.book.forget(TRAINERS, "trainer-0")
            fake.book.forget(TRAINERS, "trainer-1")
        if round_ == 50:
            fake.book.forget(TRAINERS, "trainer-1")
        for name in ("trainer-0", "trainer-1") if round_ < 50 else ("trainer-0",):
            for _ in range(rng.randrange(0, 7)):
                fake.book.add(TRAINERS, name, "loss", step, rng.random() * 10)
                step += 1
        reply = cursor.export(fake, since)
        since = reply["cursor"]
        if reply["full"]:
            client = {}
        for owner, metrics in reply["trainers"].items():
            for metric, s in metrics.items():
                cur = client.get((owner, metric))
                if s["reset"] or cur is None:
                    client[(owner, metric)] = {"x": list(s["x"]), "y": list(s["y"]), "last": s["last"]}
                else:
                    cur["x"] += s["x"]
                    cur["y"] += s["y"]
                    cur["last"] = s["last"]
        fresh = MetricsCursor().export(fake)  # no cache, no cursor: the truth
        truth = {(o, m): {"x": s["x"], "y": s["y"], "last": s["last"]}
                 for o, ms in fresh["trainers"].items() for m, s in ms.items()}
        assert client == truth, round_
        assert cursor.export(fake)["trainers"] == fresh["trainers"]  # the cached full reply too


def test_the_jobs_list_takes_a_trainers_last_rate_past_its_evaluation_record(tmp_path):
    """The jobs table's samples/s (the sum of the trainers' last rates) is not 0 once the job ends with an
    evaluation: a node's `jobs` reply carries the last record with the latest rate of its tail."""
    from fabtrain.node.history import last_record
    path = tmp_path / "trainer-0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 2.0, "samples_per_s": 900.0}, {"step": 2, "loss": 1.9, "samples_per_s": 950.0},
        {"step": 2, "loss": 1.9, "evaluated": 10, "of": 20}, {"step": 2, "loss": 1.9, "eval_loss": 1.8}]))
    assert last_record(str(path), 20) == {"step": 2, "loss": 1.9, "eval_loss": 1.8, "samples_per_s": 950.0}
    path.write_text(json.dumps({"step": 3, "eval_loss": 1.8}) + "\n")
    assert last_record(str(path)) == {"step": 3, "eval_loss": 1.8}  # none to take: no rate, not 0
