"""What the node writes is what the controller reads: the record tables, event kinds and refusals of
fabtrain/contract/, checked from both sides."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fabtrain.contract import records as fields
from fabtrain.contract.events import EventKind, read_events
from fabtrain.contract.replies import JOB_RUNNING, UserFacing, job_running, refused
from fabtrain.controller import records, report
from fabtrain.controller.lifecycle import StartResult
from fabtrain.node.agent.policy import Ledger
from fabtrain.node.agent.snapshot import process_view
from fabtrain.remote.transport import Reply

SAMPLE = {fields.NUMBER: 1.5, fields.INTEGER: 7, fields.FLAG: True, fields.NAME: "trainer-0", fields.RANK: 3,
          fields.STATE: "running", fields.SIGNAL: "SIGTERM", fields.REASON: "a reason", fields.TEXT: "a line"}


def sample(table: dict) -> dict:
    return {field: SAMPLE[kind] for field, kind in table.items()}


def test_every_type_a_table_names_has_a_check_on_the_controller():
    used = {kind for table in (fields.HEALTH_PROCESS, fields.HEALTH_AGENT, fields.STATUS_PROCESS, fields.EVENT,
                               fields.METRIC) for kind in table.values()}
    assert used <= set(SAMPLE) == set(records.CHECKS)


def test_every_field_a_node_writes_is_kept_by_the_controller():
    """From the shared tables: a field the writers may write (record() refuses any other) is a field
    the controller keeps, whatever is added to them."""
    process, agent = sample(fields.HEALTH_PROCESS), sample(fields.HEALTH_AGENT)
    kept = records.health({"ts": 1.0, "processes": [process], "agent": agent})
    assert kept["processes"] == [process] and kept["agent"] == agent
    assert {"launcher_pid", "step_rate"} <= set(kept["processes"][0])
    status = sample(fields.STATUS_PROCESS)
    assert records.process(status) == status
    event = sample(fields.EVENT) | {"kind": "job_failed"}
    assert records.event(json.dumps(event)) == event
    metric = sample(fields.METRIC)
    assert records.metric(json.dumps(metric)) == metric


def test_the_agents_process_entry_is_built_from_the_table_and_arrives_whole():
    steps = SimpleNamespace(rate=lambda: 2.5)
    progress = SimpleNamespace(last_record=100.0, last_activity=99.0, steps=steps, cpu_percent=40.0)
    ctx = SimpleNamespace(name="trainer-0", role="trainer", rank=0, pid=4321, launcher=4320, state="running",
                          exit_code=None, signal=None, progress=progress, live=True, rss=1 << 20, tree=[4321],
                          zombies=(), close_reason=None)
    procs = {4321: SimpleNamespace(dead=False)}
    entry = process_view(ctx, Ledger(), procs, {})
    assert list(entry) == list(fields.HEALTH_PROCESS)
    seen = records.health({"ts": 1.0, "processes": [entry]})["processes"][0]
    assert (seen["launcher_pid"], seen["step_rate"], seen["pid"]) == (4320, 2.5, 4321)
    with pytest.raises(TypeError, match="wrapper_pid"):
        fields.record(fields.HEALTH_PROCESS, name="trainer-0", wrapper_pid=1)


def test_an_event_kind_is_its_string_in_json_and_back():
    assert json.dumps({"kind": EventKind.JOB_FAILED}) == '{"kind": "job_failed"}'
    assert EventKind("job_failed") is EventKind.JOB_FAILED and f"{EventKind.KEPT}" == "kept"
    assert {"job_failed": 1}.get(EventKind.JOB_FAILED) == 1 and EventKind.FINISHED in {"finished"}


def test_the_events_reader_keeps_whole_objects_from_an_offset(tmp_path):
    path = tmp_path / "events.jsonl"
    assert read_events(str(path)) == []
    first = '{"kind": "agent_started", "node": "n0"}\n'
    path.write_text(first + '[1, 2]\nnot json\n{"kind": "finished", "node": "n0"}\n{"kind": "exit')
    assert [e["kind"] for e in read_events(str(path))] == ["agent_started", "finished"]
    assert [e["kind"] for e in read_events(str(path), len(first))] == ["finished"]


def _start(*replies: Reply) -> StartResult:
    return StartResult(job_id="20261124-045501-5d89", plan=None, replies=list(replies))


def test_a_running_job_is_read_from_the_refusals_code_never_from_its_words():
    refusal = job_running("20261124-000000-aaaa", ["trainer-0", "trainer-1"])
    reply = refused(refusal)
    assert reply == {"ok": False, "error": str(refusal), "code": JOB_RUNNING,
                     "detail": {"job_id": "20261124-000000-aaaa", "processes": ["trainer-0", "trainer-1"]}}
    coded = Reply("n0", False, error="n0: " + reply["error"], code=reply["code"], detail=reply["detail"])
    line = report.running_refusal(_start(coded))
    assert line.startswith("nothing was started: job 20261124-000000-aaaa is running (n0: trainer-0, trainer-1)")
    # The same words without the code (a program's output that says them): an ordinary failure.
    worded = Reply("n0", False, error=coded.error)
    assert report.running_refusal(_start(worded)) is None and report.running_here(worded) is None
    # A code whose detail is not what the contract says (another node's fabtrain, a bad job id): not a refusal.
    bad = Reply("n0", False, error=coded.error, code=JOB_RUNNING, detail={"job_id": "../x", "processes": []})
    assert report.running_here(bad) is None
    assert refused(UserFacing("plain")) == {"ok": False, "error": "plain"}


def test_the_progress_hooks_copy_of_the_record_names_is_the_contracts():
    """The hook runs inside the user's program and cannot import fabtrain: its copy must not drift."""
    from fabtrain.contract import progress as contract
    from fabtrain.node import progress as hook
    assert (hook.AUTO, hook.ENV_INSTRUMENT) == (contract.AUTO, contract.ENV_INSTRUMENT)
