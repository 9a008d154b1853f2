"""Every step counted, one step a record's window sampled (fabtrain/node/progress.py).

The hook counts each optimizer step (the clock is the writer thread's); the timing patches (backward(), batches,
DDP's forward, collectives, GradScaler) are in place for one step each INTERVAL only, whose parts and loss
(the sum of the tensors backward() ran on since the step before) the record carries. The 3-rank DDP test in
tests/local/test_progress.py checks the parts on real all-reduce waits; tests/local/test_real_loops.py the
loss of real loops under gradient accumulation."""
from __future__ import annotations

import json
import subprocess
import sys

from fabtrain.node import progress
from tests.support.launched import hook_folder, unlaunched_env


class Loss:
    """A one-element CPU tensor as the hook reads it."""
    device = "cpu"

    def __init__(self, value):
        self.value = value

    def detach(self):
        return self

    def numel(self):
        return 1

    def item(self):
        return self.value


def reporter(tmp_path, clock):
    r = progress.Reporter({progress.ENV_METRICS: str(tmp_path / "m.jsonl"), "RANK": "0"})
    r.perf = lambda: clock[0]  # noqa: E731  (the test moves time, not the machine's load)
    r._start_thread = lambda: None  # noqa: E731  (no writer thread: the test writes)
    return r


def records(tmp_path):
    path = tmp_path / "m.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_every_step_is_counted_and_one_step_a_window_is_sampled_with_the_sum_of_its_losses(tmp_path):
    clock = [100.0]
    r = reporter(tmp_path, clock)
    try:
        assert r.sampling  # the first step is sampled: its record is written at once
        for part in (0.5, 0.25):  # gradient accumulation: two micro-batches, each loss over K = 2
            r.backward(Loss(part), 0.01, clock[0], waited=0.0)
            clock[0] += 0.01
        r.step()
        assert [(x["step"], x["loss"]) for x in records(tmp_path)] == [(1, 0.75)]
        assert not r.sampling
        for _ in range(9):  # within INTERVAL: counted, nothing read
            r.backward(Loss(9.0), 0.01, clock[0])
            clock[0] += 0.01
            r.step()
        assert r.steps == 10 and len(records(tmp_path)) == 1 and r.losses == []
        clock[0] += progress.INTERVAL
        r._look()  # the writer thread's look (none in this test) finds a record due: step 11 looks, 12 is sampled
        r.step()
        assert r.sampling and len(records(tmp_path)) == 1
        r.backward(Loss(1.0), 0.02, clock[0], waited=0.005)
        r.backward(Loss(2.0), 0.02, clock[0] + 0.02, waited=0.015)
        clock[0] += 0.1
        r.step(began=clock[0] - 0.06)
        last = records(tmp_path)[-1]
        assert last["step"] == 12 and last["loss"] == 3.0 and "loss_step" not in last
        # The window's mean step time (11 steps since the first record), the sample's parts scaled to it.
        mean = (clock[0] - 100.02) / 11
        assert abs(last["step_time"] - mean) < 1e-6, last
        scale = mean / 0.1
        assert abs(last["comm_time"] - 0.02 * scale) < 1e-6 and abs(last["backward_time"] - 0.02 * scale) < 1e-6
        assert abs(last["optimizer_time"] - 0.06 * scale) < 1e-6
        assert abs(last["step_time"] - last["data_time"] - last["comm_time"] - last["compute_time"]) < 1e-5
        r.step()
        r.flush()  # a step left pending (as at exit): the last loss read, said to be an earlier step's
        assert records(tmp_path)[-1]["step"] == 13 and records(tmp_path)[-1]["loss_step"] == 12
    finally:
        r.on = False


def test_a_step_gradscaler_skips_is_not_a_step_and_its_losses_are_not_the_next_ones(tmp_path):
    clock = [100.0]
    r = reporter(tmp_path, clock)
    try:
        scaled, loss = Loss(65536.0), Loss(0.5)
        r.scaled = (scaled, loss)
        r.backward(scaled, 0.01, clock[0])  # backward() ran on the scaled loss: the loss is the one it scaled
        r.skipped()  # GradScaler.update with no optimizer step since: inf gradients, the step skipped
        assert r.steps == 0 and r.losses == [] and r.sampling
        r.backward(Loss(0.25), 0.01, clock[0])
        r.step()
        assert [(x["step"], x["loss"]) for x in records(tmp_path)] == [(1, 0.25)]
        r.skipped()  # an update after a step that was taken changes nothing
        assert r.steps == 1 and records(tmp_path)[-1]["loss"] == 0.25
    finally:
        r.on = False


PROGRAM = """
import json, sys, time
import torch
import _fabtrain_progress_frameworks as frameworks  # the hook's own copy, which it patched torch with

marks = []
mark = frameworks._mark_compute_end
def counted(*args):
    marks.append(time.perf_counter())
    return mark(*args)
frameworks._mark_compute_end = counted

w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.0)
original = getattr(torch.Tensor.backward, "__wrapped__", torch.Tensor.backward)  # the hook's patch is in: step 1
patched_steps = 0
t0 = time.perf_counter()
for _ in range(int(sys.argv[1])):
    patched_steps += torch.Tensor.backward is not original
    (w * 2).sum().backward()
    opt.step()
print(json.dumps({"marks": marks, "elapsed": time.perf_counter() - t0, "grad": w.grad.tolist(),
                  "patched_steps": patched_steps}))
"""


def test_a_fast_loop_has_its_patches_in_place_for_one_step_a_record(tmp_path):
    """backward() is the original torch function in every step but the sampled ones (the first, and one a
    record after it): the hook costs an unsampled step its optimizer post-hook only."""
    hook = hook_folder(tmp_path / "job")
    (tmp_path / "loop.py").write_text(PROGRAM)
    env = unlaunched_env()
    env.update(PYTHONPATH=str(hook), FABTRAIN_METRICS=str(tmp_path / "m.jsonl"), FABTRAIN_RANK="0")
    out = subprocess.run([sys.executable, str(tmp_path / "loop.py"), "3000"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "fabtrain progress:" not in out.stderr, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["grad"] == [2.0 * 3000] * 4  # every backward ran, as without the hook
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] == 3000
    sampled = 1 + got["elapsed"] / progress.INTERVAL
    assert 1 <= got["patched_steps"] <= sampled + 1 < 3000, (got["patched_steps"], got["elapsed"])
    assert 1 <= len(got["marks"]) == got["patched_steps"], got  # each sampled step's backward marked, no other
    assert all(b - a >= progress.INTERVAL for a, b in zip(got["marks"][1:], got["marks"][2:])), got["marks"]
