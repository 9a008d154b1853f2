"""A nanoGPT-shaped training script (tests/programs/gpt_loop.py: karpathy/nanoGPT's train.py loop, unchanged in
shape) read by the launcher's progress hook, and watched by a real local job's watchdog.

What the hook must read from it (docs/progress.md): `step` is the number of optimizer steps taken (an iteration
whose step torch.amp.GradScaler skips for inf gradients is not one), and a record's `loss` is the loss of the step
it reports: the sum of the tensors backward() was called on since the step before (nanoGPT divides each of its
`gradient_accumulation_steps` micro-losses by their number, so: the mean of the micro-batches' losses), with the
GradScaler's scale undone. nanoGPT itself prints `iter {iter_num}: loss {lossf:.4f}` after each step, with
`lossf = loss.item() * gradient_accumulation_steps`: the LAST micro-batch's loss, scaled back up (its own comment:
"approximating the true total loss"); its `iter 0` line comes after its first optimizer step.

What the watchdog must do with it (docs/watchdog.md): a rank that evaluates (forwards under torch.no_grad(), no
DataLoader) or saves a checkpoint for longer than hang_timeout is not hung; a rank whose forward never returns, or
whose save writes no byte, is, within hang_timeout + 0.5 s.
"""
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require_import
from tests.support.launched import launched, read_records
from tests.support.local_job import watched_job
from tests.support.procscan import live_marked, wait_for

PROGRAM = "tests/programs/gpt_loop.py"
HANG_TIMEOUT = 3
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two OpenMP threads on this 2-core machine, beside other work: 50x slower


def write_tokens(folder: Path) -> Path:
    """nanoGPT's data/<dataset>/{train,val}.bin: uint16 tokens, here a pattern a tiny GPT learns (each token
    follows from the one before, 4 times in 5)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 20000), ("val.bin", 4000)):
        follows = rng.random(n) < 0.8
        noise = rng.integers(0, 64, n)
        t = np.zeros(n, dtype=np.uint16)
        for i in range(1, n):
            t[i] = (t[i - 1] * 5 + 3) % 64 if follows[i] else noise[i]
        t.tofile(folder / name)
    return folder


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def printed_iters(stdout: str) -> dict[int, float]:
    """nanoGPT's own lines, `iter {iter_num}: loss {lossf:.4f}, time ...`: {iter_num: lossf}."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("iter "):
            head, rest = line[5:].split(": loss ", 1)
            out[int(head)] = float(rest.split(",", 1)[0])
    return out


def optimizer_steps(stdout: str) -> int:
    line = [x for x in stdout.splitlines() if x.startswith("optimizer steps ")]
    assert line, stdout[-2000:]
    return int(line[-1].split()[-1])


def step_records(records: list[dict]) -> list[dict]:
    return [r for r in records if not r.get("between_steps")]


def check_losses(recs: list[dict], trace: list[dict], printed: dict[int, float], accum: int):
    """Each record's loss against the script's own figures for the same optimizer step (the record's `step`, or
    its `loss_step` where the hook says its loss is an earlier step's: a record of steps none of which was
    sampled); the n-th step is the n-th iteration whose step was not skipped. Exactly the mean of its
    micro-batches' losses (what the hook sums: each micro-loss / accum); within their spread of what nanoGPT
    prints (the last one); and neither the last micro-loss as divided (loss / accum, what a hook that reads only
    the last backward() shows) nor it times the GradScaler's scale. Returns the steps checked."""
    stepped = [t for t in trace if "iter" in t and not t["skipped"]]
    checked = []
    for r in recs:
        assert "loss" in r, r
        n = r.get("loss_step", r["step"])
        assert 1 <= n <= r["step"], r
        it = stepped[n - 1]
        micro = it["micro"]
        mean, spread, last = sum(micro) / len(micro), max(micro) - min(micro), printed[it["iter"]]
        where = f"record {r}: its loss is step {n}'s = iter {it['iter']}: micro-losses {micro} " \
                f"(mean {mean:.6f}), scale {it['scale']}, printed {last}"
        assert r["loss"] == pytest.approx(mean, rel=1e-4, abs=1e-5), where
        assert abs(r["loss"] - last) <= spread + 1e-4, where
        assert abs(r["loss"] - last / accum) > 0.5 * last / accum, where  # not the scaled micro-batch loss
        assert r["loss"] < 2 * max(micro), where  # nor times the GradScaler's scale
        checked.append(n)
    print("losses checked at steps", sorted(set(checked)))
    return checked


