"""A straggler whose cause is communication: a synchronous DDP job (torchrun, gloo, an unchanged script) on three
nodes, each with its own network (tests/support/netns.py), then node3's outgoing link capped at 20 mbit (tbf on its
eth0, inside its namespace). Every rank then spends its step in the gradient all-reduce alike, so comm_time
cannot tell; node3's sends stay backed up while the others' drain (the agents sample each comm-bound rank's TCP
send backlog), and the coordinator's node names node3's rank for its communication: the `straggler` event,
health.json's `stragglers`, fab status, fab watch and the dashboard. Uncapped, the same job names nobody for its
communication (data loading or compute findings are other rules', which a rank starved of these 2 cores may
earn: tests/local/test_sync_stragglers.py's equal ranks run alone for that)."""
from __future__ import annotations

import json
import re
import time

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.dashboard import create_app
from fabtrain.remote.session import Session
from tests.conftest import require, require_import
from tests.support import netns
from tests.support.procscan import wait_for
from tests.support.sshd import write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

NODES = ("node1", "node2", "node3")
WINDOW = 3
UNCAPPED = 10.0  # s the uncapped job is watched once every rank steps: samples (0.5 s apart) and WINDOW, twice over
TOKEN = "comm-straggler-token-0123456789abcdef"
HOST = "127.0.0.1:8265"


@pytest.fixture
def net(tmp_path):
    why = netns.available()
    require(why is None, "network namespaces", why or "")
    cluster = netns.NetnsCluster(tmp_path / "netns", len(NODES))
    yield cluster
    cluster.close()


def events(root, job_id, kind):
    try:
        lines = (root / "ws-node1" / "jobs" / job_id / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [e for e in map(json.loads, filter(str.strip, lines)) if e["kind"] == kind]


def health(root, node, job_id):
    try:
        return json.loads((root / f"ws-{node}" / "jobs" / job_id / "health.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.alone  # beside another test file's jobs a rank really does lose CPU for seconds: a compute finding first
def test_a_rank_whose_link_is_capped_is_named_for_its_communication(fab, tmp_path, net):
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    path = write_cluster(tmp_path / "c.yaml", net, ssh_nodes=[(n, ["trainer"]) for n in NODES],
                         job={"mode": "collective", "master_port": 29500,
                              "trainer": {"per_node": 1, "command": "torchrun --max-restarts=0 "
                                                                    "tests/programs/sync_ranks.py --ddp --width 512"},
                              "watchdog": {"interval": 0.5, "grace": 1, "hang_timeout": 60, "startup_timeout": 300,
                                           "port": 7180, "straggler": {"share": 0.7, "window": WINDOW}}})
    out = fab("deploy", "start-trainers", cluster=path, check=True)
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    session = None
    try:
        def stepping():
            return all(any((p.get("step_rate") or 0) > 0 for p in health(tmp_path, n, job_id).get("processes", []))
                       for n in NODES)
        assert wait_for(stepping, timeout=150, interval=0.5), [health(tmp_path, n, job_id) for n in NODES]
        # Uncapped: every link drains; nobody is named for communication.
        time.sleep(UNCAPPED)
        said = events(tmp_path, job_id, "straggler")
        assert not [e for e in said if e.get("cause") == "communication"], said

        capped = time.monotonic()
        net.cap("node3", "20mbit", way="out")

        def named():
            return [e for e in events(tmp_path, job_id, "straggler") if e.get("cause") == "communication"]
        found = wait_for(named, timeout=90, interval=0.5)  # seen: 8.5 to 34.6 s on a busy machine
        assert found, (events(tmp_path, job_id, "straggler"), health(tmp_path, "node1", job_id).get("stragglers"))
        ev = found[0]
        print(f"named {time.monotonic() - capped:.1f} s after the cap: {ev['reason']}; every straggler event: "
              f"{[(e.get('rank'), e.get('cause')) for e in events(tmp_path, job_id, 'straggler')]}")
        assert (ev["origin"], ev["rank"], ev["name"]) == ("node3", 2, "trainer-2"), ev
        assert re.fullmatch(r"rank 2 on node3: communication, its sends back up \(data waiting to go out in \d+% of "
                            r"the samples, .* on average, vs \d+% for the median rank\) while collectives take \d+% of "
                            r"its step; the other ranks wait for it in their collectives", ev["reason"]), ev
        assert ev["backed_up"] >= 0.75 and ev["backlog"] > 0 and ev["ratio"] >= 1.5, ev

        # Reported the same way everywhere while it lasts.
        mark = "STRAGGLER rank 2: communication, sends backed up"
        standing = health(tmp_path, "node1", job_id).get("stragglers") or []
        assert [(s["node"], s["rank"], s["cause"]) for s in standing] == [("node3", 2, "communication")], standing
        status = fab("status", cluster=path)
        assert re.search(rf"^node3\s+trainer-2\s+running\s.*{mark}", status.stdout, re.M), status.stdout
        watch = fab("watch", "--timeout", "2", cluster=path)
        assert f"trainer-2 running {mark}" in watch.stdout, watch.stdout
        session = Session(load_cluster(str(path)))
        collector = Collector(session, job_id=job_id)
        dashboard = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST],
                                "TESTING": True}).test_client()
        collector.poll()
        job = dashboard.get("/api/job", headers={"Host": HOST, "Authorization": f"Bearer {TOKEN}"}).get_json()
        marks = {t["name"]: t["straggler"] for t in job["trainers"]}
        assert marks["trainer-2"]["cause"] == "communication" and marks["trainer-2"]["mark"].startswith(mark), marks
        assert marks["trainer-0"] is None and marks["trainer-1"] is None, marks
    finally:
        if session is not None:
            session.close()
        net.heal("node3")
        fab("kill-all", "--grace", "1", cluster=path)
