"""The agents' alerts (fabtrain/node/agent/notify.py) through the agent's event writer, and notify's config."""
import json
import sys
import time
from types import SimpleNamespace

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.errors import UserError
from fabtrain.node.agent.events import EventLog
from tests.support.procscan import wait_for
from tests.support import REPO
from tests.support.webhook import Receiver


def job_dir(tmp_path, node, notify, nodes=("node1", "node2")):
    jd = tmp_path / node
    (jd / "run").mkdir(parents=True)
    (jd / "job.json").write_text(json.dumps({
        "job_id": "J1", "cluster": "c", "node": node, "nodes": [{"name": n} for n in nodes],
        "watchdog": {"notify": notify}}))
    return EventLog(str(jd / "events.jsonl"), node, out=open("/dev/null", "w"))


@pytest.fixture
def hook():
    r = Receiver()
    yield r
    r.close()


def test_a_restart_is_one_alert_a_generation_when_it_is_decided(tmp_path, hook):
    notify = {"webhook": hook.url, "on": ["restart"]}
    first, second = job_dir(tmp_path, "node1", notify), job_dir(tmp_path, "node2", notify)
    for generation in (1, 2):
        for log in (first, second):
            for _ in range(2):  # the agent's own note and the coordinator's word
                log.write("restarting", "trainer-1 on node2 killed by SIGKILL", generation=generation, backoff=1.0,
                          restarts_left=3 - generation)
            log.write("restarted", "generation %d" % generation, generation=generation)  # not a second alert
    assert wait_for(lambda: len(hook.got) >= 2, timeout=5)
    time.sleep(0.5)
    assert sorted((b["kind"], b["node"], b["event"]["generation"]) for _, b in hook.got) == [
        ("restart", "node1", 1), ("restart", "node1", 2)]
    assert all("killed by SIGKILL" in b["text"] and b["event"]["backoff"] == 1.0 for _, b in hook.got)


def test_job_events_from_the_first_node_only_and_hangs_from_any(tmp_path, hook):
    notify = {"webhook": hook.url, "on": ["failed", "hang", "finished"]}
    first, second = job_dir(tmp_path, "node1", notify), job_dir(tmp_path, "node2", notify)
    for log in (first, second):
        log.write("job_failed", "trainer-1 on node2 exited with code 3", origin="node2")
        log.write("job_failed", "trainer-1 on node2 exited with code 3")  # the coordinator's word too
        log.write("exited", "exited 3", "trainer-1")  # not an alert
    second.write("hang", "no progress for 3 s", "trainer-1", frame="/w/train.py:42 in all_reduce")
    first.write("restarted", "restart 1 of 3", "trainer-0")  # not in `on`
    assert wait_for(lambda: len(hook.got) >= 2, timeout=5)
    time.sleep(0.5)
    kinds = sorted((b["kind"], b["node"]) for _, b in hook.got)
    assert kinds == [("failed", "node1"), ("hang", "node2")]
    failed = next(b for _, b in hook.got if b["kind"] == "failed")
    assert failed["text"] == "fabtrain: job J1 failed on node2: trainer-1 on node2 exited with code 3"
    assert failed["event"]["kind"] == "job_failed" and failed["job_id"] == "J1"
    hang = next(b for _, b in hook.got if b["kind"] == "hang")
    assert hang["text"].endswith("no progress for 3 s [at /w/train.py:42 in all_reduce]"), hang["text"]


def test_kill_all_is_no_failure_alert_by_its_reason_or_by_the_marker(tmp_path, hook):
    """kill-all reaches the nodes in parallel: the first node may hear a peer's "stopped by fab kill-all"
    through the coordinator before its own marker exists, or see its own marker first."""
    notify = {"webhook": hook.url, "on": ["failed"]}
    by_peer = job_dir(tmp_path / "a", "node1", notify)
    by_peer.write("job_failed", "trainer-1 on node2: stopped by fab kill-all", origin="node2")
    by_marker = job_dir(tmp_path / "b", "node1", notify)
    (tmp_path / "b" / "node1" / "killed").touch()
    by_marker.write("job_failed", "trainer-0 on node1 killed by SIGTERM")
    really = job_dir(tmp_path / "c", "node1", notify)
    really.write("job_failed", "trainer-1 on node2 killed by SIGKILL", origin="node2")
    assert wait_for(lambda: hook.got, timeout=5)
    time.sleep(0.5)
    assert [b["text"] for _, b in hook.got] == [
        "fabtrain: job J1 failed on node2: trainer-1 on node2 killed by SIGKILL"]


def test_a_webhook_that_fails_is_an_event_and_the_writer_does_not_wait(tmp_path):
    log = job_dir(tmp_path, "node1", {"webhook": "http://127.0.0.1:9/nothing-listens", "on": ["failed"]})
    t0 = time.monotonic()
    log.write("job_failed", "boom")
    assert time.monotonic() - t0 < 0.2  # sent on its own thread
    log.notify.wait(15)
    events = [json.loads(x) for x in (tmp_path / "node1" / "events.jsonl").read_text().splitlines()]
    bad = [e for e in events if e["kind"] == "notify_failed"]
    assert len(bad) == 1 and "after 3 tries" in bad[0]["reason"] and "boom" in bad[0]["reason"]


