"""Node ops' replies are typed (fabtrain/contract/opreplies.py): the node builds each through its type, the
controller reads it back through the same type, and a malformed one is that node's failure, said in one line
that names the node, the op and the field, never a traceback."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.contract.opreplies import (REPLIES, Bandwidth, Claim, Kill, Killed, Listened, Logs, MalformedReply,
                                         Marked, MarkKilled, Netcheck, NotStarted, Owner, Probe, Provision, Reached,
                                         Route, Start, Started, Status, Tools, Verify)
from fabtrain.contract.replies import SENTINEL
from fabtrain.controller import lifecycle, preflight, report
from fabtrain.controller.jobstate import observe_status
from fabtrain.node import allocation, gpuinv, netcheck, ops, probe
from fabtrain.plan.ports import configured_ports, port_uses
from fabtrain.remote.session import Session
from fabtrain.remote.transport import FAILED, Reply
from tests.support import REPO

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
    "netcheck": Netcheck(
        workspace="/w/node2", address_ip="10.0.0.2", address_local=True, iface="eth0", speed=10000,
        routes={"10.0.0.1": Route(local="10.0.0.2", iface="eth0"), "10.0.0.9": Route()}, ephemeral=[32768, 60999],
        listen=[Listened(port=29500, what="master (rank 0)", setting="master_port", expect=1, state="ok", accepted=1),
                Listened(port=7180, what="watchdog coordinator", setting="watchdog_port", expect=1, state="taken",
                         owner=Owner(pid=4242, command="python serve.py", workspace="/w/other", job_id=JOB))],
        reach=[Reached(node="node1", address="10.0.0.1", port=23017, what="pserver 0", state="ok", attempts=1,
                       local="10.0.0.2", iface="eth0", ms=0.4),
               Reached(node="node1", address="10.0.0.1", port=23018, what="pserver 0", state="timeout", attempts=1,
                       error="no answer within 2 s")],
        busy=[23017, 29500],
        claimed=[Claim(port=23017, count=2, what="pserver 0", address=None, workspace="/w/other", job_id=JOB)]),
    "bandwidth": Bandwidth(rank=0, world_size=2, backend="gloo", bytes=16 << 20, iterations=5,
                           allreduce_s=[0.02, 0.021], link_s=[0.01, 0.012], iface="eth0"),
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
    net = Netcheck.from_wire("node2", sent(SAMPLES["netcheck"]))
    assert (net.listen[1].owner.pid, net.listen[0].owner, net.reach[1].local) == (4242, None, None)
    assert net.routes == {"10.0.0.1": Route(local="10.0.0.2", iface="eth0"), "10.0.0.9": Route()}
    assert (net.claimed[0].port, net.claimed[0].count, net.busy) == (23017, 2, [23017, 29500])


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


def test_a_network_reply_is_checked_down_to_each_port():
    def said(shape, **changes):
        with pytest.raises(MalformedReply) as e:
            type(shape).from_wire("n1", {**sent(shape), **changes})
        return str(e.value)

    net = SAMPLES["netcheck"]
    listen, reach, claimed = sent(net)["listen"], sent(net)["reach"], sent(net)["claimed"]
    owner = {k: v for k, v in listen[1]["owner"].items() if k != "pid"}
    assert said(net, listen=[dict(listen[0], port="29500")]) == \
        'n1: malformed netcheck reply: "listen[0].port" is text, not an integer'
    assert said(net, listen=[listen[0], dict(listen[1], owner=owner)]) == \
        'n1: malformed netcheck reply: "listen[1].owner.pid" is missing'
    assert said(net, listen=[{k: v for k, v in listen[0].items() if k != "state"}]) == \
        'n1: malformed netcheck reply: "listen[0].state" is missing'
    assert said(net, reach=[dict(reach[0], port=70000)]) == \
        'n1: malformed netcheck reply: "reach[0].port" is 70000, not 0 to 65535'
    assert said(net, reach=[reach[0], dict(reach[1], ms="fast")]) == \
        'n1: malformed netcheck reply: "reach[1].ms" is text, not a number'
    assert said(net, routes={"10.0.0.1": {"local": 5, "iface": None}}) == \
        'n1: malformed netcheck reply: "routes.10.0.0.1.local" is a number, not text'
    assert said(net, routes=[]) == 'n1: malformed netcheck reply: "routes" is a list, not an object'
    assert said(net, claimed=[dict(claimed[0], count=0)]) == \
        'n1: malformed netcheck reply: "claimed[0].count" is 0, not 1 to 65536'
    assert said(net, busy=["29500"]) == 'n1: malformed netcheck reply: "busy[0]" is text, not an integer'
    assert said(net, address_local=None) == 'n1: malformed netcheck reply: "address_local" is null, not true/false'
    bw = SAMPLES["bandwidth"]
    assert said(bw, allreduce_s=[0.02]) == \
        'n1: malformed bandwidth reply: "allreduce_s" is 1 long, not world_size (2): one time a rank'
    assert said(bw, link_s=[0.0, 0.01]) == 'n1: malformed bandwidth reply: "link_s[0]" is not above zero'
    assert said(bw, world_size=0) == 'n1: malformed bandwidth reply: "world_size" is 0, not 1 to 1048576'
    assert Bandwidth.from_wire("n1", dict(sent(bw), world_size=1, allreduce_s=[0.02], link_s=None)).link_s is None


def test_a_reply_is_changed_by_copying_it():
    net = Netcheck.from_wire("node2", sent(SAMPLES["netcheck"]))
    bare = net.replaced(listen=[])
    assert bare.listen == [] and len(net.listen) == 2  # the reply read stays as it came
    assert {n: getattr(bare, n) for n in Netcheck.FIELDS if n != "listen"} == \
        {n: getattr(net, n) for n in Netcheck.FIELDS if n != "listen"}
    with pytest.raises(TypeError, match="not fields of Netcheck: listens"):
        net.replaced(listens=[])


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


def test_the_network_check_builds_its_reply_through_its_type(tmp_path):
    """On this machine's loopback: a port this process holds and one nobody does, bound and let go at once."""
    with socket.socket() as held, socket.socket() as spare:
        held.bind(("127.0.0.1", 0))
        held.listen()
        spare.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], spare.getsockname()[1]
        spare.close()  # free again: the check's own listener takes it and lets it go
        answer = netcheck.run({"node": "n0", "workspace": str(tmp_path), "address": "127.0.0.1",
                               "peers": ["127.0.0.2"], "window": [taken, taken], "job_id": None,
                               "listen": [{"port": taken, "what": "master (rank 0)", "setting": "master_port"},
                                          {"port": free, "what": "watchdog coordinator", "setting": "watchdog_port"}],
                               "reach": [{"node": "n1", "address": "127.0.0.2", "port": free, "what": "x"}]})
    read = Netcheck.from_wire("n0", json.loads(json.dumps(answer)))
    assert (read.workspace, read.address_ip, read.address_local, read.iface) == (str(tmp_path), "127.0.0.1", True, "lo")
    assert read.routes["127.0.0.2"].iface == "lo" and read.busy == [taken] and read.reach == []  # nothing served
    assert [(e.port, e.setting, e.state) for e in read.listen] == [(taken, "master_port", "taken"),
                                                                    (free, "watchdog_port", "ok")]
    assert read.listen[0].owner.pid == os.getpid() and read.listen[1].owner is None


