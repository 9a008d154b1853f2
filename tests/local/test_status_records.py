"""Node ops' `status` process records, written from real processes and read back by the controller's checks:
every field the writer puts in one is a field of the contract's table (contract/records.py STATUS_PROCESS), and
the controller keeps it. (Two fields the writer set, `reason` and `left_behind`, were once dropped on the way to
`fab status` because the table did not name them.)"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from fabtrain.contract import records as fields
from fabtrain.controller import records
from fabtrain.node import atomic, ops
from fabtrain.node.spawn import name_programs, spawn
from tests.support.launched import make_job_dir, plain_env, process_spec
from tests.support.procscan import wait_for

pytestmark = pytest.mark.timeout(60)
JOB = "20261127-040000-abcd"


def test_every_field_of_a_status_process_record_is_the_tables_and_reaches_the_controller(tmp_path):
    ws = str(tmp_path / "ws")
    jd = make_job_dir(os.path.join(ws, "jobs", JOB))
    marker = {"FABTRAIN_WORKSPACE": ws, "FABTRAIN_JOB_ID": JOB}
    specs = {"trainer-0": process_spec(jd, "trainer-0", ["sleep", "60"], marker),  # runs
             "trainer-1": process_spec(jd, "trainer-1", ["sh", "-c", "exit 3"], marker),  # exited 3
             "trainer-2": process_spec(jd, "trainer-2", ["sleep", "60"], marker)}  # its launcher killed
    atomic.write(os.path.join(jd, "job.json"), json.dumps(
        {"job_id": JOB, "processes": [{"name": n} for n in [*specs, "trainer-3"]]}))  # trainer-3: never started
    started = [spawn(spec, ws, plain_env()) for spec in specs.values()]
    name_programs(started, ws, specs, time.time() + 20)
    try:
        launcher_2 = started[2][0]
        os.kill(launcher_2.pid, signal.SIGKILL)  # no exit record: its death is all there is to say
        launcher_2.wait(10)
        assert wait_for(lambda: os.path.exists(os.path.join(jd, "run", "trainer-1.exit")), timeout=20)
        reply = ops.op_status({"workspace": ws, "job_id": JOB})
    finally:
        for p, _ in started:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
    by_name = {p["name"]: p for p in reply["processes"]}
    assert by_name["trainer-0"]["state"] == "running" and by_name["trainer-1"]["exit_code"] == 3
    assert by_name["trainer-3"]["state"] == "not started"
    assert "died without recording an exit code" in by_name["trainer-2"]["reason"], by_name["trainer-2"]
    for written in reply["processes"]:
        assert set(written) <= set(fields.STATUS_PROCESS), set(written) - set(fields.STATUS_PROCESS)
        kept = records.process(written)
        assert {k: kept.get(k) for k, v in written.items() if v is not None} == \
            {k: v for k, v in written.items() if v is not None}, (written, kept)
