"""Every record a node writes comes back whole through the controller's reading of it (issue #60).

Each table of fabtrain/contract/records.py is filled, every field of it (every record within it, every
list with an item), written as JSON and read back through the controller's checks
(fabtrain/controller/records.py): a field the reader drops, or reads otherwise, fails. The writers that
build health.json, its coordinator part and the `collect` reply are run for real and read back the same
way, so a field a writer puts in by hand, past its table, fails too. The `killed` marker: one format,
written by node ops' kill and a Slurm kill-all alike, read back as written; an older empty one still reads.
"""
import json
import os
import types

import pytest

from fabtrain.contract import records as fields
from fabtrain.contract.jobfolder import JobFolder
from fabtrain.contract.opreplies import Collect
from fabtrain.contract.states import KILLERS, START_FAILED, killed_marker, read_marker
from fabtrain.controller import records

SAMPLE = {fields.NUMBER: 1.5, fields.INTEGER: 7, fields.FLAG: True, fields.NAME: "n1", fields.RANK: 3,
          fields.STATE: "running", fields.SIGNAL: "SIGTERM", fields.REASON: "a reason", fields.TEXT: "a line"}


def whole(kind):
    """A value of a contract type with everything in it: every field of a table, an item in every list, and
    one field a table does not name where it keeps OTHERS."""
    if isinstance(kind, dict):
        value = {name: whole(k) for name, k in kind.items() if name != fields.OTHERS}
        if fields.OTHERS in kind:
            value["not_named"] = whole(kind[fields.OTHERS])
        return value
    if isinstance(kind, tuple):
        return [whole(kind[1])]
    return SAMPLE[kind]


def unnamed(value, kind, where=""):
    """The fields of a written record, at any depth, that its table does not name (and does not keep as OTHERS):
    the controller leaves each of them out, null or not."""
    if isinstance(kind, dict) and isinstance(value, dict):
        out = [where + "." + k for k in value if k not in kind and fields.OTHERS not in kind]
        for k, v in value.items():
            out += unnamed(v, kind.get(k, kind.get(fields.OTHERS)), where + "." + k)
        return out
    if isinstance(kind, tuple) and isinstance(value, list):
        return [w for i, v in enumerate(value) for w in unnamed(v, kind[1], "%s[%d]" % (where, i))]
    return []


def through_json(value):
    return json.loads(json.dumps(value, allow_nan=False))


