"""One job state everywhere: `fab status`, `fab watch`, /api/job and /metrics over the same node files.

Each case writes a job's files on three local nodes (tests.synthetic: real
node ops, real `sleep` stand-ins for live processes, health.json and
events.jsonl as the agent writes them), then asks all four outputs through
their real code paths and checks that they name the same state.
"""
from __future__ import annotations

import io
import re
import time

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller import lifecycle, report, watch
from fabtrain.controller.collector import Collector
from fabtrain.dashboard import create_app
from fabtrain.contract.states import START_FAILED
from fabtrain.remote import rpc
from fabtrain.remote.session import Session
from tests.support.synthetic import SyntheticJob, local_cluster

pytestmark = pytest.mark.timeout(60)

TOKEN = "jobstate-token-0123456789abcdef"
HOST = "127.0.0.1:8265"
NAMES = {"node0": ["pserver-0"], "node1": ["trainer-0"], "node2": ["trainer-1"]}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobstate")
    cluster = load_cluster(local_cluster(root, {"node0": ["pserver"], "node1": ["trainer"], "node2": ["trainer"]}))
    session = Session(cluster)
    collector = Collector(session)  # the dashboard's: kept across jobs, as `fab dashboard` keeps it
    app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                      "KILL": lambda grace: [], "TESTING": True})
    jobs: list[SyntheticJob] = []

    def new_job(n: int) -> SyntheticJob:
        for old in jobs:
            old.close()  # its live stand-ins go; the new job's `current` link replaces it
        job = SyntheticJob(f"20261122-05{n:02d}00-0001", {node: (cluster.node(node).workspace, names)
                                                          for node, names in NAMES.items()}).start()
        jobs.append(job)
        return job

    yield {"session": session, "collector": collector, "client": app.test_client(), "new_job": new_job}
    for job in jobs:
        job.close()
    session.close()


def four_states(world) -> dict[str, str]:
    """The job's state as each output names it, and fab watch's exit code."""
    text, _ = report.status_text(lifecycle.status(world["session"], health=True))
    out = io.StringIO()
    code = watch.watch(world["session"], interval=0.05, timeout=0, out=out, tty=False)
    last = out.getvalue().splitlines()[-1]
    said = re.fullmatch(r"(?:job \S+: |watch: timed out after 0 s; the job is )([a-z ]+?)( \(.*)?", last)
    world["collector"].poll()
    headers = {"Host": HOST, "Authorization": f"Bearer {TOKEN}"}
    job = world["client"].get("/api/job", headers=headers).get_json()
    metrics = world["client"].get("/metrics", headers=headers).get_data(as_text=True)
    on = re.findall(r'^fabtrain_job_state\{.*state="([a-z ]+)"\} 1$', metrics, re.M)
    # One sentence for what happened: the dashboard's banner is a line of fab status, word for word.
    assert job["sentence"] in text.splitlines(), (job["sentence"], text)
    return {"status": re.match(r"job \S+: ([a-z ]+?)(  code .*)?$", text.splitlines()[0]).group(1),
            "watch": said.group(1) if said else last, "api": job["state"], "metrics": on[0] if len(on) == 1 else on,
            "watch_exit": code, "status_text": text, "watch_text": out.getvalue(), "job": job}


def agent_health(job: SyntheticJob, status: str = "running", states: dict | None = None, **job_fields) -> None:
    """Each node's health.json as its agent writes it: the job's status, and each process's state."""
    states = states or {}
    for node, names in NAMES.items():
        job.health(node, processes=[{"name": n, "state": states.get(n, "running")} for n in names],
                   job={"status": status, "reason": None, "on_failure": "kill-job", "kept": False} | job_fields)


def test_running(world):
    job = world["new_job"](1)
    agent_health(job)
    s = four_states(world)
    assert (s["status"], s["watch"], s["api"], s["metrics"]) == ("running",) * 4, s["status_text"]
    assert s["watch_exit"] == watch.EXIT_TIMEOUT


def test_a_launcher_gone_while_the_agents_still_see_it_running_is_failed_everywhere(world):
    """The fault once seen: trainer-1's launcher was killed (the pid fabtrain printed), its agent (and
    every other) still saw it run; the dashboard said failed while the agents and fab watch said
    running. The launcher takes its program with it (PR_SET_PDEATHSIG), so /proc's word is final:
    all four say failed, naming the process, even before the agents' next look."""
    job = world["new_job"](2)
    job.vanish("node2", "trainer-1")
    agent_health(job)
    s = four_states(world)
    assert (s["status"], s["watch"], s["api"], s["metrics"]) == ("failed",) * 4, s["status_text"]
    assert re.search(r"^node2\s+trainer-1\s+killed", s["status_text"], re.M), s["status_text"]
    assert "trainer-1 on node2" in s["job"]["reason"], s["job"]


