"""The controller's view: series thinning, the job's state, and node records that are not to be trusted."""
import io
import json
import re
import time

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller import records
from fabtrain.controller.collector import Collector
from fabtrain.controller.jobstate import NodeObservation, job_verdict
from fabtrain.controller.series import Series
from fabtrain.controller.watch import frame, watch
from fabtrain.dashboard import create_app
from fabtrain.contract.states import ProcessState, recorded_state
from fabtrain.remote.session import Session
from tests.support.synthetic import SyntheticJob, local_cluster


def test_series_stays_bounded_evenly_spaced_and_keeps_the_latest_point():
    s = Series(max_points=100)
    for step in range(1_000_000):
        s.add(step, 1.0 / (step + 1))
    pts = s.export()
    assert len(pts) <= 2 * 100 + 1
    assert pts[0][0] == 0 and pts[-1] == (999_999, 1.0 / 1_000_000)
    gaps = {b[0] - a[0] for a, b in zip(pts[:-2], pts[1:-1])}
    assert len(gaps) == 1  # one stride over the whole run: the chart keeps its shape


def test_a_short_series_is_kept_whole():
    s = Series(max_points=100)
    for step in range(50):
        s.add(step, step)
    assert s.export() == [(i, i) for i in range(50)]


def observe(processes, events=(), killed=False, agent=None):
    return [NodeObservation("n0", True, "J", tuple(processes), killed, agent, 0.5 if agent else None, tuple(events))]


def p(name, state, code=None):
    return {"name": name, "state": state, "exit_code": code}


@pytest.mark.parametrize("procs,events,killed,expected", [
    ([p("pserver-0", "running"), p("trainer-0", "running")], [], False, "running"),
    ([p("pserver-0", "not started"), p("trainer-0", "not started")], [], False, "starting"),
    ([p("pserver-0", "running"), p("trainer-0", "exited", 0)], [], False, "finished"),
    # After a normal end the agents stop the pservers (SIGTERM -> 143): still finished.
    ([p("pserver-0", "exited", 143), p("trainer-0", "exited", 0)], [{"kind": "finished"}], False, "finished"),
    ([p("pserver-0", "exited", 143), p("trainer-0", "exited", 1)], [{"kind": "job_failed"}], False, "failed"),
    ([p("pserver-0", "running"), p("trainer-0", "exited", 137)], [], False, "failed"),
    ([p("pserver-0", "killed"), p("trainer-0", "killed")], [{"kind": "killed"}], True, "killed"),
    ([p("pserver-0", "running"), p("trainer-0", "lost")], [], False, "failed"),
    ([], [], False, "starting"),
])
def test_job_state(procs, events, killed, expected):
    assert job_verdict(observe(procs, events, killed)).state == expected


def test_exit_code_137_is_killed_by_sigkill_not_an_exit():
    v = job_verdict(observe([p("pserver-0", "running"), p("trainer-0", "exited", 137)]))
    trainer = v.process("n0", "trainer-0")
    assert (trainer.state, trainer.signal, trainer.exit_code, trainer.label) == ("killed", "SIGKILL", 137, "killed (SIGKILL)")
    assert v.reason == "trainer-0 on n0 killed by SIGKILL" and not v.ended  # pserver-0 still runs
    assert recorded_state(False, None, 137, None) == recorded_state(False, "killed", None, 9) == ProcessState.KILLED
    assert recorded_state(False, None, 3, None) == ProcessState.EXITED
    # Gone with no exit record: its launcher was killed, and took the program with it (PDEATHSIG).
    assert recorded_state(False, None, None, None) == ProcessState.KILLED
    assert recorded_state(False, "lost", None, None) == ProcessState.LOST  # what a node said of a pre-boot record
    assert recorded_state(True, "T", None, None) == ProcessState.STOPPED