@pytest.mark.timeout(300)
def test_a_nanogpt_loop_under_a_grad_scaler_counts_the_steps_taken_and_shows_each_steps_mean_loss(tmp_path):
    """float16 autocast on the CPU with a GradScaler whose first scale (2**24) overflows the scaled gradients:
    the scaler skips the first iterations' steps (and another one after its scale has dropped once; the
    trace says which), as it does at the start of a real fp16 run. 151 iterations of 4 micro-batches."""
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    data = write_tokens(tmp_path / "data")
    accum, max_iters = 4, 150
    argv = [PROGRAM, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", f"--trace={tmp_path / 'trace.jsonl'}",
            "--dtype=float16", f"--scaler_init_scale={2.0 ** 24}", f"--gradient_accumulation_steps={accum}",
            f"--max_iters={max_iters}", f"--lr_decay_iters={max_iters}", "--eval_interval=50"]
    done = launched(tmp_path, argv, tmp_path / "m.jsonl", **ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = read_trace(tmp_path / "trace.jsonl")
    printed = printed_iters(done.stdout)
    assert sorted(printed) == list(range(max_iters + 1)), done.stdout[-2000:]  # nanoGPT runs iters 0..max_iters
    skipped = [t["iter"] for t in trace if "iter" in t and t["skipped"]]
    steps = optimizer_steps(done.stdout)
    assert skipped and steps == max_iters + 1 - len(skipped), (skipped, steps)  # AdamW's own count
    recs = step_records(read_records(tmp_path / "m.jsonl"))
    assert recs and all(r["source"] == "auto" and r["framework"] == "torch" for r in recs), recs[:2]
    assert [r["step"] for r in recs] == sorted({r["step"] for r in recs}), [r["step"] for r in recs]
    # The optimizer's steps, not the script's iterations: the scaler's skipped steps are not counted.
    assert recs[-1]["step"] == steps, (recs[-1], steps, skipped)
    checked = check_losses(recs, trace, printed, accum)
    assert len(set(checked)) >= 2, checked  # step 1's and a sampled one's at least


class SlowDisk:
    """A checkpoint file on slow storage: `path` is a FIFO whose bytes a thread of the test takes `chunk` at a
    time every `every` seconds (one save after another), so the program's torch.save blocks in write() as on a
    slow network file system, and writes on at that pace. No reader at all (`reading=False`): storage that takes no
    byte; the save blocks as it opens the file."""

    def __init__(self, path: Path, chunk=4096, every=0.09, reading=True):
        self.path, self.chunk, self.every = path, chunk, every
        os.mkfifo(path)
        self.saves = []  # (first byte, end of file, bytes) of each save
        self.stopped = False
        self.thread = threading.Thread(target=self._drain, daemon=True) if reading else None
        if self.thread:
            self.thread.start()

    def _drain(self):
        while not self.stopped:
            with open(self.path, "rb", buffering=0) as f:  # until a writer opens it
                first, n = None, 0
                while True:
                    b = f.read(self.chunk)
                    if not b:
                        break
                    first = first or time.time()
                    n += len(b)
                    time.sleep(self.every)
                if n:
                    self.saves.append((first, time.time(), n))

    def close(self):
        self.stopped = True
        if self.thread and self.thread.is_alive():
            try:  # let a reader waiting for a writer in open() see end of file
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            self.thread.join(3)


def gpt_job(local_job, tmp_path, *options):
    """gpt_loop.py in a job on one local node with a watchdog of hang_timeout 3 s; the program's trace file."""
    data = write_tokens(tmp_path / "data")
    trace = tmp_path / "trace.jsonl"
    command = " ".join(["python", PROGRAM, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}",
                        f"--trace={trace}", *options])
    return watched_job(local_job, command, HANG_TIMEOUT, **ONE_THREAD), trace


def kinds(job):
    return [e["kind"] for e in job.events("n0")]


