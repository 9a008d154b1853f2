"""As many nodes as this machine holds: 200 `host: local` nodes of one collective job, on 2 cores.

Every node's agent, launcher and trainer shares this machine's CPU and one process table with
every other node's, and the first node's agent hosts the coordinator for all 200. A slow agent
or coordinator is not a lost one: the job starts, runs for 2 minutes with no node, agent or
coordinator lost and no failure anywhere (`fab status` in the middle sees every trainer running),
and `fab kill-all` leaves nothing of it in /proc.

The trainer shows progress as a real one does (a metrics record and a log line every 5 s); one
that shows none is hung by the hang rule at any scale (docs/watchdog.md).
"""
from __future__ import annotations

import time

import pytest

from tests.support.local_job import LocalJob
from tests.support.procscan import live_marked
from tests.support.sshd import free_port

pytestmark = [pytest.mark.timeout(1200), pytest.mark.alone]

NODES = 200
HOLD = 120.0  # seconds the running job is watched
TRAINER = ("sh -c 'i=0; while :; do echo \"{{\\\"step\\\": $i}}\" >> \"$FABTRAIN_METRICS\"; echo \"step $i\"; "
           "i=$((i+1)); sleep 5; done'")
# Any of these on any node means a node, an agent or the coordinator was taken for lost, or the job failed.
FAILURE_KINDS = {"peer_lost", "peer_back", "node_left", "not_joined", "coordinator_error", "coordinator_refused",
                 "hang", "teardown", "start_failed", "failed", "job_failed", "exited", "killed", "orphan", "zombie",
                 "agent_restarted", "agent_launcher_lost", "agent_error", "agent_stopped"}


def failures(job: LocalJob, names: list[str]) -> list[tuple[str, str, str]]:
    return [(n, e["kind"], e.get("reason", "")) for n in names for e in job.events(n) if e["kind"] in FAILURE_KINDS]


def test_200_local_nodes_start_run_two_minutes_with_nothing_lost_and_stop(tmp_path):
    names = [f"l{i:03d}" for i in range(NODES)]
    code = tmp_path / "code"  # the trainer is a shell command: a small code folder keeps deploy short
    code.mkdir()
    (code / "README").write_text("the 200-node test's job code\n")
    job = LocalJob(tmp_path, [(n, ["trainer"]) for n in names],
                   {"code": str(code), "mode": "collective", "trainer": {"command": TRAINER},
                    "watchdog": {"interval": 1, "port": free_port(["127.0.0.1"])}})
    try:
        job.fab("deploy", check=True, timeout=600)
        t0 = time.monotonic()
        started = job.fab("start-trainers", check=True, timeout=600)
        start_s = time.monotonic() - t0
        assert started.stdout.count("started agent") == NODES, started.stdout[-2000:]

        # 2 minutes of running, `fab status` (200 node-side calls) in the middle of them.
        held_from, status = time.monotonic(), None
        while time.monotonic() - held_from < HOLD:
            time.sleep(10)
            assert failures(job, names) == [], failures(job, names)[:5]
            if status is None and time.monotonic() - held_from > HOLD / 2:
                status = job.fab("status", timeout=600)
                assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-2000:]
                lines = status.stdout.splitlines()
                assert lines[0].startswith(f"job {job.job_id}: running"), lines[0]
                assert sum(1 for line in lines if " trainer-" in line and " running " in line) == NODES
        for n in names:
            h = job.health(n)
            assert h is not None and h["job"]["status"] == "running", (n, h and h["job"])
            assert h["coordinator"]["connected"], (n, h["coordinator"])
            (p,) = h["processes"]
            assert p["state"] in ("running", "sleeping") and p["last_record"], (n, p)
        assert len(job.health(names[0])["peers"]) == NODES  # the coordinator's agent holds all 200
        assert failures(job, names) == [], failures(job, names)[:5]

        t0 = time.monotonic()
        job.fab("kill-all", check=True, timeout=600)
        assert live_marked(job.ws.values()) == []
        print(f"200 local nodes: start {start_s:.0f} s, kill-all {time.monotonic() - t0:.0f} s")
    finally:
        job.cleanup()
