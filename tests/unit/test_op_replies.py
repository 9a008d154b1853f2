"""Node ops' replies are typed (fabtrain/contract/opreplies.py): the node builds each through its type, the
controller reads it back through the same type, and a malformed one is that node's failure, said in one line
that names the node, the op and the field, never a traceback."""
from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.contract.opreplies import (REPLIES, Kill, Killed, Logs, MalformedReply, Marked, MarkKilled, NotStarted,
                                         Probe, Provision, Start, Started, Status, Tools, Verify)
from fabtrain.contract.replies import SENTINEL
from fabtrain.controller import lifecycle, report
from fabtrain.controller.jobstate import observe_status
from fabtrain.node import allocation, gpuinv, ops, probe
from fabtrain.remote.session import Session
from fabtrain.remote.transport import FAILED, Reply

pytestmark = pytest.mark.timeout(60)
JOB = "20261124-045501-5d89"

PROBE = Probe(hostname="node2", python="3.11.2", python_path="/usr/bin/python3", workspace="/w/node2",
              workspace_conflict=None, time=1764000000.5, boot_id="b0", cpus=8, tools=Tools(rsync=True, stdbuf=True),
              disk_free=50 << 30, disk_total=100 << 30, mem_total=16 << 30, psutil="7.0", paddle=None, torch="2.5.1",
              cuda=None, gpus=0, torch_error=None,
              gpu_inventory={"source": "none", "gpus": [], "error": "no NVIDIA driver"})
SAMPLES = {
    "probe": PROBE,
    "provision": Provision(workspace="/w/node2", venv="/w/node2/venv/bin/python"),
    "start": Start(job_dir=f"/w/jobs/{JOB}",
                   started=[Started(name="trainer-0", role="trainer", rank=0, pid=4321, launcher_pid=4320)],
                   failed=[NotStarted(name="trainer-1", exit_code=127, log=["cannot start nope: No such file"])],
                   warnings=["the agent has not started its coordinator within 15 s (see `fab status`)"]),
    "status": Status(job_id=JOB, code={"commit": "abc123", "dirty": False}, slurm=None,
                     processes=[{"name": "trainer-0", "state": "running", "pid": 4321}], killed=False,
                     killed_by=None, stop_reason=None, health_ts=1764000000.0, health={"ts": 1764000000.0},
                     last_event={"kind": "agent_started", "ts": 1764000000.0}, time=1764000001.0),
    "logs": Logs(job_id=JOB),
    "kill": Kill(killed=[Killed(job_id=JOB, name="trainer-0", pid=4321, child=False, signal="SIGTERM"),
                         Killed(job_id=JOB, name="trainer-0", pid=4400, orphan=True, signal="SIGKILL")],
                 left=[], untrusted=["jobs/x/run/trainer-0.json (pid 7)"]),
    "mark_killed": MarkKilled(nodes=[Marked(marked=JOB, slurm_job="1234"), Marked()]),
    "verify": Verify(files={"shard-00000": "ok", "MANIFEST.json": "mismatch"}, disk_free=1 << 30),
}


def sent(shape) -> dict:
    """What the controller receives of a reply the node built: its wire, through JSON."""
    return json.loads(json.dumps(shape.wire()))


def test_every_typed_op_has_a_sample_here():
    assert set(SAMPLES) == set(REPLIES) and all(type(SAMPLES[op]) is REPLIES[op] for op in SAMPLES)


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_a_reply_goes_from_the_node_to_the_controller_whole(op):
    built = SAMPLES[op]
    read = REPLIES[op].from_wire("node2", sent(built))
    assert read == built and read is not built
    assert set(sent(built)) == set(REPLIES[op].FIELDS)  # every field on the wire, None where not given


