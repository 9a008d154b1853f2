"""The progress hook's whole cost a step, in CPU time: one process, the smallest step, hook on against off.

    .venv/bin/python bench/hook_cost.py [--blocks 400] [--steps 50]   # about a minute on 2 CPU cores

bench/hook_overhead.py measures what the issue asks (a small DDP job's
throughput with the hook on against off), but on this 2-core machine jobs of
one kind spread by a fifth from one to the next, and so do separate
processes' CPU times for the same loop: far more than the 1 % it must
resolve. This bench measures the cost itself, inside one process, where
nothing but the hook changes: the loop runs in blocks of --steps steps, the
hook put in for one block and taken out for the next (its count of optimizer steps,
which counts every step and puts its timing patches in for a sampled step,
emptied; a sample under way dropped; its clock to the next record paused while it is out, so that the blocks
with the hook in sample once each INTERVAL of their own time, as a job does, not once at each block's start),
on, off, off, on, ...; each block's CPU time is the loop thread's
(`time.thread_time`: gloo's threads and other processes' load left out).
Those blocks move by hundreds of us with the machine's other load, more than
the hook costs; so the cost is also taken apart and each part timed alone,
many times, alternating with its baseline: the count on a
step not sampled (in the loop itself, the hook in and out step by step: the
loop evicts the hook from the caches between two steps, which an optimizer
that steps nothing, also timed, does not; beside it the same estimator where
nothing differs, a second empty method against torch's, says how far it
reads from zero on this run); once a
record, a sampled step and the record written (a record forced due before
every step, against none); the writer thread's own CPU over the blocks. The
amortised cost is the first, plus the second over the steps a record (this
run's step), plus the third a step.
The loop: DDP over gloo with a world of one, so every patch of the hook runs
(the DataLoader's batches, DDP's forward, backward with its end-of-compute
callback, the optimizer's step hooks, records written as in a job), on the
smallest model (one linear layer, batch 16): the step is as short as a step
gets, so the hook's share of it is the largest.

Prints each block's figure, the medians, the hook's cost a step (the median
of on minus off over neighbouring pairs of blocks), and the throughput ratio
that cost allows on this run's own step (hook off), never on a fixed one.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.hook_overhead import hook_folder  # noqa: E402
from workload.ddp import free_port  # noqa: E402

WARMUP = 200
SCRIPT = '''
import json, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import optimizer as optim_mod
from torch.utils.data import DataLoader, TensorDataset, dataloader

blocks, steps, warmup = (int(a) for a in sys.argv[1:4])
SAMPLED_PAIRS, SAMPLED_RUN = 60, 20
SAMPLED_STEPS = SAMPLED_PAIRS * 2 * SAMPLED_RUN  # the steps of (b) below
IN_LOOP_STEPS = 24000  # the steps of (a') below
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
x = torch.randn(16 * (blocks * steps + warmup + SAMPLED_STEPS + IN_LOOP_STEPS + 1), 128)
batches = iter(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16))
model = DDP(torch.nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)

# The hook as the launcher put it in when the program imported torch: its count of every step takes the place of
# Optimizer._optimizer_step_code, torch's empty method called after each step; its timing patches are in place
# for one sampled step a record only (Reporter.patch).
reporter = getattr(sys.modules.get("_fabtrain_progress"), "REPORTER", None)
count = optim_mod.Optimizer.__dict__.get("_optimizer_step_code")
if reporter is None or reporter.patch is None or getattr(count, "__module__", "") != "_fabtrain_progress_frameworks":
    sys.exit("no hook in this program: its reporter or its count of optimizer steps was not found")


def empty(self):  # torch's own Optimizer._optimizer_step_code: the hook out
    """Entry point for `torch.profile.profiler`."""


left = [None]  # how long the next record was still off when the hook was taken out (the hook's clock paused)


def hook(on):
    optim_mod.Optimizer._optimizer_step_code = count if on else empty  # set either way: the class changes alike
    if on:
        if left[0] is not None:  # the record's time goes on from where it was: a record each INTERVAL of on-time,
            reporter.due, left[0] = reporter.perf() + left[0], None  # as in a job, not one at each on-block's start
    else:  # a sample under way is dropped, its patches taken out
        if left[0] is None:
            left[0] = reporter.due - reporter.perf()
        reporter.sampling = False
        reporter.patch(False)


def run(n):
    for _ in range(n):
        source, target = next(batches)
        loss = torch.nn.functional.mse_loss(model(source), target)
        opt.zero_grad()
        loss.backward()
        opt.step()


def thread_cpu(thread):
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) if thread is not None else 0.0


run(warmup)
writer = reporter.thread  # the hook's writer thread: its CPU is the hook's too, on another core
figures, w0, n0 = [], thread_cpu(writer), reporter.steps
for b in range(blocks):
    on = b % 4 in (0, 3)  # on, off, off, on: a drift falls on both alike
    hook(on)
    c0 = time.thread_time()
    run(steps)
    figures.append([on, (time.thread_time() - c0) / steps])
hook(True)
writer_cpu, run_steps = thread_cpu(writer) - w0, blocks * steps


# The cost taken apart, each part timed alone many times, alternating with its baseline: the blocks above move by
# hundreds of us with the machine's other load, the parts by far less.
def alternate(pairs, n, part, base):
    """Median over `pairs` of (part - base), each timed over n calls, in the order part, base, base, part, ..."""
    diffs = []
    for p in range(pairs):
        t = {}
        for which in ((part, base) if p % 2 == 0 else (base, part)):
            c0 = time.thread_time()
            which(n)
            t[which] = (time.thread_time() - c0) / n
        diffs.append(t[part] - t[base])
    diffs.sort()
    return diffs[len(diffs) // 2]


# (a) Every step: the count on a step not sampled. An optimizer whose one parameter has no
# gradient steps in a few us, all of it torch's step wrappers: timed with the hook in and out.
idle = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
inf = float("inf")


def idle_steps(on):
    def go(n):
        hook(on)
        reporter.due = inf
        for _ in range(n):
            idle.step()
    return go


counted = reporter.steps
every_step = alternate(100, 2000, idle_steps(True), idle_steps(False))


# (a') The same in the training loop itself, step by step, no record due (no step sampled): between two of its
# steps the loop evicts what the count touches from the caches, which the idle optimizer above keeps warm. Three
# arms in a balanced cycle: the count, torch's empty method, and a second empty method (`control`): control - empty
# is what the estimator reads where nothing differs, its noise. A step's time moves by tens of us with the
# machine, so the estimate is the 20 % trimmed mean of the differences within each cycle.
def empty_too(self):  # the control: an empty method like torch's, another function
    """Entry point for `torch.profile.profiler`."""


def in_loop(steps):
    arms = (count, empty, empty_too, empty_too, empty, count)
    times = {f: [] for f in arms}
    for i in range(steps - steps % len(arms)):
        hook(False)
        arm = arms[i % len(arms)]
        optim_mod.Optimizer._optimizer_step_code = arm
        reporter.due = inf
        c0 = time.thread_time()
        run(1)
        times[arm].append(time.thread_time() - c0)
    hook(True)

    def trimmed(a, b):
        diffs = sorted(x - y for x, y in zip(times[a], times[b]))
        cut = len(diffs) // 5
        kept = diffs[cut:len(diffs) - cut]
        return sum(kept) / len(kept)
    return trimmed(count, empty), trimmed(empty_too, empty)


every_step_in_loop, in_loop_control = in_loop(IN_LOOP_STEPS)
reporter.steps = counted


# (b) Once a record (each INTERVAL): a sampled step (its patches put in, the step timed, the patches out) and the
# record written. Forcing a record due before every step samples every other step and writes a record after it.
def sampled(force):
    def go(n):
        hook(True)
        for _ in range(n):
            reporter.due = 0.0 if force else inf
            if force:  # as the writer thread says a record is due: the next step is looked at
                reporter.look_at = 0
            run(1)
    return go


per_cycle = 2 * alternate(SAMPLED_PAIRS, SAMPLED_RUN, sampled(True), sampled(False))
reporter.due, reporter.look_at = 0.0, 0
print(json.dumps({"blocks": figures, "steps": reporter.steps, "every_step": every_step,
                  "every_step_in_loop": every_step_in_loop, "in_loop_control": in_loop_control,
                  "per_record": per_cycle,
                  "writer_cpu": writer_cpu, "run_steps": run_steps,
                  "interval": sys.modules["_fabtrain_progress"].INTERVAL}), flush=True)
dist.destroy_process_group()
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=400, help="blocks of steps, half with the hook's patches in")
    ap.add_argument("--steps", type=int, default=50, help="steps a block")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hook-cost-") as tmp:
        root = Path(tmp)
        (root / "loop.py").write_text(SCRIPT)
        hook = hook_folder(root / "job")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FABTRAIN_", "PYTHON", "RANK", "LOCAL_RANK"))}
        env.update(PYTHONPATH=str(hook), OMP_NUM_THREADS="1", FABTRAIN_METRICS=str(root / "metrics.jsonl"),
                   FABTRAIN_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        out = subprocess.run([sys.executable, str(root / "loop.py"), str(args.blocks), str(args.steps), str(WARMUP)],
                             cwd=root, env=env, capture_output=True, text=True, timeout=1200)
        if out.returncode != 0 or "fabtrain progress:" in out.stderr:
            raise SystemExit(f"bench: the loop exited {out.returncode}: {out.stderr[-2000:]}")
        records = (root / "metrics.jsonl").read_text().splitlines() if (root / "metrics.jsonl").exists() else []
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"the hook's count of optimizer steps taken out and put back (its timing patches are in for sampled steps "
          f"only); {result['steps']} steps counted, {len(records)} records written")
    blocks = result["blocks"]
    for n, (on, cpu) in enumerate(blocks):
        print(f"block {n + 1}: hook {'on ' if on else 'off'} {cpu * 1e6:7.1f} us of CPU a step")
    on = [cpu for o, cpu in blocks if o]
    off = [cpu for o, cpu in blocks if not o]
    pairs = [(a[1] - b[1]) if a[0] else (b[1] - a[1]) for a, b in zip(blocks[::2], blocks[1::2])]
    cost, step = statistics.median(pairs), statistics.median(off)
    # The fastest blocks of each kind: what another process's load, an interrupt or the machine's neighbours
    # add to a block only ever adds, so their difference is the least touched by it.
    fast = [(sorted(on)[int(p * (len(on) - 1))] - sorted(off)[int(p * (len(off) - 1))]) * 1e6 for p in (0.05, 0.1, 0.25)]
    print(f"median CPU a step over {len(on)} blocks each ({args.steps} steps a block; DDP over gloo, a world of "
          f"one, Linear(128, 1), batch 16): hook on {statistics.median(on) * 1e6:.1f} us, off {step * 1e6:.1f} us")
    print(f"the hook's cost a step (median of on - off over {len(pairs)} neighbouring pairs of blocks): "
          f"{cost * 1e6:.1f} us (pairs from {min(pairs) * 1e6:.1f} to {max(pairs) * 1e6:.1f})")
    print(f"the same from the fastest blocks of each kind (5th, 10th, 25th percentile, on - off): "
          f"{fast[0]:.1f}, {fast[1]:.1f}, {fast[2]:.1f} us")
    print(f"throughput ratio it allows on this run's own step of {step * 1e6:.0f} us (hook off): "
          f"{1 / (1 + cost / step):.4f} (target >= 0.99, and a cost <= 2 us a step)")
    se = statistics.stdev(pairs) / len(pairs) ** 0.5
    print(f"the blocks' mean of on - off: {statistics.mean(pairs) * 1e6:.1f} us +- {2 * se * 1e6:.1f} (twice its "
          f"standard error): the blocks cannot resolve a cost smaller than that")
    interval, idle, a, b = result["interval"], result["every_step"], result["every_step_in_loop"], result["per_record"]
    per_interval = interval / step  # steps a record, at this run's step
    w = result["writer_cpu"] / result["run_steps"]
    total = a + b / per_interval + w
    print(f"the cost taken apart (each part timed alone, against its baseline, alternating):")
    print(f"  every step, the count (a step not sampled), in the loop itself: {a * 1e6:.2f} us "
          f"(on an optimizer that steps nothing, its caches warm: {idle * 1e6:.2f} us); the same estimator where "
          f"nothing differs (a second empty method against torch's): {result['in_loop_control'] * 1e6:.2f} us")
    print(f"  once a record ({interval} s: 1 step in {per_interval:.0f} at this run's step), a sampled step and "
          f"the record written: {b * 1e6:.1f} us, {b / per_interval * 1e6:.2f} us a step")
    print(f"  the writer thread (another core), its CPU over the blocks' {result['run_steps']} steps: "
          f"{result['writer_cpu'] * 1e3:.1f} ms, {w * 1e6:.2f} us a step")
    print(f"  amortised: {total * 1e6:.2f} us a step; throughput ratio on this run's own step of {step * 1e6:.0f} us: "
          f"{1 / (1 + total / step):.4f} (target: <= 2 us a step, >= 0.99)")


if __name__ == "__main__":
    main()
