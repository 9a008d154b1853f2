"""The rank to blame and the straggler, from an unchanged torchrun DDP script (gloo, CPU) across real sshd nodes
(docs/progress.md): the steps and timings come from the launcher's progress hook, the coordinator's node names
the rank with its node, and `fab status` says it. tests/local/test_rank_blame.py and test_sync_stragglers.py
hold the finer checks (the stacks' files, the timings, equal ranks naming none, less CPU)."""
import json
import re

import pytest

from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(600)]


def events(tmp_path, node, job_id, kind):
    try:
        lines = (tmp_path / f"ws-{node}" / "jobs" / job_id / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def start(fab, tmp_path, sshd, per_node, args, **watchdog):
    port = free_port([n.address for n in sshd.nodes])
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"])],
                         job={"mode": "collective", "master_port": port,
                              "trainer": {"per_node": per_node, "command": "torchrun --max-restarts=0 "
                                                                           f"tests/programs/sync_ranks.py {args}"},
                              "watchdog": {"interval": 0.5, "grace": 1, "startup_timeout": 300, "port": port + 1,
                                           **watchdog}})
    out = fab("deploy", "start-trainers", cluster=path, check=True)
    return path, re.search(r"job (\S+): trainer started", out.stdout).group(1)


def test_a_rank_that_spins_on_another_node_is_named_with_its_node_step_and_frame(fab, tmp_path, sshd):
    path, job_id = start(fab, tmp_path, sshd, 2, "--spin 3:12 --width 32", hang_timeout=5)
    blame = wait_for(lambda: events(tmp_path, "node1", job_id, "blame"), timeout=180, interval=0.5)
    assert blame, events(tmp_path, "node1", job_id, "hang") + events(tmp_path, "node2", job_id, "hang")
    assert re.fullmatch(r"rank 3 on node2 stopped stepping at step 12 in `sync_ranks\.py:\d+ in spin_forever`; "
                        r"ranks 0, 1, 2 wait in all_reduce", blame[0]["reason"]), blame[0]
    status = fab("status", cluster=path)
    assert blame[0]["reason"] in status.stdout, status.stdout
    workspaces = [tmp_path / f"ws-{n}" for n in ("node1", "node2")]
    assert wait_for(lambda: not live_marked(workspaces), timeout=30), live_marked(workspaces)


def test_a_rank_with_a_slow_dataset_on_another_node_is_named_for_its_data_loading(fab, tmp_path, sshd):
    path, job_id = start(fab, tmp_path, sshd, 1, "--ddp --width 64 --slow-data 1:0.004", hang_timeout=60,
                         straggler={"share": 0.7, "window": 3})
    try:
        found = wait_for(lambda: events(tmp_path, "node1", job_id, "straggler"), timeout=150, interval=0.5)
        assert found, events(tmp_path, "node1", job_id, "job_failed")
        assert found[0]["rank"] == 1 and found[0]["cause"] == "data loading" and found[0]["ratio"] >= 2, found[0]
        assert found[0]["reason"].startswith("rank 1 on node2: data loading "), found[0]
        status = fab("status", cluster=path)
        assert "STRAGGLER rank 1: data loading" in status.stdout, status.stdout
    finally:
        fab("kill-all", "--grace", "1", cluster=path)
