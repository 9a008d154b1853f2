"""One seam: a Backend returns typed records and never prints nor exits; fab's tasks, the dashboard's Kill and
its header go through it; only a place's own modules ask which place the cluster file describes."""
from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest

from fabtrain import backends
from fabtrain.backends.results import JobStatus, NodeReplies, Stopped
from fabtrain.config.cluster import parse_cluster
from fabtrain.contract.opreplies import Kill, Killed
from fabtrain.controller import report
from fabtrain.dashboard import create_app
from fabtrain.errors import UserError
from fabtrain.remote.session import Session
from fabtrain.remote.transport import Reply
from fabtrain.slurm import jobs
from tests.support import REPO

JOB = {"mode": "collective", "trainer": {"command": "python train.py"}}
TOKEN, HOST = "seam-token", "127.0.0.1:8265"
DASHBOARD = "the dashboard's Kill button"

# A place's own modules: they are what the place is, so they read its section of the cluster file.
PLACES_OWN = ("fabtrain/backends/", "fabtrain/config/", "fabtrain/slurm/", "fabtrain/plan/kubernetes.py",
              "fabtrain/controller/kubectl.py", "fabtrain/controller/kubeexport.py")


def _python_files(under: str):
    return sorted((REPO / under).rglob("*.py"))


def _prints_or_exits(path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"{path.name}:{node.lineno}: print")
        if isinstance(node, ast.Name) and node.id in ("Exit", "exit"):
            found.append(f"{path.name}:{node.lineno}: {node.id}")
        if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr", "exit"):
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_a_backend_never_prints_nor_exits(tmp_path):
    assert [hit for f in _python_files("fabtrain/backends") for hit in _prints_or_exits(f)] == []
    talking = tmp_path / "verb.py"  # the check finds what it is for
    talking.write_text("import sys\nfrom invoke import Exit\ndef kill_all(s):\n    print('x', file=sys.stderr)\n"
                       "    raise Exit('no', code=1)\n")
    assert len(_prints_or_exits(talking)) == 3


def _place_reads(path) -> list[str]:
    return [f"{path}:{node.lineno}: .{node.attr}"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "kubernetes")]


def test_only_a_places_own_modules_read_which_place_the_cluster_file_describes(tmp_path):
    files = [f for f in _python_files("fabtrain") if not str(f.relative_to(REPO)).startswith(PLACES_OWN)]
    assert [hit for f in files for hit in _place_reads(f)] == []
    asking = tmp_path / "lifecycle.py"
    asking.write_text("def check(cluster):\n    return {'torch_cuda': False} if cluster.scheduler else {}\n")
    assert len(_place_reads(asking)) == 1


def slurm_session(tmp_path, monkeypatch) -> Session:
    monkeypatch.setenv("FABTRAIN_STATE_DIR", str(tmp_path / "state"))
    return Session(parse_cluster({"cluster": {"name": "lab", "workspace": str(tmp_path / "ws")}, "job": JOB,
                                  "scheduler": {"kind": "slurm", "nodes": 2}}, "cluster.yaml"))


def test_the_dashboards_kill_and_header_go_through_the_clusters_backend(tmp_path, monkeypatch):
    """On Slurm, the Kill button is Slurm's cancel (the job ends CANCELLED, as with fab kill-all), by the dashboard."""
    asked = []

    def cancel_all(session, grace, by):
        asked.append((grace, by))
        return jobs.Cancelled([jobs.SlurmState("7", "CANCELLED")], marked=["node0", "node1"], left=[])

    monkeypatch.setattr(jobs, "cancel_all", cancel_all)
    session = slurm_session(tmp_path, monkeypatch)
    app = create_app({"COLLECTOR": SimpleNamespace(session=session), "DASHBOARD_TOKEN": TOKEN,
                      "ALLOWED_HOSTS": [HOST], "TESTING": True})
    assert isinstance(app.config["SCHEDULER_LINE"], jobs.ShownLine)  # the header: Slurm's own line, as fab watch's
    r = app.test_client().post("/api/kill", json={"grace": 3}, headers={"Host": HOST, "Authorization": f"Bearer {TOKEN}"})
    body = r.get_json()
    assert r.status_code == 200 and asked == [(3.0, DASHBOARD)], (body, asked)
    assert body["ok"] is True and body["nodes"] == [] and body["place"] == ["slurm job 7: CANCELLED"], body