def test_a_bandwidth_rank_builds_its_reply_through_its_type():
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import json, sys; from fabtrain.node import bandwidth; print(json.dumps(bandwidth.run(json.loads("
            "sys.argv[1]))))")
    payload = {"rank": 0, "world_size": 1, "master": "127.0.0.1", "port": port, "backend": "gloo",
               "env": {"GLOO_SOCKET_IFNAME": "lo"}, "size_mb": 0.01, "iterations": 1, "timeout": 30}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(payload)], capture_output=True, text=True, timeout=50,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    read = Bandwidth.from_wire("n0", json.loads(out.stdout.splitlines()[-1]))
    assert (read.rank, read.world_size, read.backend, read.link_s, read.iface) == (0, 1, "gloo", None, "lo")
    assert len(read.allreduce_s) == 1 and read.bytes > 0


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


def answering(tmp_path, name: str, replies: dict) -> None:
    """What stand-in node `name` answers from its next process on (op -> result)."""
    (tmp_path / f"{name}.json").write_text(json.dumps(replies))


def network_reply(cluster, name: str, uses, served: bool) -> Netcheck:
    """A whole netcheck reply of node `name` on loopback, every port it was asked about free and reached."""
    others = len(cluster.nodes) - 1
    return Netcheck(
        workspace=f"/w/{name}", address_ip="127.0.0.1", address_local=True, iface="lo", speed=None,
        routes={n.address: Route(local="127.0.0.1", iface="lo") for n in cluster.nodes if n.name != name},
        ephemeral=[32768, 60999], busy=[], claimed=[],
        listen=[Listened(port=p, what=u.what, setting=u.setting, expect=others, state="ok",
                         accepted=others if served else None) for u in uses if u.node == name for p in u.ports],
        reach=[Reached(node=u.node, address=u.address, port=p, what=u.what, state="ok", attempts=1, local="127.0.0.1",
                       iface="lo", ms=0.1) for u in uses if u.node != name for p in u.ports] if served else [])


def test_fab_check_names_the_node_whose_netcheck_is_malformed_and_checks_the_others(tmp_path):
    from fabtrain.backends.nodes import NodesBackend
    good = Probe(**{**sent(PROBE), "time": time.time(), "boot_id": None, "tools": Tools(rsync=True, stdbuf=True)})
    session = session_of(tmp_path, {}, {})
    uses = port_uses(session.cluster, preflight.choose_ports(session.cluster, {}).ports)
    assert {u.node for u in uses} == {"n0"}  # n0 listens, n1 reaches its ports
    bad = network_reply(session.cluster, "n1", uses, served=True).wire()
    del bad["reach"][0]["state"]  # read as a dict, a KeyError out of fab check
    answering(tmp_path, "n0", {"probe": good.wire(),
                               "netcheck": network_reply(session.cluster, "n0", uses, served=True).wire()})
    answering(tmp_path, "n1", {"probe": good.wire(), "netcheck": bad})
    try:
        checked = NodesBackend().check(session)  # a record: fab check's task says it (report.checked_text)
    finally:
        session.close()
    out = report.checked_text(checked, session.cluster)
    assert not checked.ok and checked.problem == "check: some nodes cannot run the job" and "Traceback" not in out, out
    assert re.search(r"^n0\s+127\.0\.0\.1\s+lo\s+29500 ok, 7180 ok\s+-\s+ok$", out, re.M), out
    assert re.search(r"^n1\s+127\.0\.0\.1\s+ERROR$", out, re.M), out
    said = 'n1: malformed netcheck reply: "reach[0].state" is missing (its network is not checked)'
    assert said in out.splitlines(), out


def test_a_netcheck_reply_about_ports_it_was_not_asked_about_is_that_nodes_failure(tmp_path):
    """A reply of the right types that names another node or port: plan says so, a start's preflight goes on
    without that node's interface, as for a node that did not answer."""
    session = session_of(tmp_path, {}, {})
    uses = port_uses(session.cluster, configured_ports(session.cluster))
    stray = Reached(node="n9", address="10.9.9.9", port=29500, what="master (rank 0)", state="ok")
    answering(tmp_path, "n0", {"netcheck": network_reply(session.cluster, "n0", uses, served=False).wire()})
    answering(tmp_path, "n1", {"netcheck": network_reply(session.cluster, "n1", uses, served=False).replaced(
        reach=[stray]).wire()})
    try:
        network, notes = preflight.plan_network(session)
        started = preflight.prepare_start(session, JOB, ("trainer",))
    finally:
        session.close()
    assert notes == ["n1: malformed netcheck reply: its ports are not the ones it was asked about"]
    assert network.ifaces == started.ifaces == {"n0": "lo"}


def test_a_start_judges_only_the_ports_its_own_nodes_hold(tmp_path):
    """Another node's reply is judged with its ports left out: a copy of it, the rest as it came."""
    session = session_of(tmp_path, {}, {})
    session.close()
    cluster = session.cluster
    uses = port_uses(cluster, configured_ports(cluster))
    n0 = network_reply(cluster, "n0", uses, served=False)
    init = Owner(pid=1, command="/sbin/init", workspace=None, job_id=None)
    n0 = n0.replaced(listen=[e.replaced(state="taken", owner=init) for e in n0.listen])
    replies = {"n0": Reply("n0", True, n0), "n1": Reply("n1", True, network_reply(cluster, "n1", uses, served=False))}
    network = preflight.choose_ports(cluster, replies)
    assert preflight.assess(cluster, network, replies, starting=True).problems == [
        "n0: port 29500 (master (rank 0)) is in use by pid 1 (/sbin/init): stop it, or set job.master_port: auto "
        "(or another port)",
        "n0: port 7180 (watchdog coordinator) is in use by pid 1 (/sbin/init): stop it, or set job.watchdog.port: "
        "auto (or another port)"]
    found = preflight.assess(cluster, network, replies, starting=True, hosts={"n1"})
    assert found.problems == [] and found.replies["n0"].value == n0.replaced(listen=[]) and len(n0.listen) == 2
    assert found.replies["n1"] is replies["n1"]


def test_the_bandwidth_test_reads_each_ranks_reply_through_its_type(tmp_path):
    session = session_of(tmp_path, {}, {})
    cluster = session.cluster
    uses = port_uses(cluster, configured_ports(cluster))
    replies = {n: Reply(n, True, network_reply(cluster, n, uses, served=True).replaced(speed=speed))
               for n, speed in (("n0", 10000), ("n1", 1000))}
    check = preflight.NetworkCheck(preflight.choose_ports(cluster, replies), uses, replies)
    ranks = [SAMPLES["bandwidth"], SAMPLES["bandwidth"].replaced(rank=1)]
    answering(tmp_path, "n0", {"bandwidth": ranks[0].wire()})
    answering(tmp_path, "n1", {"bandwidth": ranks[1].wire()})
    try:
        measured = preflight.bandwidth(session, check, {"n0": PROBE, "n1": PROBE}, timeout=10)
        answering(tmp_path, "n1", {"bandwidth": {**ranks[1].wire(), "allreduce_s": [0.02]}})
        malformed = preflight.bandwidth(session, check, {"n0": PROBE, "n1": PROBE}, timeout=10)
    finally:
        session.close()
    mb = 16 << 20
    assert (measured.problems, measured.backend, measured.bytes, measured.seconds) == ([], "gloo", mb, 0.021)
    assert measured.bus_gbps == pytest.approx(mb / 0.021 * 8 / 1e9)
    assert measured.slowest == ("n0", pytest.approx(mb * 8 / 0.012 / 1e9)) and measured.promised_mbps == 1000
    assert malformed.problems == [
        'bandwidth: n1: malformed bandwidth reply: "allreduce_s" is 1 long, not world_size (2): one time a rank']