def test_command_gets_the_event_on_stdin(tmp_path):
    out = tmp_path / "alert.json"
    script = f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"
    log = job_dir(tmp_path, "node1", {"command": [sys.executable, "-c", script], "on": ["finished"]})
    log.write("finished", "every trainer exited with code 0")
    log.notify.wait(10)
    body = json.loads(out.read_text())
    assert body["kind"] == "finished" and body["event"]["reason"] == "every trainer exited with code 0"
    failing = job_dir(tmp_path, "node9", {"command": [sys.executable, "-c", "import sys; sys.exit('no pager')"], "on": ["finished"]},
                      nodes=("node9",))
    failing.write("finished", "done")
    failing.notify.wait(10)
    text = (tmp_path / "node9" / "events.jsonl").read_text()
    assert "notify_failed" in text and "exited 1: no pager" in text


def doc(notify):
    return {"cluster": {"name": "c"}, "nodes": [{"name": "n1", "host": "local", "roles": ["trainer"]}],
            "job": {"mode": "collective", "trainer": {"command": "python x.py"}, "watchdog": {"notify": notify}}}


def test_notify_config_and_what_the_plan_passes_on():
    from fabtrain.plan.plan import make_plan

    c = parse_cluster(doc({"webhook": "https://example.com/hook", "command": ["pager", "--now"], "on": ["failed"]}))
    assert c.job.watchdog.notify.on == ("failed",) and c.job.watchdog.notify.command == ("pager", "--now")
    plan = make_plan(c, "J1")
    assert plan.job_json("n1")["watchdog"]["notify"] == {"webhook": "https://example.com/hook",
                                                         "command": ["pager", "--now"], "on": ["failed"]}
    assert parse_cluster(doc({"webhook": "http://h:1/x"})).job.watchdog.notify.on == ("failed", "hang", "restart",
                                                                                      "finished")
    for bad, says in [({"webhook": "ftp://x"}, "job.watchdog.notify.webhook: 'ftp://x' is not an http"),
                      ({"command": "pager --now"}, "job.watchdog.notify.command: must be a non-empty list"),
                      ({"webhook": "http://h/x", "on": ["failed", "exploded"]}, "job.watchdog.notify.on[1]: must be one of"),
                      ({"on": ["failed"]}, "job.watchdog.notify: give a webhook, a command, or both"),
                      ({"webhook": "http://h/x", "email": "a@b"}, "job.watchdog.notify.email: unknown field")]:
        with pytest.raises(UserError) as e:
            parse_cluster(doc(bad))
        assert says in str(e.value), str(e.value)


def test_the_prometheus_alert_rules_name_only_metrics_the_dashboard_exports():
    import re
    import yaml

    repo = REPO
    source = (repo / "fabtrain/dashboard/prometheus.py").read_text()
    exported = set(re.findall(r'"(fabtrain_[a-z_]+)"', source))
    rules = yaml.safe_load((repo / "examples/prometheus-alerts.yml").read_text())["groups"][0]["rules"]
    used = {m for r in rules for m in re.findall(r"\bfabtrain_[a-z_]+", r["expr"])}
    assert used and used <= exported, used - exported


def test_a_hang_alert_names_the_rank_to_blame_and_the_coordinators_blame_is_one_too(tmp_path, hook):
    notify = {"webhook": hook.url, "on": ["hang"]}
    first, second = job_dir(tmp_path, "node1", notify), job_dir(tmp_path, "node2", notify)
    said = "rank 3 on node2 stopped stepping at step 12 in `t.py:5 in spin`; ranks 0, 1, 2 wait in all_reduce"
    second.write("hang", "no progress for 3 s", "trainer-1", frame="/w/t.py:5 in spin", blame=said)
    first.write("blame", said, "trainer-1", origin="node2", rank=3, step=12)
    assert wait_for(lambda: len(hook.got) >= 2, timeout=5)
    texts = sorted(b["text"] for _, b in hook.got)
    assert texts == [f"fabtrain: job J1 hang trainer-1 on node2: no progress for 3 s [{said}]",
                     f"fabtrain: job J1 hang trainer-1 on node2: {said}"], texts


def test_a_one_node_jobs_hang_and_its_blame_in_the_same_millisecond_are_two_alerts(tmp_path, hook, monkeypatch):
    # Seen in a real run: the coordinator's node is the hung node, so its `hang` and the job-wide `blame`
    # came from one agent step with one timestamp, and the blame's alert was taken for the hang's.
    notify = {"webhook": hook.url, "on": ["hang"]}
    only = job_dir(tmp_path, "n0", notify, nodes=("n0",))
    # The writer's clock only (time.time itself stays: wait_for runs on it).
    monkeypatch.setattr("fabtrain.node.agent.events.time", SimpleNamespace(time=lambda: 1796007628.937, strftime=time.strftime))
    said = "rank 1 on n0 stopped stepping at step 10 in `t.py:5 in spin`; ranks 0, 2 wait in backward"
    only.write("hang", "no progress for 4 s", "trainer-0", blame=said)
    only.write("blame", said, "trainer-0", origin="n0", rank=1, step=10)
    assert wait_for(lambda: len(hook.got) >= 2, timeout=5), hook.got
    assert sorted(b["event"]["kind"] for _, b in hook.got) == ["blame", "hang"]
    assert {b["event"]["ts"] for _, b in hook.got} == {1796007628.937}
