"""Gradient accumulation in real loops of the frameworks people use, run unchanged through the real launcher and its
progress hook (docs/progress.md), their steps and losses compared with the scripts' and the frameworks' own:

- DDP with `no_sync()` and FSDP2 with `set_requires_gradient_sync(False)` on the micro-batches before the last
  (tests/programs/ddp_accum.py: 2 ranks on gloo under torchrun), each rank printing its step's loss (the sum of
  its micro-losses as divided by K): every rank's record shows its own step's loss;
- Lightning's `Trainer(accumulate_grad_batches=K)` (tests/programs/lightning_accum.py), Hugging Face's `Trainer`
  with `gradient_accumulation_steps` and an evaluation every 10 steps (hf_accum.py), and `accelerate` with
  `Accelerator(gradient_accumulation_steps=K)` and `accelerator.accumulate(model)` (accelerate_accum.py): the
  records' step is the framework's optimizer step, and their loss within 1 % of what the framework logs for
  that step.

What the frameworks log for a step under accumulation (found with these programs; the tests rely on it):
- Lightning 2.6: `self.log("train_loss", loss, on_step=True)` in training_step is logged (to the logger, and in
  `trainer.logged_metrics`) once per optimizer step, with the LAST micro-batch's loss, undivided (Lightning
  divides the loss by K only for its backward): not the mean of the step's micro-batches. Its CSVLogger writes
  the step as `step` = global_step - 1 (its first optimizer step is `step` 0).
- Hugging Face's Trainer (transformers 5.17): with `logging_steps=1` the logged `loss` is the sum of the tensors
  each micro-batch's backward() ran on: a model that takes `num_items_in_batch` (GPT-2) divides each
  micro-batch's summed token losses by the whole step's token count (the step's token-weighted mean loss);
  otherwise each micro-loss is divided by K. `state.log_history` has it with the global step (its printed
  line has 4 significant digits).
- accelerate: `accelerator.backward(loss)` divides the loss by K itself; what a step's loss is in
  `accelerator.log` is the script's choice (here, after run_clm_no_trainer.py, the mean of the step's
  micro-losses, logged once `accelerator.sync_gradients`).
"""
import csv
import importlib.util
import json
import re

import pytest

from tests.conftest import require
from tests.support.launched import launched, read_records
from tests.support.local_job import watched_job
from workload.ddp import free_port

pytestmark = pytest.mark.timeout(300)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two OpenMP threads on this 2-core machine, beside other work: 50x slower


def installed(module):
    require(importlib.util.find_spec(module) is not None, module, "installed by `make test` (requirements-test.txt)")


def step_records(path) -> list[dict]:
    return [r for r in read_records(path) if not r.get("between_steps")]


def loss_step(r: dict) -> int:
    """The step a record's loss is of: its own, or the earlier one the hook says (`loss_step`)."""
    return r.get("loss_step", r["step"])


def check_against(recs: list[dict], logged: dict[int, float], rel: float, what: str) -> list[int]:
    """Every record that carries a loss has the one logged for its step, within `rel`; returns the steps."""
    checked = []
    for r in recs:
        if "loss" not in r:
            continue
        n = loss_step(r)
        assert n in logged, (r, what, sorted(logged)[:5])
        assert r["loss"] == pytest.approx(logged[n], rel=rel), (r, what, n, logged[n])
        checked.append(n)
    print(what, "losses checked at steps", sorted(set(checked)))
    return checked


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_every_rank_of_a_ddp_or_fsdp_job_shows_its_own_steps_mean_loss_under_no_sync(tmp_path, kind):
    installed("torch")
    steps, accum = (300, 4) if kind == "ddp" else (60, 4)
    argv = ["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port", str(free_port()),
            "tests/programs/ddp_accum.py", kind, str(steps), str(accum)]
    done = launched(tmp_path, argv, tmp_path / "m.jsonl")  # torchrun gives each worker OMP_NUM_THREADS=1
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"rank (\d) step (\d+) loss (\d+\.\d{6})", done.stdout)
    printed = {(int(r), int(s)): float(v) for r, s, v in lines}
    assert len(printed) == 2 * steps, done.stdout[-2000:]
    recs = step_records(tmp_path / "m.jsonl")
    for rank in (0, 1):
        mine = [r for r in recs if r["rank"] == rank]
        assert mine and all(r["child"] and r["framework"] == "torch" for r in mine), mine[:2]
        assert mine[-1]["step"] == steps, [r["step"] for r in mine]  # optimizer steps, not micro-batches
        assert all("loss" in r for r in mine), mine
        # The step's loss as the script sums it (printed to 6 decimals): the sum of its K backward()s' tensors.
        checked = check_against(mine, {s: v for (k, s), v in printed.items() if k == rank}, 1e-4,
                                f"rank {rank}'s printed step losses")
        assert len(set(checked)) >= 2, (rank, checked)  # step 1's and a sampled one's at least
    # Ranks see different data: a rank's record is its own loss, not another's or an all-reduced one.
    last = {r["rank"]: r for r in recs}
    assert printed[(0, steps)] != printed[(1, steps)] and last[0]["loss"] != last[1]["loss"]