def test_nested_types_are_read_as_types():
    start = Start.from_wire("node2", sent(SAMPLES["start"]))
    assert (start.started[0].name, start.started[0].pid, start.failed[0].exit_code) == ("trainer-0", 4321, 127)
    kill = Kill.from_wire("node2", sent(SAMPLES["kill"]))
    assert [(k.pid, k.child, k.orphan, k.starter) for k in kill.killed] == [(4321, False, None, None),
                                                                            (4400, None, True, None)]
    assert Probe.from_wire("node2", sent(PROBE)).tools.missing() == []
    assert Tools(rsync=False, stdbuf=True).missing() == ["rsync"]


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_a_missing_field_is_one_line_naming_the_node_the_op_and_the_field(op):
    for field in REPLIES[op].FIELDS:
        wire = sent(SAMPLES[op])
        del wire[field]
        with pytest.raises(MalformedReply) as e:
            REPLIES[op].from_wire("node2", wire)
        assert str(e.value) == f'node2: malformed {op} reply: "{field}" is missing'


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_a_field_of_the_wrong_type_is_one_line_naming_it(op):
    for field in REPLIES[op].FIELDS:
        wire = dict(sent(SAMPLES[op]), **{field: [True]})  # of no field's type: not a list of true/false
        with pytest.raises(MalformedReply) as e:
            REPLIES[op].from_wire("node2", wire)
        said = str(e.value)
        assert re.fullmatch(rf'node2: malformed {op} reply: "{field}(\[0\])?" is [a-z/ ]+, not [a-z/ ]+', said), said


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_a_reply_that_is_not_an_object_is_one_line(op):
    for value, what in ((None, "null"), ([], "a list"), ("ok", "text"), (3, "a number")):
        with pytest.raises(MalformedReply) as e:
            REPLIES[op].from_wire("node2", value)
        assert str(e.value) == f"node2: malformed {op} reply: it is {what}, not an object"


def test_what_each_check_says_and_where_below_the_field():
    def said(shape, **changes):
        with pytest.raises(MalformedReply) as e:
            type(shape).from_wire("node2", {**sent(shape), **changes})
        return str(e.value)

    start = sent(SAMPLES["start"])
    assert said(PROBE, disk_free="lots") == 'node2: malformed probe reply: "disk_free" is text, not an integer'
    assert said(PROBE, time=float("nan")) == 'node2: malformed probe reply: "time" is not a finite number'
    assert said(PROBE, time=True) == 'node2: malformed probe reply: "time" is true/false, not a number'
    assert said(PROBE, cpus=2.5) == 'node2: malformed probe reply: "cpus" is a fraction, not an integer'
    assert said(PROBE, tools={"rsync": True}) == 'node2: malformed probe reply: "tools.stdbuf" is missing'
    assert said(PROBE, tools={"rsync": "yes", "stdbuf": True}) == \
        'node2: malformed probe reply: "tools.rsync" is text, not true/false'
    assert said(SAMPLES["start"], started=[dict(start["started"][0], pid="4321")]) == \
        'node2: malformed start reply: "started[0].pid" is text, not an integer'
    assert said(SAMPLES["start"], failed=[dict(start["failed"][0], log=["a", 2])]) == \
        'node2: malformed start reply: "failed[0].log[1]" is a number, not text'
    assert said(SAMPLES["status"], job_id="../x") == "node2: malformed status reply: \"job_id\" is '../x', not a job id"
    assert said(SAMPLES["kill"], left=["4242"]) == 'node2: malformed kill reply: "left[0]" is text, not an integer'
    assert said(SAMPLES["verify"], files={"a": None}) == 'node2: malformed verify reply: "files.a" is null, not text'


