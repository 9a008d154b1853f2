"""Progress from an unchanged torchrun DDP script on real sshd nodes (docs/progress.md): each node's
rank reports through the launcher's hook, and the dashboard's views and the TensorBoard export show
every rank."""
import json
import re

import pytest

from tests.support.sshd import free_port, write_cluster
from tests.support.views import progress_views

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(600)]


def test_a_torchrun_ddp_script_reports_every_rank_across_ssh_nodes(fab, tmp_path, sshd):
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"])],
                         job={"mode": "collective", "master_port": free_port([n.address for n in sshd.nodes]),
                              "trainer": {"per_node": 1, "command": "torchrun --max-restarts=0 "
                                                                    "tests/programs/ddp_tutorial.py 40 0.001"},
                              "watchdog": {"interval": 0.5, "port": free_port([n.address for n in sshd.nodes])}})
    out = fab("deploy", "start-trainers", cluster=path, check=True)
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    watch = fab("watch", "--timeout", "500", cluster=path, timeout=540)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    sampled = {}
    for node, name, rank in (("node1", "trainer-0", 0), ("node2", "trainer-1", 1)):
        lines = (tmp_path / f"ws-{node}" / "jobs" / job_id / "metrics" / f"{name}.jsonl").read_text().splitlines()
        recs = [r for r in map(json.loads, lines) if not r.get("between_steps")]  # steps (not busy, exiting)
        assert {r["rank"] for r in recs} == {rank} and recs[-1]["step"] == 48, recs[-1]  # 3 epochs of 16 batches
        # The loss of the last sampled step: the charts' and the export's last loss point (docs/progress.md).
        sampled[name] = max(r["step"] for r in recs if "loss" in r and "loss_step" not in r)
        assert all(r["source"] == "auto" and r["child"] and r["local_rank"] == 0 for r in recs)
    rows, series, scalars = progress_views(path, job_id, tmp_path)
    assert set(rows) == {"trainer-0", "trainer-1"} and {t["step"] for t in rows.values()} == {48}
    assert all(t["data_time"] > 0 and t["loss"] > 0 and not t["stale"] for t in rows.values()), rows
    assert all(series[name]["loss"]["x"][-1] == sampled[name] for name in rows), sampled
    for name in rows:  # each trainer's own TensorBoard run
        assert scalars[name]["train/loss"][-1][0] == sampled[name] and scalars[name]["time/data"][-1][1] > 0, scalars[name].keys()