def test_a_sigkill_without_an_agent_is_failed_everywhere(world):
    job = world["new_job"](3)
    job.exit("node2", "trainer-1", 137)
    s = four_states(world)
    assert (s["status"], s["watch"], s["api"], s["metrics"]) == ("failed",) * 4, s["status_text"]
    assert "JOB FAILED: trainer-1 on node2 killed by SIGKILL" in s["status_text"]
    assert re.search(r"^node2\s+trainer-1\s+killed \(SIGKILL\)", s["status_text"], re.M)
    assert s["job"]["reason"] == "trainer-1 on node2 killed by SIGKILL" and s["watch_exit"] == watch.EXIT_TIMEOUT


def test_a_finished_banner_names_every_node_and_its_time_stops_at_the_jobs_end(world):
    """node2's agent has not said `finished` yet (it writes its event a moment later): the job is finished,
    and the banner names every node of it, not the agents that said so first. The header's elapsed time
    ends at the job's last event, not when the dashboard first saw the end."""
    job = world["new_job"](5)
    for node, name, code in (("node1", "trainer-0", 0), ("node2", "trainer-1", 0), ("node0", "pserver-0", 143)):
        job.exit(node, name, code)
    end = time.time()  # the job's last event: after the exits
    for node in ("node0", "node1"):
        job.event(node, kind="finished", reason="every trainer exited with code 0", ts=end)
    time.sleep(0.5)  # the dashboard sees the end later than it happened
    s = four_states(world)
    assert s["status"] == "finished" and s["job"]["sentence"].endswith("  [node0, node1, node2]"), s["job"]["sentence"]
    j = s["job"]
    assert j["ended_at"] == end and abs(j["elapsed"] - (end - j["started_at"])) < 0.01, j


def test_a_normal_end_is_finished_everywhere_though_the_pserver_was_stopped(world):
    job = world["new_job"](4)
    for node, name, code in (("node1", "trainer-0", 0), ("node2", "trainer-1", 0), ("node0", "pserver-0", 143)):
        job.exit(node, name, code)
    for node in NAMES:
        job.event(node, kind="finished", reason="every trainer exited with code 0")
    agent_health(job, "finished", {"trainer-0": "exited", "trainer-1": "exited", "pserver-0": "killed"})
    s = four_states(world)
    assert (s["status"], s["watch"], s["api"], s["metrics"]) == ("finished",) * 4, s["status_text"]
    assert s["watch_exit"] == 0


def test_on_failure_keep_is_failed_and_over_everywhere(world):
    job = world["new_job"](5)
    job.exit("node2", "trainer-1", 4)
    for node in NAMES:
        job.event(node, kind="job_failed", reason="trainer-1 on node2 exited with code 4", on_failure="keep",
                  ts=time.time() - 1)
    job.event("node1", kind="kept", reason="on_failure is keep: leaving trainer-0 running")
    agent_health(job, "failed", {"trainer-1": "exited"}, reason="trainer-1 on node2 exited with code 4",
                 on_failure="keep", kept=True)
    s = four_states(world)
    assert (s["status"], s["watch"], s["api"], s["metrics"]) == ("failed",) * 4, s["status_text"]
    assert "survivors left running for debugging" in s["status_text"] and s["watch_exit"] == 1
    assert s["job"]["ended"] is True


def test_a_job_stopped_because_its_start_failed_is_failed_everywhere_with_the_reason(world):
    """All or nothing: the controller stops a start that failed on one node through the kill op, for that job
    only, with the reason; every output reads a failure naming the node, not the user's kill-all."""
    job = world["new_job"](7)
    agent_health(job)
    why = "the start failed: node9: workspace /w is writable by group or others (chmod go-w /w)"
    payload = {"grace": 1, "job_id": job.job_id, "reason": why, "by": START_FAILED}  # as lifecycle sends it
    assert all(r.ok and r.value.killed for r in world["session"].map(lambda t: rpc.call(t, "kill", payload)))
    job.sleepers.clear()
    s = four_states(world)
    assert (s["status"], s["watch"], s["api"], s["metrics"]) == ("failed",) * 4, s["status_text"]
    assert f"JOB FAILED: {why}" in s["status_text"] and s["job"]["reason"] == why, s["status_text"]
    assert s["watch_exit"] == 1


def test_kill_all_is_killed_everywhere(world):
    job = world["new_job"](6)
    agent_health(job)
    assert all(r.ok for r in lifecycle.kill_all(world["session"], grace=1))
    job.sleepers.clear()  # reaped by kill-all's SIGTERM; nothing left to close
    s = four_states(world)
    assert (s["status"], s["watch"], s["api"], s["metrics"]) == ("killed",) * 4, s["status_text"]
    assert s["watch_exit"] == 3