def test_lightning_under_accumulate_grad_batches_steps_and_loss_are_what_lightning_logs(tmp_path):
    installed("pytorch_lightning")
    steps, accum = 300, 4
    done = launched(tmp_path, ["tests/programs/lightning_accum.py", str(tmp_path / "out"), str(steps), str(accum)],
                    tmp_path / "m.jsonl", **ONE_THREAD)
    assert done.returncode == 0 and f"done at step {steps}" in done.stdout, done.stderr[-3000:]
    with open(tmp_path / "out" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    # CSVLogger's `step` is global_step - 1 (0 after the first optimizer step): the framework's own step is +1.
    logged = {int(r["step"]) + 1: float(r["train_loss"]) for r in rows}
    assert sorted(logged) == list(range(1, steps + 1)), sorted(logged)[:5]
    recs = step_records(tmp_path / "m.jsonl")
    assert recs and all(r["framework"] == "lightning" for r in recs), recs[:2]
    assert recs[-1]["step"] == steps, [r["step"] for r in recs]
    assert recs[-1].get("total_steps") == steps, recs[-1]
    checked = check_against(recs, logged, 0.01, "Lightning's logged train_loss")
    assert len(set(checked)) >= 2, checked  # step 1's and a sampled one's at least


def test_a_hugging_face_trainer_with_accumulation_and_a_long_evaluation_is_read_and_not_hung(local_job, tmp_path):
    """In a job on a local node with a watchdog of hang_timeout 6 s: the Trainer evaluates at step 60, and at its
    last step (transformers 5 evaluates at the end too), over a DataLoader whose 48 sequences are read in 0.2 s
    each (a slow disk: over 9.6 s, under torch.no_grad()); the job runs to its end, with no hang. The interpreter's
    teardown after the hook's last word (`exiting`), 1 to 2.5 s here on a quiet machine and over 4 s with three
    test files at once, is read by its CPU time (docs/watchdog.md), not by hang_timeout alone."""
    installed("transformers")
    steps, accum, hang_timeout = 100, 4, 6
    out = tmp_path / "out"
    job = watched_job(local_job, f"python tests/programs/hf_accum.py {out} {steps} {accum} 60 0.2", hang_timeout,
                      **ONE_THREAD)
    job.fab("deploy", "start-trainers", check=True)
    watch = job.fab("watch", "--timeout", "200", timeout=240)
    log = (job.jd("n0") / "logs" / "trainer-0.log").read_text()
    events = [e for e in job.events("n0") if e["kind"] != "heartbeat"]
    assert watch.returncode == 0 and not any(e["kind"] == "hang" for e in events), (watch.stdout[-2000:], events,
                                                                                     log[-2000:])
    assert f"trained at step {steps}" in log, log[-2000:]
    history = json.loads((out / "log_history.json").read_text())
    logged = {h["step"]: h["loss"] for h in history if "loss" in h}
    evals = [h for h in history if "eval_loss" in h]
    assert sorted(logged) == list(range(1, steps + 1)), history[:3]
    # It did what this test claims: evaluations at step 60 and at the end, each longer than hang_timeout.
    assert [h["step"] for h in evals] == [60, steps], evals
    assert all(h["eval_runtime"] > 1.5 * hang_timeout for h in evals), evals
    recs = step_records(job.jd("n0") / "metrics" / "trainer-0.jsonl")
    assert recs and all(r["framework"] == "transformers" for r in recs), recs[:2]
    assert recs[-1]["step"] == steps and recs[-1].get("total_steps") == steps, recs[-1]
    checked = check_against(recs, logged, 0.01, "the Trainer's logged loss")
    assert len(set(checked)) >= 2, checked  # step 1's and a sampled one's at least


def test_an_accelerate_loop_with_accumulate_steps_and_loss_are_what_it_logs(tmp_path):
    installed("accelerate")
    steps, accum = 300, 4
    done = launched(tmp_path, ["tests/programs/accelerate_accum.py", str(steps), str(accum)], tmp_path / "m.jsonl",
                    **ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+)$", done.stdout, re.M)}
    assert sorted(logged) == list(range(1, steps + 1)), done.stdout[-1000:]
    recs = step_records(tmp_path / "m.jsonl")
    assert recs and all(r["framework"] == "accelerate" for r in recs), recs[:2]
    assert recs[-1]["step"] == steps, [r["step"] for r in recs]  # the real steps, not the micro-batches
    checked = check_against(recs, logged, 0.01, "the loss it logs with accelerator.log")
    assert len(set(checked)) >= 2, checked  # step 1's and a sampled one's at least