def pruned(value):
    """A record without its None fields: the controller leaves out a part that is null, as it was never there."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


READERS = {  # each record the controller reads: its tables, and its reader
    "HEALTH": ((fields.HEALTH,), records.health),
    "STATUS_PROCESS": ((fields.STATUS_PROCESS,), records.process),
    "EVENT": ((fields.EVENT, fields.EVENT_LISTS), records.event_record),
    "METRIC": ((fields.METRIC,), lambda rec: records.metric(json.dumps(rec))),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_every_field_of_every_record_comes_back_whole(name):
    tables, read = READERS[name]
    written = through_json({k: v for table in tables for k, v in whole(table).items()})
    assert read(written) == written


def test_every_table_is_read_somewhere():
    """A table of the contract no record reaches (and so no round trip here checks) is a table nobody reads."""
    reached = set()

    def walk(kind):
        if isinstance(kind, dict):
            reached.add(id(kind))
            for k in kind.values():
                walk(k)
        elif isinstance(kind, tuple):
            walk(kind[1])
    for tables, _ in READERS.values():
        for table in tables:
            walk(table)
    tables = {n for n, v in vars(fields).items() if isinstance(v, dict) and n.isupper()}
    assert {n for n in tables if id(getattr(fields, n)) not in reached} == set()


def test_the_controller_keeps_the_coordinator_lease_fencing_and_pulses():
    part = {"host": "n0", "port": 29400, "lease": 1700000000.5, "fenced": "left the job (min_nodes)", "pulses": 12}
    assert records.health({"ts": 1.0, "coordinator": part})["coordinator"] == part


# -- the writers, run for real ----------------------------------------------------------------------------


class _Sampler:
    def __init__(self, value, error=None):
        self.value, self.error = value, error

    def sample(self):
        return self.value


def link_of(tmp_path):
    from fabtrain.node.agent.link import Link

    job = {"job_id": "20260101-000000-abcd", "node": "n1", "watchdog": {"coordinator": {"host": "n0", "port": 29400}}}
    link = Link(job, ["n0", "n1"], None, None, str(tmp_path), on_event=None, wake=None)
    link.client = types.SimpleNamespace(connected=True, last_contact_epoch=1700000000.25, lease_epoch=1700000000.5,
                                        pulser=types.SimpleNamespace(answered=4), error="a blip")
    link.fenced = {"reason": "left the job (min_nodes)"}
    link.view = {"peers": {"n0": 1700000000.0}, "lost": ["n2"], "done": ["n3"], "restarts_left": 2,
                 "out": ["n2"], "world_size": 3}
    return link


def test_the_agents_coordinator_part_is_the_tables_and_comes_back_whole(tmp_path):
    written = through_json(link_of(tmp_path).health())
    assert set(written) == set(fields.HEALTH_COORDINATOR) and unnamed(written, fields.HEALTH_COORDINATOR) == []
    assert pruned(records.health({"ts": 1.0, "coordinator": written})["coordinator"]) == pruned(written)


def test_health_json_as_the_agent_writes_it_comes_back_whole(tmp_path):
    from fabtrain.node.agent import policy
    from fabtrain.node.agent.snapshot import Health

    cfg = types.SimpleNamespace(node="n1", job_id="20260101-000000-abcd", interval=1.0, on_failure="restart",
                                spare=True)
    events = types.SimpleNamespace(recent=[{"ts": 1.0, "node": "n1", "kind": "hang", "reason": "no progress"}])
    life = types.SimpleNamespace(keeper_pid=11, launcher=12)
    gpu = {"index": 0, "name": "H100", "util": 37, "mem_used": 1 << 30, "mem_total": 80 << 30, "temp": 60,
           "power_w": 300.5}
    health = Health(str(tmp_path / "health.json"), cfg, _Sampler({"cpu_percent": 3.5, "load": [0.5, 0.25, 0.0]}),
                    _Sampler([gpu], error="NVML: a driver mismatch"), events, life, started=1.0, restarted=True)
    ledger = policy.Ledger(orphans=(policy.Orphan(pid=99, ctime=1.0, reason="left behind", name="trainer-9",
                                                  job="20251231-000000-abcd", term_at=2.0),), pending=True)
    ctx = types.SimpleNamespace(name="trainer-0", role="trainer", rank=0, pid=21, launcher=20, state="running",
                                exit_code=None, signal=None, rss=1 << 20, tree=[], zombies=[], live=True,
                                progress=None, close_reason=None, resumed=None)
    health.write(2.0, ledger, [ctx], {}, {}, link_of(tmp_path), startup_deadline=600.0,
                 straggling=[{"node": "n1", "name": "trainer-0", "rank": 0, "cause": "data", "ratio": 2.5,
                              "seconds": 0.1, "median": 0.04, "since": 1.0}],
                 blame={"text": "rank 0 is the one the others wait for", "job": True})
    written = json.loads((tmp_path / "health.json").read_text())
    assert set(written) == set(fields.HEALTH) and unnamed(written, fields.HEALTH) == []
    assert pruned(records.health(written)) == pruned(written)


def test_the_collect_reply_is_read_through_its_type_whole(tmp_path):
    from fabtrain.node import ops

    ws, job_id = tmp_path / "ws", "20260101-000000-abcd"
    folder = JobFolder(str(ws / "jobs" / job_id))
    os.makedirs(folder.metrics)
    with open(folder.job_json, "w") as f:
        json.dump({"job_id": job_id, "node": "n1", "processes": [], "slurm": {"job_id": "42"}}, f)
    health = pruned(through_json(whole(fields.HEALTH)))
    with open(folder.health, "w") as f:
        json.dump(health, f)
    with open(folder.events, "w") as f:
        f.write(json.dumps({"ts": 1.0, "node": "n1", "kind": "hang"}) + "\n")
    with open(folder.killed, "w") as f:
        f.write(killed_marker(START_FAILED, "n2 could not start"))

    wire = through_json(ops.op_collect({"workspace": str(ws), "job_id": job_id}))
    assert set(wire) == set(Collect.FIELDS)
    reply, wrong = Collect.parts(wire)
    assert wrong == [] and reply.wire() == wire
    assert reply.job_id == job_id and reply.killed is True and reply.killed_by == START_FAILED
    assert reply.stop_reason == "n2 could not start" and records.slurm_job(reply.slurm) == "42"
    assert records.health(reply.health) == health
    assert set(reply.files) == {"events.jsonl"} and reply.files["events.jsonl"].data.endswith('"hang"}\n')


def test_a_malformed_part_of_a_collect_reply_is_said_and_the_rest_kept():
    reply, wrong = Collect.parts({"time": 1.0, "job_id": "../etc", "killed": "yes", "processes": [],
                                  "files": {"events.jsonl": {"offset": -1, "size": 0, "data": ""},
                                            "metrics/t.jsonl": {"offset": 3, "size": 3, "data": "{}\n"}}})
    assert reply.job_id is None and reply.killed is None and reply.processes == [] and reply.time == 1.0
    assert list(reply.files) == ["metrics/t.jsonl"]
    assert [f for f, _ in wrong] == ["job_id", "killed", "files"], wrong


# -- the `killed` marker ---------------------------------------------------------------------------------


@pytest.mark.parametrize("who", KILLERS)
def test_the_killed_marker_reads_back_as_written(tmp_path, who):
    marker = tmp_path / "killed"
    marker.write_text(killed_marker(who, "why it stopped"))
    assert read_marker(str(marker)) == (who, "why it stopped" if who == START_FAILED else None)


def test_an_older_empty_killed_marker_reads_as_kill_all(tmp_path):
    marker = tmp_path / "killed"
    marker.write_text("")
    assert read_marker(str(marker)) == (KILLERS[0], None)
    assert read_marker(str(tmp_path / "none")) == (None, None)


def test_a_slurm_kill_all_writes_the_one_format_and_keeps_an_earlier_stop(tmp_path, monkeypatch):
    from fabtrain.node import allocation

    ws, job_id = tmp_path / "ws", "20260101-000000-abcd"
    folder = JobFolder(str(ws / "jobs" / job_id))
    os.makedirs(folder.path)
    os.symlink(os.path.join("jobs", job_id), ws / "current")
    monkeypatch.setattr(allocation.ops, "live_job_processes", lambda jd: ["trainer-0"])
    assert allocation.mark_killed(str(ws)).marked == job_id
    assert open(folder.killed).read() == killed_marker(KILLERS[0])
    with open(folder.killed, "w") as f:
        f.write(killed_marker(START_FAILED, "n2 could not start"))
    allocation.mark_killed(str(ws))
    assert read_marker(folder.killed) == (START_FAILED, "n2 could not start")


# -- who a record speaks of: typed once ------------------------------------------------------------------


def test_a_process_and_a_trainer_are_typed_values_read_once():
    from fabtrain.contract.identity import Process, Trainer
    from fabtrain.contract.progress import row

    assert (Process("trainer-3").role, Process("trainer-3").index) == ("trainer", 3)
    assert (Process("agent").role, Process("agent").index) == ("agent", None)
    rank = row("trainer-0", {"source": "auto", "child": True, "local_rank": 1, "rank": 3})
    assert isinstance(rank, Trainer) and rank == "trainer-0.rank3" and (rank.process, rank.rank) == ("trainer-0", 3)
    assert rank.process.index == 0 and rank.role == "trainer" and Trainer.of("trainer-0.rank3").rank == 3
    own = row("trainer-0", {"step": 1})
    assert own == "trainer-0" and own.rank is None and own.process.role == "trainer"
    assert json.loads(json.dumps({rank: own})) == {"trainer-0.rank3": "trainer-0"}  # text on the wire, as before


def test_the_controller_types_a_process_where_it_reads_its_record():
    from fabtrain.contract.identity import Process

    name = records.process({"name": "pserver-1", "state": "running"})["name"]
    assert isinstance(name, Process) and (name.role, name.index) == ("pserver", 1)
    agent_seen = records.health({"ts": 1.0, "processes": [{"name": "trainer-2"}]})["processes"][0]["name"]
    assert isinstance(agent_seen, Process) and agent_seen.index == 2