@pytest.mark.timeout(300)
def test_a_long_evaluation_and_a_slow_checkpoint_save_are_not_a_hang(local_job, tmp_path):
    """nanoGPT's evaluation at iteration 10 (eval_iters forwards a split under torch.no_grad(), 0.12 s each: about
    2.5 x hang_timeout), then its torch.save of the checkpoint to storage that takes 45 KB/s (about 6 s for its
    344 KB: 2 x hang_timeout): the job runs to its end, with no hang; its steps and losses are read as in
    the test above (float32, no scaler)."""
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    (tmp_path / "out").mkdir()
    disk = SlowDisk(tmp_path / "out" / "ckpt.pt")
    accum, max_iters = 4, 14
    job, trace_path = gpt_job(local_job, tmp_path, f"--gradient_accumulation_steps={accum}",
                              f"--max_iters={max_iters}", f"--lr_decay_iters={max_iters}", "--eval_interval=10",
                              "--eval_iters=30", "--eval_sleep=0.12")
    try:
        job.fab("deploy", "start-trainers", check=True)
        watch = job.fab("watch", "--timeout", "150", timeout=180)
    finally:
        disk.close()
    trace = read_trace(trace_path) if trace_path.exists() else []
    events = job.events("n0")
    said = (watch.stdout[-3000:], [e for e in events if e["kind"] not in ("heartbeat",)][-8:], trace[-5:])
    assert watch.returncode == 0 and "hang" not in kinds(job), said
    # It did what this test claims: an evaluation, then a save, each longer than hang_timeout.
    start = next(t["t"] for t in trace if t.get("eval_start") == 10)
    last_forward = [t["t"] for t in trace if "eval_forward" in t][-1]
    save = [(t["t"], u["t"]) for t in trace if t.get("save_start") == 10 for u in trace if u.get("save_end") == 10]
    assert last_forward - start > 1.5 * HANG_TIMEOUT, (start, last_forward)
    assert save and save[0][1] - save[0][0] > 1.5 * HANG_TIMEOUT and disk.saves, (save, disk.saves)
    log = (job.jd("n0") / "logs" / "trainer-0.log").read_text()
    printed = printed_iters(log)
    assert sorted(printed) == list(range(max_iters + 1)) and optimizer_steps(log) == max_iters + 1, log[-2000:]
    recs = step_records(read_records(job.jd("n0") / "metrics" / "trainer-0.jsonl"))
    assert recs and recs[-1]["step"] == max_iters + 1, recs[-3:]
    check_losses(recs, trace, printed, accum)
    assert wait_for(lambda: not live_marked(job.ws.values()), timeout=20), live_marked(job.ws.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stuck", ["forward", "save"])
def test_a_forward_that_never_returns_or_a_save_that_writes_nothing_is_a_hang(local_job, tmp_path, stuck):
    """nanoGPT's evaluation at iteration 10 (eval_iters forwards a split under torch.no_grad(), 0.08 s each),
    healthy for longer than hang_timeout, then stuck. forward: its 105th forward (the 45th of this evaluation,
    the 15th of its val split, 3.5 s in) spins in Python for ever (100% of a core, its stack still); save:
    after the evaluation (5 s) the checkpoint's storage never takes a byte (a FIFO nobody opens: torch.save
    blocks as it opens the file). By the program's own clock, the watchdog's `hang` comes within hang_timeout +
    0.5 s of when it got stuck (the stuck forward's start; the save's start), after it, and not before
    hang_timeout - 1 s (the save: 1.5 s, see below) after the last evaluation forward that returned; then the
    program is gone from /proc."""
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    eval_iters = 30
    (tmp_path / "out").mkdir()
    if stuck == "save":
        SlowDisk(tmp_path / "out" / "ckpt.pt", reading=False)
    stuck_eval = 2 * eval_iters + eval_iters + eval_iters // 2  # in the second evaluation's val split
    options = ["--max_iters=14", "--lr_decay_iters=14", "--eval_interval=10", f"--eval_iters={eval_iters}",
               "--eval_sleep=0.08"] + ([f"--stuck_eval={stuck_eval}"] if stuck == "forward" else [])
    job, trace_path = gpt_job(local_job, tmp_path, *options)
    job.fab("deploy", "start-trainers", check=True)
    hang = wait_for(lambda: next((e for e in job.events("n0") if e["kind"] == "hang"), None), timeout=120,
                    interval=0.2)
    trace = read_trace(trace_path)
    assert hang, (kinds(job), trace[-5:], (job.jd("n0") / "logs" / "trainer-0.log").read_text()[-2000:])
    got_stuck = next((t for t in trace if "stuck" in t or "save_start" in t), None)
    assert got_stuck, f"hung at {hang['ts']} before it was stuck, in its healthy evaluation: {hang}, {trace[-3:]}"
    # stuck: when it got stuck (the stuck forward's start; the save's start), by the program's clock; alive: its
    # last work done before (the last evaluation forward that returned).
    stuck_at, alive = trace[-1], trace[-2]
    assert (stuck_at.get("stuck"), stuck_at.get("save_start")) == ((stuck_eval, None) if stuck == "forward" else
                                                                   (None, 10)), trace[-3:]
    assert alive.get("eval_forward") == (stuck_eval - 1 if stuck == "forward" else 2 * 2 * eval_iters), trace[-3:]
    late, early = hang["ts"] - stuck_at["t"], hang["ts"] - alive["t"]
    busy = [r for r in read_records(job.jd("n0") / "metrics" / "trainer-0.jsonl") if r.get("between_steps")]
    print(f"{stuck}: hang {late:.3f} s after it got stuck, {early:.3f} s after its last forward returned; the last "
          f"work the hook saw {hang['ts'] - busy[-1]['busy_at']:.3f} s before; {hang['reason']}" if busy else "")
    # Not before it got stuck (the healthy evaluation is no hang), and no more than `slack` early on its last work:
    # the hook sees a forward's end at its next look (0.1 s) and writes what it saw each second; torch.save holds
    # the GIL while it opens its file (torch._C.PyTorchFileWriter), so a save blocked there freezes the hook's
    # writer thread, and its last record can be a second older than the last forward.
    slack = 1.0 if stuck == "forward" else 1.5
    assert 0 < late <= HANG_TIMEOUT + 0.5 and early >= HANG_TIMEOUT - slack, (late, early, hang, trace[-2:], busy[-2:])
    # Steps before it were read: nanoGPT's 10 iterations before the evaluation.
    recs = step_records(read_records(job.jd("n0") / "metrics" / "trainer-0.jsonl"))
    assert recs and recs[-1]["step"] == 10, recs[-3:]
    pid = job.program("n0", "trainer-0")
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10), open(f"/proc/{pid}/status").read()
    assert wait_for(lambda: not live_marked(job.ws.values()), timeout=20), live_marked(job.ws.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["spin", "block"])
