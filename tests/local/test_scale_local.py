"""Many agents on one machine: a slow coordinator is not a lost one.

200 `host: local` nodes, one `sleep` trainer each, the watchdog's interval at
1 s: 200 agents and the coordinator share this machine's cores with whatever
else runs on it, so beats and answers come late, and not one of them may be
taken for a lost coordinator or a lost node. The job is held for two minutes
and must still be running on every node, with no failure anywhere.
"""
from __future__ import annotations

import json
import time

import pytest

from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port

pytestmark = [pytest.mark.scale, pytest.mark.timeout(2400)]

NODES = 200
HOLD = 120.0
BAD = {"job_failed", "peer_lost", "teardown", "hang", "not_joined", "coordinator_error", "coordinator_refused"}


def test_200_local_nodes_start_and_run_two_minutes_with_no_failure(local_job):
    names = [f"l{i:03d}" for i in range(NODES)]
    port = free_port(["127.0.0.1"])
    job = local_job([(n, ["trainer"]) for n in names], mode="collective", trainer={"command": "sleep 900"},
                    watchdog={"interval": 1, "hang_timeout": 900, "port": port})
    job.fab("deploy", check=True, timeout=600)
    job.fab("start-trainers", check=True, timeout=1500)  # 200 starts on 2 shared cores
    # Every agent has met the coordinator: the first node's roster names all of them.
    assert wait_for(lambda: len((job.health(names[0]) or {}).get("peers") or {}) == NODES, timeout=180, interval=1), \
        len((job.health(names[0]) or {}).get("peers") or {})
    time.sleep(HOLD)
    bad = {n: [e for e in job.events(n) if e["kind"] in BAD] for n in names}
    assert not any(bad.values()), {n: b for n, b in bad.items() if b}
    healths = {n: job.health(n) or {} for n in names}
    assert all(h.get("job", {}).get("status") == "running" for h in healths.values()), \
        {n: h.get("job") for n, h in healths.items() if h.get("job", {}).get("status") != "running"}
    assert all(h.get("coordinator", {}).get("connected") for h in healths.values())
    trainers = [p for h in healths.values() for p in h.get("processes", []) if p.get("state") in ("running", "sleeping")]
    assert len(trainers) == NODES, json.dumps([h.get("processes") for h in healths.values()])[:2000]
    # kill-all still ends it all.
    job.fab("kill-all", "--grace", "2", check=True, timeout=600)
    assert wait_for(lambda: not live_marked(job.ws.values()), timeout=120)