def test_a_gpu_inventory_is_checked_as_contract_gpus_reads_it(tmp_path):
    standin = tmp_path / "gpus.json"  # STAND-IN: no GPU on this machine
    standin.write_text(json.dumps({"gpus": [{"index": 0, "mem_total": 1000, "mem_used": 0},
                                            {"index": 1, "processes": [{"pid": os.getpid(), "mem": 500}]}]}))
    inventory = gpuinv.inventory(environ={gpuinv.STANDIN_ENV: str(standin)})
    wire = dict(sent(PROBE), gpu_inventory=inventory)
    assert Probe.from_wire("node2", json.loads(json.dumps(wire))).gpu_inventory == inventory
    inventory["gpus"][1]["processes"][0]["pid"] = str(os.getpid())
    with pytest.raises(MalformedReply, match=r'^node2: malformed probe reply: "gpu_inventory\.gpus\[1\]\.processes\[0\]'
                                             r'\.pid" is text, not an integer$'):
        Probe.from_wire("node2", wire)


def test_the_writer_names_only_the_types_fields_and_a_read_reply_stays_as_it_came():
    with pytest.raises(TypeError, match="not fields of Verify: disk_fre"):
        Verify(files={}, disk_fre=1)
    read = Verify.from_wire("node2", {**sent(SAMPLES["verify"]), "later": "a field this controller does not know"})
    assert read == SAMPLES["verify"]
    with pytest.raises(AttributeError):
        read.disk_free = 0


def test_a_status_holds_records_which_the_controllers_checks_clean_one_by_one():
    """The status type holds its processes as objects; a bad record is dropped by records.py, not the node."""
    wire = dict(sent(SAMPLES["status"]), processes=[{"name": "trainer-0", "state": "running"},
                                                     {"name": "trainer-1", "state": "bogus"}])
    obs = observe_status(Reply("node2", True, Status.from_wire("node2", wire)))
    assert [p["name"] for p in obs.processes] == ["trainer-0"] and obs.job_id == JOB


def test_node_ops_build_their_replies_through_the_types(tmp_path):
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "a").write_text("a\n")
    base = {"workspace": str(ws), "node": "n0"}
    answers = {
        "probe": probe.op_probe({**base, "cluster": "c", "torch_cuda": False}),
        "provision": probe.op_provision(base),
        "status": ops.op_status(base),
        "logs": ops.op_logs({**base, "lines": 5}),
        "kill": ops.op_kill({**base, "grace": 1}),
        "verify": ops.op_verify({**base, "dir": "$WS/data", "files": {"a": "0" * 64, "b": "0" * 64}}),
        "mark_killed": allocation.op_mark_killed(base),
    }
    read = {op: REPLIES[op].from_wire("n0", json.loads(json.dumps(answer))) for op, answer in answers.items()}
    assert read["probe"].workspace == str(ws) and read["probe"].tools.rsync in (True, False)
    assert read["status"] == Status(processes=[]) and read["logs"] == Logs(job_id=None)
    assert read["kill"] == Kill(killed=[], left=[], untrusted=[])
    assert read["verify"].files == {"a": "mismatch", "b": "missing"} and read["verify"].disk_free > 0
    assert read["mark_killed"] == MarkKilled(nodes=[Marked()])


def test_a_status_carries_what_the_jobs_files_say_only_where_it_fits_its_field(tmp_path):
    """job.json, health.json and events.jsonl hold whatever was written there: a field they do not fit is
    None in the reply, and the reply is still a whole one (the node is not an error for a bad file)."""
    ws = tmp_path / "ws"
    jd = ws / "jobs" / JOB
    jd.mkdir(parents=True)
    (jd / "job.json").write_text(json.dumps({"job_id": JOB, "processes": [], "code": "abc", "slurm": 42}))
    (jd / "health.json").write_text(json.dumps({"ts": "now"}))
    (jd / "events.jsonl").write_text("[1, 2]\n")
    payload = {"workspace": str(ws), "job_id": JOB, "health": True}
    status = Status.from_wire("n0", json.loads(json.dumps(ops.op_status(payload))))
    assert (status.job_id, status.code, status.slurm, status.health_ts, status.last_event) == (JOB, None, None, None,
                                                                                             None)
    assert status.health == {"ts": "now"}  # a record: records.health cleans it, and drops this one
    (jd / "health.json").write_text("[]")
    assert Status.from_wire("n0", ops.op_status(payload)).health is None