def test_a_kill_the_place_refuses_is_its_one_line_not_a_crash(tmp_path, monkeypatch):
    def cancel_all(session, grace, by):
        raise UserError("scancel: slurm_load_jobs error: Unable to contact slurm controller")

    monkeypatch.setattr(jobs, "cancel_all", cancel_all)
    app = create_app({"COLLECTOR": SimpleNamespace(session=slurm_session(tmp_path, monkeypatch)),
                      "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST], "SCHEDULER_LINE": None, "TESTING": True})
    r = app.test_client().post("/api/kill", headers={"Host": HOST, "Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 502 and "Unable to contact slurm controller" in r.get_json()["error"], r.get_json()


def test_a_stop_that_leaves_something_says_it_once_as_data(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "cancel_all", lambda session, grace, by: jobs.Cancelled(
        [jobs.SlurmState("7", "RUNNING")], marked=[], left=["7"]))
    stopped = backends.SLURM.kill_all(slurm_session(tmp_path, monkeypatch), grace=1)
    assert isinstance(stopped, Stopped) and not stopped.clean and stopped.by == "fab kill-all"
    assert stopped.problem == "kill-all: slurm job 7 has not ended yet (see `squeue`)"
    assert report.stopped_text(stopped) == "slurm job 7: RUNNING"

    killed = Reply("a", True, Kill(killed=[Killed(name="trainer-0", pid=5, signal="SIGTERM", job_id="j")], left=[9],
                                   untrusted=[]))
    nodes = Stopped.of_nodes([killed, Reply("b", False, error="b: unreachable")], by=DASHBOARD)
    assert not nodes.clean and nodes.problem == "kill-all: some processes may still be alive (see above)"
    assert report.stopped_text(nodes).splitlines() == ["a: killed trainer-0 pid 5 (SIGTERM)", "a: STILL ALIVE: pids 9",
                                                       "b: FAILED: unreachable"]
    assert Stopped.of_nodes([Reply("a", True, Kill(killed=[], left=[], untrusted=[]))]).clean


def test_node_replies_keep_partial_failure_as_data():
    replies = NodeReplies([Reply("a", True, 1), Reply("b", False, error="b: down")], "deploy failed on some nodes")
    assert not replies.ok and [r.node for r in replies.failed] == ["b"] and [r.node for r in replies.succeeded] == ["a"]
    assert report.replies_text(replies.replies, lambda v: f"got {v}") == ("a: got 1\nb: FAILED: down", True)


@pytest.mark.parametrize("shown, said", [
    (JobStatus(waiting="slurm job 7: PENDING (Resources)"), ("slurm job 7: PENDING (Resources)", False)),
    (JobStatus(pods="pod table", pods_failed=True), ("pod table", True)),
])
def test_fab_status_says_what_the_place_holds_instead_of_the_nodes_table(shown, said):
    assert report.job_status_text(shown) == said


def test_slurm_follows_the_job_it_submitted_last_with_its_own_line(tmp_path, monkeypatch):
    session = slurm_session(tmp_path, monkeypatch)
    monkeypatch.setattr(jobs, "submitted_job", lambda s: "20261129-000000-abcd")
    followed = backends.SLURM.watch(session)
    assert followed.job_id == "20261129-000000-abcd" and isinstance(followed.place_line, jobs.ShownLine)
    assert backends.SLURM.watch(session, job="20261129-000000-beef").job_id == "20261129-000000-beef"
    nodes = Session(parse_cluster({"cluster": {"name": "lab"}, "job": JOB,
                                   "nodes": [{"name": "a", "host": "local", "roles": ["trainer"]}]}, "cluster.yaml"))
    assert backends.NODES.watch(nodes).job_id is None and backends.NODES.watch(nodes).place_line is None


def test_a_slurm_start_tells_its_progress_and_returns_why_it_failed(tmp_path, monkeypatch):
    submitted = jobs.Submitted("20261129-000000-abcd", "7", plan=None, script="")
    monkeypatch.setattr(jobs, "submit", lambda session, roles, resume_from=None, force=False: submitted)

    def wait_for_allocation(session, slurm_job, show):
        show("slurm job 7: PENDING", False)
        return jobs.SlurmState("7", "FAILED", exit_code="1:0")

    monkeypatch.setattr(jobs, "wait_for_allocation", wait_for_allocation)
    heard = []
    started = backends.SLURM.start(slurm_session(tmp_path, monkeypatch), ("trainer",),
                                   progress=lambda line, final: heard.append((line, final)))
    assert heard == [("job 20261129-000000-abcd: submitted as slurm job 7", True), ("slurm job 7: PENDING", False)]
    assert started.job_id == "20261129-000000-abcd" and report.started_lines(started) == []
    assert started.problem == ("job 20261129-000000-abcd: slurm job 7 has already ended FAILED; see `fab status`")
    assert backends.SLURM.start(slurm_session(tmp_path, monkeypatch), ("trainer",), no_wait=True).problem is None