def test_a_straggler_is_marked_alike_in_fab_status_fab_watch_and_the_dashboard_until_the_job_ends(world):
    """The coordinator's agent (node0) lists trainer-1 as reported and still behind: all three mark it,
    the other trainer not; once the job has ended, a snapshot that still lists it marks nothing."""
    job = world["new_job"](8)
    agent_health(job)
    behind = [{"node": "node2", "name": "trainer-1", "rate": 0.5, "median": 1.0, "since": time.time() - 70}]
    job.health("node0", processes=[{"name": "pserver-0", "state": "running"}], stragglers=behind,
               job={"status": "running", "on_failure": "kill-job"})
    s = four_states(world)
    mark = "STRAGGLER 0.5 vs median 1 steps/s"
    assert re.search(rf"^node2\s+trainer-1\s+running\s.*{mark}$", s["status_text"], re.M), s["status_text"]
    assert s["status_text"].count("STRAGGLER") == 1, s["status_text"]
    assert f"trainer-1 running {mark}" in s["watch_text"] and s["watch_text"].count("STRAGGLER") >= 1, s["watch_text"]
    marks = {t["name"]: t["straggler"] for t in s["job"]["trainers"]}
    assert marks == {"trainer-0": None, "trainer-1": {"rate": 0.5, "median": 1.0, "rank": None, "cause": None,
                                                      "ratio": None, "mark": mark}}, marks

    for node, name in (("node1", "trainer-0"), ("node2", "trainer-1"), ("node0", "pserver-0")):
        job.exit(node, name, 0 if name.startswith("trainer") else 143)
    agent_health(job, "finished", {"trainer-0": "exited", "trainer-1": "exited", "pserver-0": "killed"})
    job.health("node0", processes=[{"name": "pserver-0", "state": "killed"}], stragglers=behind,
               job={"status": "finished", "on_failure": "kill-job"})
    s = four_states(world)
    assert s["status"] == "finished" and "STRAGGLER" not in s["status_text"] + s["watch_text"], s["status_text"]
    assert all(t["straggler"] is None for t in s["job"]["trainers"]), s["job"]["trainers"]


def test_the_sentence_says_state_cause_and_what_was_done_with_the_time_left():
    """verdict_text.sentence, the one line of fab status and the dashboard's banner, for each state."""
    from fabtrain.controller.jobstate import JobState, ProcessView, Verdict
    from fabtrain.controller.verdict_text import duration_text, sentence
    from fabtrain.contract.states import ProcessState

    assert [duration_text(s) for s in (-3, 0.4, 7, 560, 7500)] == ["0s", "0s", "7s", "9m 20s", "2h 05m"]
    run = (ProcessView("node1", "trainer-0", ProcessState.RUNNING), ProcessView("node2", "trainer-1", ProcessState.RUNNING))
    cause = "trainer-1 on node2 killed by SIGKILL (exit code 137)"
    cases = [
        (Verdict(JobState.RUNNING, processes=run, unreachable=("node3",), generation=1, restarts_left=2),
         "job running: 2 of 2 processes on 2 nodes (generation 1, 2 restarts left); "
         "not reached: node3 (what runs there is not seen)"),
        (Verdict(JobState.STARTING, "waiting for the first metrics record of trainer-1", startup_deadline=1560.0),
         "job starting: waiting for the first metrics record of trainer-1; "
         "startup_timeout fails the start in 9m 20s if it does not come together"),
        (Verdict(JobState.RESTARTING, "restarting after: " + cause, generation=2, restarts_left=0, restart_at=1007.0),
         f"JOB RESTARTING after {cause}: generation 2 starts in 7s, 0 restarts left after it"),
        (Verdict(JobState.RESTARTING, "restarting after: " + cause, generation=2, restart_at=990.0),
         f"JOB RESTARTING after {cause}: generation 2 is starting"),
        (Verdict(JobState.FAILED, cause, on_failure="kill-job", said_by=("node1", "node2")),
         f"JOB FAILED: {cause}; torn down on every node (on_failure kill-job)  [node1, node2]"),
        (Verdict(JobState.FINISHED, "every trainer exited with code 0", said_by=("node1",)),
         "job finished: every trainer exited with code 0  [node1]"),
        (Verdict(JobState.KILLED, "stopped by fab kill-all"), "job killed: stopped by fab kill-all"),
        (Verdict(JobState.UNKNOWN, "no node reachable", unreachable=("node1",)), "job state unknown: no node reachable"),
        (Verdict(JobState.NO_JOB, "no job on any node"), "no job on any node"),
    ]
    for verdict, said in cases:
        assert sentence(verdict, now=1000.0) == said