def test_a_process_whose_launcher_is_gone_runs_while_its_agent_sees_it():
    agent = {"ts": 1.0, "job_id": "J", "interval": 1.0, "processes": [{"name": "trainer-0", "state": "running"}],
             "job": {"status": "running"}}
    v = job_verdict(observe([p("pserver-0", "running"), p("trainer-0", "lost")], agent=agent))
    assert v.state == "running" and v.process("n0", "trainer-0").label == "running (launcher gone)"
    assert v.notes == ("trainer-0 on n0: its launcher is gone; its agent still sees it running",)
    # An agent silent for long is not believed: lost is lost.
    stale = [NodeObservation("n0", True, "J", (p("pserver-0", "running"), p("trainer-0", "lost")), False, agent, 60.0)]
    assert job_verdict(stale).state == "failed"


def test_the_agents_word_on_the_job_comes_before_exit_codes():
    failed = {"ts": 1.0, "job_id": "J", "job": {"status": "failed", "reason": "trainer-1 on n1 hung",
                                                 "on_failure": "keep", "kept": True}}
    v = job_verdict(observe([p("pserver-0", "running"), p("trainer-0", "running")], agent=failed))
    assert (v.state, v.reason, v.kept, v.ended, v.said_by) == ("failed", "trainer-1 on n1 hung", True, True, ("n0",))
    assert "on_failure keep: survivors left running" in v.summary()


def test_nothing_reachable_is_unknown_and_no_job_is_no_job():
    assert job_verdict([NodeObservation("n0", False, error="refused")]).state == "unknown"
    assert job_verdict([NodeObservation("n0", None)]).state == "unknown"
    assert job_verdict([NodeObservation("n0", True)]).state == "no job"


# -- records from the nodes are untrusted ---------------------------------------------------------

TOKEN = "collector-token-0123456789abcdef"
HOST = "127.0.0.1:8265"
JOB = "20261122-060000-0bad"
BAD_EVENTS = [
    b'{"ts": NaN, "kind": "hang", "reason": "a NaN ts"}\n',
    b'{"ts": 1763790000, "kind": "hang", "reason": "x", "pid": Infinity}\n',
    b'{"ts": 1763790000, "kind": ["job_failed"], "reason": "a list-valued kind"}\n',
    b'{"ts": 1763790000, "kind": "hang", "reason": "' + b"x" * 1_000_000 + b'"}\n',  # a 1 MB line
    b'[1, 2, 3]\n',
    b'"just text"\n',
    b'{"ts": 1763790000, "kind": "hang", "reason": "not UTF-8: \xff\xfe"}\n',
    b'{"ts": 1763790000, "kind": "hang", "reason": {"nested": "object"}}\n',
]
BAD_METRICS = [
    b'{"ts": 1763790000, "step": 10, "loss": NaN}\n',
    b'{"ts": 1763790000, "step": 10, "loss": -Infinity}\n',
    b'{"ts": 1763790000, "step": [10], "loss": 1.0}\n',
    b'{"ts": 1763790000, "step": 10, "loss": "1.0"}\n',
    b'{"ts": 1763790000, "step": 10, "loss": 1.0, "note": "' + b"y" * 1_000_000 + b'"}\n',
    b'null\n',
    b'\xff\xfe\xfd\n',
]


def strict_json(data: bytes):
    """What a browser's JSON.parse accepts: no NaN, no Infinity."""
    def refuse(name):
        raise ValueError(f"{name} in a reply")
    return json.loads(data, parse_constant=refuse)