def test_an_exit_that_computes_past_hang_timeout_finishes_and_one_that_waits_for_ever_is_a_hang(local_job, tmp_path,
                                                                                               how):
    """After its last step the program's own atexit handler runs (tests/programs/slow_exit.py). spin: it computes
    for 3 x hang_timeout, as a teardown or an upload on a busy machine does: the job finishes, no hang. block: it
    waits (no CPU, no output) for 2 minutes, as an exit stuck on a lock does: the rank is hung, the reason says it
    was exiting, and nothing of the job is left."""
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    seconds = 3 * HANG_TIMEOUT if how == "spin" else 120
    job = watched_job(local_job, f"python tests/programs/slow_exit.py 20 {how} {seconds}", HANG_TIMEOUT, **ONE_THREAD)
    job.fab("deploy", "start-trainers", check=True)
    watch = job.fab("watch", "--timeout", "150", timeout=180)
    said = (watch.stdout[-2000:], [e for e in job.events("n0") if e["kind"] != "heartbeat"][-6:])
    log = (job.jd("n0") / "logs" / "trainer-0.log").read_text()
    assert "trained 20 steps" in log and f"finishing: {how}" in log, log[-1500:]
    if how == "spin":
        assert watch.returncode == 0 and "hang" not in kinds(job) and "finished" in kinds(job), said
    else:
        assert watch.returncode != 0, said
        (hang,) = [e for e in job.events("n0") if e["kind"] == "hang"]
        assert "since it was last seen exiting after step 20" in hang["reason"], hang
    assert wait_for(lambda: not live_marked(job.ws.values()), timeout=20), live_marked(job.ws.values())