# -- the controller: a malformed reply is that node's failure line ------------------------------------------

FAKE_NODE = """#!{python}
# A node-side process that runs none of the code it is sent: it answers each request with the reply given
# for its op in {replies}, in the reply frame.
import json, sys
replies = json.load(open({replies!r}))
stdin = sys.stdin.buffer
stdin.read(int(stdin.readline()))
for line in stdin:
    op = json.loads(line)["op"]
    said = {{"ok": True, "result": replies[op]}} if op in replies else {{"ok": False, "error": "no " + op}}
    sys.stdout.write("\\n{sentinel}\\n" + json.dumps(said) + "\\n")
    sys.stdout.flush()
"""


def fake_node(tmp_path, name: str, replies: dict) -> dict:
    """A `host: local` node whose python is a stand-in answering `replies` (op -> result)."""
    (tmp_path / f"{name}.json").write_text(json.dumps(replies))
    python = tmp_path / f"{name}-python"
    python.write_text(FAKE_NODE.format(python=sys.executable, replies=str(tmp_path / f"{name}.json"),
                                       sentinel=SENTINEL))
    python.chmod(0o755)
    return {"name": name, "host": "local", "roles": ["trainer"], "python": str(python),
            "workspace": str(tmp_path / f"ws-{name}")}


def session_of(tmp_path, good: dict, bad: dict) -> Session:
    """A cluster of two stand-in nodes: n0 answers `good` replies, n1 `bad` ones."""
    return Session(parse_cluster({"cluster": {"name": "typed"},
                                  "nodes": [fake_node(tmp_path, "n0", good), fake_node(tmp_path, "n1", bad)],
                                  "job": {"mode": "collective", "trainer": {"command": "true"}}},
                                 str(tmp_path / "cluster.yaml")))


def test_fab_check_names_the_node_whose_probe_is_malformed_and_checks_the_others(tmp_path):
    good = Probe(**{**sent(PROBE), "time": time.time(), "boot_id": None, "tools": Tools(rsync=True, stdbuf=True)})
    session = session_of(tmp_path, {"probe": good.wire()}, {"probe": {**good.wire(), "disk_free": "lots"}})
    try:
        n0, n1 = lifecycle.check(session, timeout=30)
    finally:
        session.close()
    assert (n0.ok, n0.probe.hostname, n0.problems) == (True, "node2", [])
    assert (n1.ok, n1.probe, n1.down) == (False, None, FAILED)
    assert n1.problems == ['n1: malformed probe reply: "disk_free" is text, not an integer']
    text = report.check_text([n0, n1])
    assert re.search(r"^n0\s+ok\s+3\.11\.2\s", text, re.M) and re.search(r"^n1\s+ERROR$", text, re.M), text
    assert 'n1: malformed probe reply: "disk_free" is text, not an integer' in text.splitlines(), text


def test_status_and_kill_all_say_a_malformed_reply_as_the_nodes_failure(tmp_path):
    good = {"status": Status(processes=[]).wire(), "kill": Kill(killed=[], left=[], untrusted=[]).wire()}
    bad = {"status": {**Status(processes=[]).wire(), "time": "noon"},
           "kill": {**Kill(killed=[], left=[], untrusted=[]).wire(), "left": ["4242"]}}
    session = session_of(tmp_path, good, bad)
    try:
        text, failed = report.status_text(lifecycle.status(session, timeout=30))
        killed, clean = report.kill_text(lifecycle.kill_all(session, grace=1))
    finally:
        session.close()
    assert failed and re.search(r"^n0\s+-\s+no job$", text, re.M) and re.search(r"^n1\s+-\s+ERROR$", text, re.M), text
    assert 'n1: malformed status reply: "time" is text, not a number' in text.splitlines(), text
    assert not clean and killed.splitlines() == [
        "n0: nothing running", 'n1: FAILED: malformed kill reply: "left[0]" is text, not an integer']