@pytest.fixture
def planted(tmp_path):
    """A job whose node1 files hold malformed lines between good ones, read by a real Collector."""
    cluster = load_cluster(local_cluster(tmp_path, {"node0": ["pserver"], "node1": ["trainer"]}))
    job = SyntheticJob(JOB, {"node0": (cluster.node("node0").workspace, ["pserver-0"]),
                             "node1": (cluster.node("node1").workspace, ["trainer-0"])}).start()
    job.metrics("node1", "trainer-0", range(0, 10))
    job.event("node1", kind="hang", role="trainer", rank=0, reason="before the bad lines")
    for line in BAD_EVENTS:
        job.append("node1", "events.jsonl", line)
    for line in BAD_METRICS:
        job.append("node1", "metrics/trainer-0.jsonl", line)
    job.metrics("node1", "trainer-0", range(10, 20))
    job.event("node1", kind="zombie", role="trainer", rank=0, reason="after the bad lines")
    (job.job_dir("node0") / "health.json").write_text(
        '{"ts": %f, "job_id": "%s", "interval": 1.0, "host": {"cpu_percent": NaN, "mem_percent": 41.5},'
        ' "gpus": [{"index": 0, "util": Infinity}], "processes": "not a list"}' % (time.time(), JOB))
    session = Session(cluster)
    collector = Collector(session)
    for _ in range(4):  # node ops sends at most 1 MiB of a file a poll: the 1 MB lines take more than one
        collector.poll()
    app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                      "KILL": lambda grace: [], "TESTING": True})
    yield {"job": job, "session": session, "collector": collector, "client": app.test_client()}
    job.close()
    session.close()


