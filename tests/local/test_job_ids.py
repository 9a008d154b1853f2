"""A job id is a name, everywhere: every command that takes one, the library under them, and the
node operations themselves (as the rpc protocol sends them) refuse anything but the one job-id
form in one line, before any node is asked, and never read outside <workspace>/jobs/."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from fabtrain.config.cluster import load_cluster
from fabtrain.controller import export, history, lifecycle
from fabtrain.controller.collector import Collector
from fabtrain.errors import UserError
from fabtrain.contract import jobid
from fabtrain.plan.plan import new_job_id
from fabtrain.remote import rpc
from fabtrain.remote.session import Session

BAD = ["..", "../x", "/etc", "x" * 5000]  # a NUL byte cannot be typed (argv): it is tried on the library below
NOBODYS = "20000101-000000-beef"  # the form, but no node has it
SECRET = "outside-jobs-secret"
ONE_LINE = re.compile(r"^fab [a-z-]+: (--[a-z-]+: )?bad job id '[^\n]*: a job id looks like 20261124-045501-5d89\n$")

COMMANDS = {  # each command that takes a job id, with the id last
    "status": ["status", "--job"],
    "logs": ["logs", "--job"],
    "watch": ["watch", "--timeout", "30", "--job"],
    "export": ["export", "--tensorboard", "{tmp}/tb", "--job"],
    "dashboard": ["dashboard", "--port", "1", "--job"],
    "start-pserver": ["start-pserver", "--resume-from"],
}


@pytest.fixture
def world(tmp_path):
    """Two local nodes whose workspaces sit beside a logs/ folder that a traversing id would reach,
    and an unreachable third node: a command that asked the nodes anything would say so."""
    top = tmp_path / "top"
    (top / "logs").mkdir(parents=True)
    (top / "logs" / "trainer-0.log").write_text(SECRET + "\n")
    nodes = [{"name": f"n{i}", "host": "local", "roles": ["pserver", "trainer"], "workspace": str(top / f"ws{i}")}
             for i in range(2)]
    doc = {"cluster": {"name": "ids", "python": sys.executable}, "nodes": nodes,
           "job": {"mode": "pserver", "pserver": {"command": "sleep 30"}, "trainer": {"command": "sleep 30"}}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, top


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_refuses_a_bad_job_id_in_one_line_before_any_node_is_asked(fab, world, tmp_path, command):
    path, top = world
    for bad in BAD:
        argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]] + [bad]
        out = fab(*argv, cluster=path, timeout=60)
        said = out.stdout + out.stderr
        assert out.returncode == 2 and ONE_LINE.match(said), (argv[:-1], bad[:20], said[:500])
        assert SECRET not in said and "Error" not in said
        assert not any((top / f"ws{i}").exists() for i in range(2))  # no node op ran: none made its workspace


@pytest.mark.parametrize("command", ["status", "logs", "watch", "export"])
def test_a_well_formed_id_no_node_has_is_said_so(fab, world, tmp_path, command):
    path, _ = world
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]] + [NOBODYS]
    out = fab(*argv, cluster=path, timeout=60)
    said = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in said, said
    assert said == f"fab {command}: no job {NOBODYS} on any node\n", said  # the same words for every command


@pytest.mark.parametrize("bad", BAD + ["a\0b", 7])
def test_the_library_refuses_a_bad_id_before_any_node_is_asked(world, tmp_path, bad):
    path, top = world
    session = Session(load_cluster(path))
    calls = [lambda: lifecycle.status(session, job_id=bad), lambda: lifecycle.logs(session, job_id=bad),
             lambda: Collector(session, job_id=bad), lambda: history.job_detail(session, bad),
             lambda: export.export_tensorboard(session, str(tmp_path / "tb"), job_id=bad),
             lambda: lifecycle.start(session, ("pserver",), resume_from=bad)]
    for call in calls:
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value) == jobid.problem(bad) or str(e.value) == f"--resume-from: {jobid.problem(bad)}"
        assert "\n" not in str(e.value)
    assert not any((top / f"ws{i}").exists() for i in range(2))


def test_a_bad_id_in_the_controllers_state_is_refused(world, tmp_path, monkeypatch):
    path, _ = world
    monkeypatch.setenv("FABTRAIN_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ids.json").write_text(json.dumps({"job_id": "../..", "roles": ["pserver"]}))
    with pytest.raises(UserError, match=r"state of cluster ids: bad job id '\.\./\.\.'"):
        lifecycle.start(Session(load_cluster(path)), ("trainer",))


def node_op(op: str, payload: dict, cwd) -> tuple[dict, str]:
    """One request exactly as the rpc protocol sends it to a node: (the reply, everything printed)."""
    request = json.dumps({"op": op, "payload": payload}).encode() + b"\n"
    out = subprocess.run(rpc.launcher_argv(sys.executable), input=rpc.code_frame(None) + request,
                         capture_output=True, timeout=60, cwd=str(cwd))
    parser = rpc.ReplyParser()
    parser.feed(out.stdout)
    replies = [value for kind, value in parser.events if kind == "reply"]
    assert len(replies) == 1, (out.stdout, out.stderr)
    return replies[0], out.stdout.decode() + out.stderr.decode()


@pytest.mark.parametrize("bad", ["../..", "..", "/", "../../top", "a\0b", "x" * 5000])
def test_node_ops_sent_a_traversing_id_read_nothing_outside_jobs(tmp_path, bad):
    top = tmp_path / "top"
    (top / "logs").mkdir(parents=True)
    (top / "logs" / "trainer-0.log").write_text(SECRET + "\n")
    ws = top / "ws"
    (ws / "jobs").mkdir(parents=True)
    base = {"workspace": str(ws), "node": "n0"}
    job = {"job_id": bad, "cluster": "c", "node": "n0", "workspace": str(ws), "processes": [], "nodes": []}
    for op, payload in (("status", {"job_id": bad}), ("logs", {"job_id": bad, "lines": 5}),
                        ("collect", {"job_id": bad, "offsets": {"logs/trainer-0.log": 0}}), ("job", {"job_id": bad}),
                        ("start", {"job": job, "roles": ["trainer"]})):
        reply, printed = node_op(op, {**base, **payload}, tmp_path)
        assert reply == {"ok": False, "error": jobid.problem(bad)}, (op, reply)
        assert SECRET not in printed
    assert sorted(p.name for p in ws.iterdir()) == ["jobs"] and not list((ws / "jobs").iterdir())


def test_a_node_side_failure_is_said_in_words_with_the_path(tmp_path):
    ws = tmp_path / "ws"
    jd = ws / "jobs" / new_job_id()
    jd.mkdir(parents=True)  # a job folder without logs/: the FileNotFoundError a user once read
    reply, _ = node_op("logs", {"workspace": str(ws), "node": "n0", "job_id": jd.name}, tmp_path)
    assert reply == {"ok": False, "error": f"{jd / 'logs'}: no such file or directory (during logs)"}, reply


def test_the_one_form_is_what_new_job_id_makes():
    assert jobid.is_job_id(new_job_id()) and jobid.is_job_id(jobid.EXAMPLE)
    for bad in ("", "..", "20261124-045501-5d8", "20261124-045501-5d89\n", "20261124-045501-5D89", None, 1):
        assert not jobid.is_job_id(bad)
