"""Progress from unchanged Lightning and Hugging Face Trainer programs on real sshd nodes (docs/progress.md):
the framework's own step, what it logs and its total steps reach the records on each node, `fab watch`, the
dashboard's views and the TensorBoard export."""
import importlib.util
import json
import re

import pytest

from tests.conftest import require
from tests.support.sshd import write_cluster
from tests.support.views import progress_views
from workload.ddp import free_port

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(900)]


def installed(module):
    """Asked of the import system, not imported: the job's processes import it, this one need not."""
    require(importlib.util.find_spec(module) is not None, module, "installed by `make test` (requirements-test.txt)")


def finished(fab, tmp_path, sshd, nodes, command):
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[(n, ["trainer"]) for n in nodes],
                         job={"mode": "collective", "master_port": free_port(),
                              "trainer": {"per_node": 1, "command": command},
                              "watchdog": {"interval": 0.5, "port": free_port()}})
    out = fab("deploy", "start-trainers", cluster=path, check=True)
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    watch = fab("watch", "--timeout", "800", cluster=path, timeout=840)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    records = {f"trainer-{i}": [r for r in map(json.loads, (tmp_path / f"ws-{node}" / "jobs" / job_id / "metrics" /
                                                         f"trainer-{i}.jsonl").read_text().splitlines())
                                if not r.get("between_steps")]  # the steps' records (not busy or exiting)
               for i, node in enumerate(nodes)}
    return path, job_id, watch.stdout, records


def test_a_lightning_ddp_script_across_two_ssh_nodes_reports_its_steps_logs_and_total(fab, tmp_path, sshd):
    installed("pytorch_lightning")
    path, job_id, watch, records = finished(fab, tmp_path, sshd, ["node1", "node2"],
                                            "torchrun --max-restarts=0 tests/programs/lightning_ddp.py 40")
    for rank, name in enumerate(records):
        mine = records[name]
        assert {r["rank"] for r in mine} == {rank}, mine[-1]  # each node's rank, in its own file
        assert mine[-1]["step"] == 40 and mine[-1]["total_steps"] == 40, mine[-1]  # max_steps, as Lightning knows it
        assert all(r["framework"] == "lightning" and r["source"] == "auto" for r in mine)
        assert mine[-1]["train_loss"] > 0 and mine[-1]["loss"] == mine[-1]["train_loss"] and mine[-1]["epoch"] == 1
        assert [r["step"] for r in mine] == sorted(r["step"] for r in mine)
    assert "40/40" in watch and "trainer-1" in watch
    rows, series, scalars = progress_views(path, job_id, tmp_path)
    assert set(rows) == {"trainer-0", "trainer-1"}
    assert all(t["step"] == 40 and t["total_steps"] == 40 and t["framework"] == "lightning" for t in rows.values())
    assert all(series[name]["loss"]["x"][-1] == 40 for name in rows)
    assert scalars["trainer-1"]["train/loss"][-1][0] == 40 and "time/step" in scalars["trainer-0"]


def test_a_hugging_face_trainer_on_an_ssh_node_reports_its_steps_logs_and_total(fab, tmp_path, sshd):
    installed("transformers")
    path, job_id, watch, records = finished(fab, tmp_path, sshd, ["node1"],
                                            f"python tests/programs/hf_trainer.py {tmp_path / 'out'} 20")
    recs = records["trainer-0"]
    assert all(r["framework"] == "transformers" and r["rank"] == 0 for r in recs)
    last = recs[-1]
    assert last["step"] == 20 and last["total_steps"] == 20 and 0 < last["epoch"] <= 1, last
    assert last["loss"] > 0 and "grad_norm" in last and last["learning_rate"] > 0  # what it logs, its names
    assert "20/20" in watch
    rows, series, scalars = progress_views(path, job_id, tmp_path)
    (t,) = rows.values()
    assert t["step"] == 20 and t["total_steps"] == 20 and t["loss"] > 0
    assert series["trainer-0"]["loss"]["x"][-1] == 20 and scalars["trainer-0"]["train/loss"][-1][0] == 20