def api(client, path):
    r = client.get(path, headers={"Host": HOST, "Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_data()


def test_malformed_node_records_are_dropped_counted_and_every_view_answers(planted):
    job = strict_json(api(planted["client"], "/api/job"))
    dropped = job["dropped"]["node1"]
    assert dropped["count"] == len(BAD_EVENTS) + len(BAD_METRICS) == job["dropped_total"], dropped
    assert dropped["sources"] == {"events.jsonl": len(BAD_EVENTS), "metrics/trainer-0.jsonl": len(BAD_METRICS)}
    assert dropped["last"].startswith("metrics/trainer-0.jsonl: ")  # which file, and why
    assert job["state"] == "running" and "node0" not in job["dropped"]
    (trainer,) = job["trainers"]
    assert trainer["step"] == 19 and trainer["records"] == 20  # the good records around the bad ones

    events = strict_json(api(planted["client"], "/api/events"))["events"]
    assert [e["reason"] for e in events] == ["after the bad lines", "before the bad lines"]
    cluster = strict_json(api(planted["client"], "/api/cluster"))
    node0 = next(n for n in cluster["nodes"] if n["name"] == "node0")
    assert node0["health"]["host"] == {"mem_percent": 41.5}  # NaN cpu left out, the rest kept
    strict_json(api(planted["client"], "/api/metrics"))

    text = api(planted["client"], "/metrics").decode()
    expected = len(BAD_EVENTS) + len(BAD_METRICS)
    assert f'fabtrain_records_dropped_total{{cluster="synthetic",node="node1"}} {expected}' in text
    assert 'fabtrain_records_dropped_total{cluster="synthetic",node="node0"} 0' in text
    assert "# TYPE fabtrain_records_dropped_total counter" in text


@pytest.mark.parametrize("line,why", [
    (BAD_EVENTS[0], "NaN is not JSON"), (BAD_EVENTS[1], "Infinity is not JSON"),
    (BAD_EVENTS[2], "field 'kind' is a list, not a kind"), (BAD_EVENTS[3], f"a line of {len(BAD_EVENTS[3]) - 1} characters (limit 65536)"),
    (BAD_EVENTS[4], "a list, not a JSON object"), (BAD_EVENTS[5], "text, not a JSON object"),
    (BAD_EVENTS[7], "field 'reason' is an object, not text"),
])
def test_each_malformed_event_says_why(line, why):
    with pytest.raises(records.Malformed, match=re.escape(why)):
        records.event(line.decode().rstrip("\n"))


def test_fab_watch_answers_and_shows_the_dropped_records(planted):
    lines = frame(planted["collector"].snapshot(), time.time(), time.time())
    expected = len(BAD_EVENTS) + len(BAD_METRICS)
    assert any(line.startswith(f"note: node1: {expected} malformed record(s) dropped (latest: metrics/trainer-0.jsonl")
               for line in lines), lines
    out = io.StringIO()
    assert watch(planted["session"], interval=0.05, timeout=0, out=out, tty=False) == 124  # running: no crash
    assert f"node1: {expected} malformed record(s) dropped" in out.getvalue()
    assert "after the bad lines" in out.getvalue()


def test_a_line_longer_than_a_poll_reads_is_skipped_not_asked_for_forever(planted):
    job, collector = planted["job"], planted["collector"]
    before = collector.snapshot().dropped["node1"]["count"]
    job.append("node1", "events.jsonl", b'{"kind": "hang", "reason": "' + b"z" * (3 << 20) + b'"}\n')
    job.event("node1", kind="orphan", reason="after a 3 MiB line")
    for _ in range(6):
        collector.poll_node("node1")
    snap = collector.snapshot()
    assert snap.events[0]["reason"] == "after a 3 MiB line"
    assert snap.dropped["node1"]["count"] == before + 1
    assert snap.dropped["node1"]["last"] == f"events.jsonl: a line over {Collector.MAX_BYTES} bytes"


def test_a_bad_health_json_is_counted_once_not_at_every_poll(planted):
    job, collector = planted["job"], planted["collector"]
    (job.job_dir("node0") / "health.json").write_text('{"ts": NaN, "job_id": "%s"}' % JOB)
    for _ in range(3):
        collector.poll_node("node0")
    snap = collector.snapshot()
    assert snap.dropped["node0"] == {"count": 1, "sources": {"health.json": 1},
                                     "last": "health.json: field 'ts' is not a finite number"}
    assert snap.node("node0").health is None
    node0 = next(n for n in strict_json(api(planted["client"], "/api/cluster"))["nodes"] if n["name"] == "node0")
    assert node0["health"] is None and node0["up"] is True


@pytest.fixture
def busy(tmp_path):
    """A running job whose nodes' CPU figures and trainer steps change all the time; nothing else does."""
    cluster = load_cluster(local_cluster(tmp_path, {"node0": ["pserver"], "node1": ["trainer"]}))
    job = SyntheticJob(JOB, {"node0": (cluster.node("node0").workspace, ["pserver-0"]),
                             "node1": (cluster.node("node1").workspace, ["trainer-0"])}).start()
    session = Session(cluster)
    yield job, session
    job.close()
    session.close()


def test_plain_watch_prints_a_frame_on_a_state_change_not_on_cpu_or_progress(busy):
    import threading
    job, session = busy
    stop = threading.Event()

    def churn():
        step = 0
        while not stop.is_set():
            for node in ("node0", "node1"):
                job.health(node, cpu=10.0 + step % 80)
            job.metrics("node1", "trainer-0", range(step, step + 5))
            step += 5
            stop.wait(0.05)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        out = io.StringIO()
        assert watch(session, interval=0.1, timeout=2.0, out=out, tty=False) == 124
    finally:
        stop.set()
        churner.join()
    frames = [line for line in out.getvalue().splitlines() if line.startswith(f"job {JOB}: ")]
    assert len(frames) == 1, out.getvalue()
    job.exit("node1", "trainer-0", 1)  # a state change: a new frame at once
    out = io.StringIO()
    watch(session, interval=0.1, timeout=0.5, out=out, tty=False)
    assert "trainer-0 exited (1)" in out.getvalue() or "failed" in out.getvalue(), out.getvalue()


def test_watch_ages_the_last_record_from_its_own_time(busy):
    job, session = busy
    job.metrics("node1", "trainer-0", range(0, 3), t0=time.time() - 3600, dt=1.0)
    collector = Collector(session)
    collector.poll()
    row = next(line for line in frame(collector.snapshot(), time.time(), time.time()) if line.startswith("trainer-0"))
    assert row.endswith("60m ago"), row
