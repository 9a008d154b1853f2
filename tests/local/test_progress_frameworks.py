"""Progress from unchanged accelerate and paddle programs (docs/progress.md; Lightning and Hugging Face's Trainer:
tests/sshd/test_progress_frameworks_ssh.py):
the framework's own step, what it logs, its total steps, in the records and the views; the same results with the
hook as without it."""
import importlib.util

import pytest

from tests.conftest import require
from tests.support.launched import launched, launched_at_once, read_records

pytestmark = pytest.mark.timeout(900)


def installed(module):
    """Asked of the import system, not imported: the job's processes import it, this one need not."""
    require(importlib.util.find_spec(module) is not None, module, "installed by `make test` (requirements-test.txt)")


def test_an_accelerate_loop_reports_its_steps_loss_and_what_it_logs_and_computes_the_same(tmp_path):
    installed("accelerate")
    loop = ["tests/programs/accelerate_loop.py", "30"]
    off, on = launched_at_once((tmp_path / "off", loop, tmp_path / "off.jsonl", {"FABTRAIN_INSTRUMENT": "0"}),
                               (tmp_path / "on", loop, tmp_path / "on.jsonl", {}))
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout and on.stdout.startswith("weights")  # its weights, bit for bit
    recs = [r for r in read_records(tmp_path / "on.jsonl") if not r.get("between_steps")]  # steps: not its exit
    assert recs and all(r["framework"] == "accelerate" and r["source"] == "auto" for r in recs), recs[:2]
    last = recs[-1]
    assert last["step"] == 30 and last["lr"] == 0.05 and last["samples_per_s"] > 0, last
    # what it logs, under its own names; the loss is the one it logs (train_loss) for the step
    assert last["loss"] == pytest.approx(last["train_loss"], rel=1e-6) and last["abs_weight"] > 0, last
    assert all(k in last for k in ("data_time", "compute_time", "comm_time", "backward_time")), last


def test_a_paddle_loop_reports_its_steps_loss_and_lr_and_computes_the_same(tmp_path):
    installed("paddle")
    # paddle_dp.py alone is a world of one (init_parallel_env does nothing without a cluster's environment)
    run = ["tests/programs/paddle_dp.py", str(tmp_path)]
    off = launched(tmp_path / "off", run, tmp_path / "off.jsonl", FABTRAIN_INSTRUMENT="0")
    weights_off = (tmp_path / "paddle-rank-0.json").read_text()
    on = launched(tmp_path / "on", run, tmp_path / "on.jsonl")
    assert on.returncode == off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    assert on.stdout == off.stdout and (tmp_path / "paddle-rank-0.json").read_text() == weights_off
    recs = [r for r in read_records(tmp_path / "on.jsonl") if not r.get("between_steps")]  # steps: not its exit
    assert recs and all(r["framework"] == "paddle" and r["source"] == "auto" for r in recs), recs[:2]
    last = recs[-1]
    printed = float(on.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])  # "paddle rank 0/1 step 9 loss 0.1331"
    assert last["step"] == 10 and last["lr"] == 0.1 and round(last["loss"], 4) == printed, (last, printed)
    assert last["backward_time"] > 0 and last["optimizer_time"] > 0, last
