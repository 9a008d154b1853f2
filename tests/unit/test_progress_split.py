"""A backward's split into compute and the wait for gradient collectives, marked at most every SPLIT_EVERY.

Marking a backward's end of computation makes the autograd engine call back into Python (15 to 30 us of
CPU a backward on this machine, more on a device's thread): the hook marks one backward every SPLIT_EVERY
seconds and splits those between as the last marked one was (fabtrain/node/progress.py). The 3-rank DDP
test in tests/local/test_progress.py checks the split on real all-reduce waits."""
from __future__ import annotations

import json
import subprocess
import sys

from fabtrain.node import progress
from tests.support.launched import hook_folder, unlaunched_env


def test_the_backwards_of_unmarked_steps_are_split_as_those_of_the_last_marked_step(tmp_path):
    r = progress.Reporter({progress.ENV_METRICS: str(tmp_path / "m.jsonl"), "RANK": "0"})
    r.perf = lambda: 100.0  # noqa: E731  (a clock that stands still: every step within SPLIT_EVERY of the last)
    loss = object()  # no detach(): kept as it is
    comm = lambda: r.pending[progress.COMM]  # noqa: E731
    assert r.split.marking  # until a first step ends, every backward is marked
    # A marked step of gradient accumulation: three backwards that wait for nothing, and the last, which waits.
    for _ in range(3):
        r.backward(loss, 1.0, 0.0, waited=0.0)
    r.backward(loss, 2.0, 0.0, waited=1.5)
    assert comm() == 1.5
    r.step()
    assert not r.split.marking, "the step after, within SPLIT_EVERY of the marked one, is not marked"
    assert comm() == 0.0  # the step's timings went with it
    for _ in range(3):
        r.backward(loss, 1.0, 0.0)
    r.backward(loss, 2.0, 0.0)  # not marked: the step's 5 s of backward waits 1.5 / 5 of it, as the marked step
    assert abs(comm() - 1.5) < 1e-9
    r.step()
    assert not r.split.marking
    r.split.marked_at -= 1.5 * progress.SPLIT_EVERY
    r.step()
    assert r.split.marking  # a step that ends over SPLIT_EVERY after the last marked one: the next is marked
    r.backward(loss, 1.0, 0.0, waited=5.0)
    assert comm() == 1.0  # a step's timings start at 0; a wait longer than the call is the whole call
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
t0 = time.perf_counter()
for _ in range(int(sys.argv[1])):
    (w * 2).sum().backward()
    opt.step()
print(json.dumps({"marks": marks, "elapsed": time.perf_counter() - t0, "grad": w.grad.tolist()}))
"""


def test_a_fast_loop_marks_one_backward_every_split_every_seconds(tmp_path):
    hook = hook_folder(tmp_path / "job")
    (tmp_path / "loop.py").write_text(PROGRAM)
    env = unlaunched_env()
    env.update(PYTHONPATH=str(hook), FABTRAIN_METRICS=str(tmp_path / "m.jsonl"), FABTRAIN_RANK="0")
    out = subprocess.run([sys.executable, str(tmp_path / "loop.py"), "3000"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "fabtrain progress:" not in out.stderr, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    marks = got["marks"]
    assert marks, "no backward was marked"
    assert all(b - a >= progress.SPLIT_EVERY for a, b in zip(marks, marks[1:])), marks
    assert len(marks) <= 1 + got["elapsed"] / progress.SPLIT_EVERY < 3000, (len(marks), got["elapsed"])
    assert got["grad"] == [2.0 * 3000] * 4  # every backward ran, as without the hook
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] == 3000


def test_the_optimizer_part_runs_from_the_steps_last_backward_to_the_steps_end(tmp_path):
    """One post-hook on the optimizer's step: its time is counted from the end of the step's backward
    (under Lightning the step's closure runs forward and backward inside the optimizer's step: not its), or
    from the last step's end for a second optimizer after the same backward."""
    r = progress.Reporter({progress.ENV_METRICS: str(tmp_path / "m.jsonl"), "RANK": "0"})
    opt = progress.OPTIMIZER
    clock = [100.0]
    r.perf = lambda: clock[0]  # noqa: E731
    r.last_write = 100.0  # no record due: the window's sums stay to be read
    r.backward(object(), 0.25, 99.0, waited=0.0)  # ended 0.75 s ago
    began = r.backward_end
    assert began == 99.25
    r.step(began=began)
    assert r.sums[opt] == 0.75  # from the backward's end to the step's
    clock[0] += 0.25
    r.step(began=began)  # a second optimizer after the same backward: from the first one's end
    assert abs(r.sums[opt] - 1.0) < 1e-9
    r.on = False
