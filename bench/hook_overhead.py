"""The progress hook's cost: a small DDP job's throughput with the hook on against off, in one run.

    .venv/bin/python bench/hook_overhead.py [--repeats 4] [--steps 300]   # a few minutes on 2 CPU cores
    python3 bench/hook_overhead.py --device cuda [--width 256] [--batch 16]   # on a GPU machine

Each job is `torchrun` of an unchanged DDP training script (a DataLoader, an
MLP, SGD): on the CPU 2 ranks, gloo, one torch thread a rank; with `--device
cuda` a rank per GPU, NCCL, the data on the GPU from the start and torch's
sync debug mode set to "error" in the timed steps (a wait for the device in
the hook fails the hook, and the bench says so). Each is started as the
launcher starts a job's programs: `PYTHONPATH` led by a hook folder holding the
launcher's sitecustomize.py and the progress hook's files as node ops writes
them. "on" has `FABTRAIN_METRICS` set (each rank appends its records there);
"off" the same with `FABTRAIN_INSTRUMENT=0` (job.watchdog.instrument: false).
The jobs go on, off, off, on, on, off, off, on... so load from other work, and
a machine that warms up or slows down, falls on both alike. A job's throughput is rank 0's steps a second over the steps after a
warm-up, timed by the script itself (its wall clock between two steps that
DDP keeps in step across ranks). Every loss that rank 0's records show must
be one rank 0 computed. Prints every job's figure, the medians and their
ratio (on / off; the target is >= 0.99, docs/progress.md).
"""
import os
import sys

# Import from the repository root, not from bench/.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from fabtrain.node import launch, progress  # noqa: E402
from workload.ddp import free_port  # noqa: E402

REPO = Path(sys.path[0])
WARMUP = 30
SCRIPT = '''
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

steps, warmup, width, layers, batch = (int(a) for a in sys.argv[1:6])
device, sync_debug = sys.argv[6], sys.argv[7]
cuda = device == "cuda"
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.manual_seed(0)
# On a GPU the data is there from the start: the loop then has no host-device copy, and any wait
# for the device inside it is the hook's (torch's sync debug mode raises on one, below).
x = torch.randn(batch * dist.get_world_size() * (steps + 1), 128, device=device)
data = TensorDataset(x, x.sum(1, keepdim=True))
loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False))
hidden = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
model = torch.nn.Sequential(torch.nn.Linear(128, width), torch.nn.ReLU(), *hidden, torch.nn.Linear(width, 1))
model = model.to(device)
model = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
t0 = c0 = None
losses = []
for i, (source, target) in enumerate(loader):
    if i == warmup:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(sync_debug)
        t0, c0 = time.perf_counter(), time.process_time()
    loss = torch.nn.functional.mse_loss(model(source), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.detach())
    if i + 1 == steps:
        break
if cuda:
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
if dist.get_rank() == 0:
    print(json.dumps({"steps_per_s": (steps - warmup) / elapsed, "cpu_per_step": cpu / (steps - warmup),
                      "losses": torch.stack(losses).tolist()}), flush=True)
dist.destroy_process_group()
'''

def hook_folder(root: Path) -> Path:
    """The launcher's sitecustomize.py and the hook's files, as a started job has them."""
    hook = Path(launch.hook_dir(str(root)))
    hook.mkdir(parents=True)
    (hook / "sitecustomize.py").write_text(launch.STACK_HOOK)
    for name, text in progress.sources().items():
        (hook / name).write_text(text)
    return hook


def job(root: Path, hook: Path, on: bool, n: int, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABTRAIN_", "PYTHON", "RANK", "LOCAL_RANK"))}
    env.update(PYTHONPATH=str(hook), OMP_NUM_THREADS="1", FABTRAIN_METRICS=str(root / f"metrics-{n}.jsonl"),
               FABTRAIN_RANK="0")
    if not on:
        env["FABTRAIN_INSTRUMENT"] = "0"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out = subprocess.run([torchrun, "--nproc-per-node", str(args.ranks), "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), str(root / "train.py"), str(args.steps), str(WARMUP),
                          str(args.width), str(args.layers), str(args.batch), args.device, args.sync_debug],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    # A job whose ranks abort at their exit, after the figures (torch's race, pytorch/pytorch#190489: a gloo
    # worker's last reference dropped while the interpreter finalizes) is counted, not hidden; the hook's exit
    # wait mitigates it, so the hook-off jobs are the ones it happens to.
    printed = out.stdout.strip().splitlines()
    aborted = out.returncode != 0 and "terminate called without an active exception" in out.stderr \
        and bool(printed) and printed[-1].startswith("{")
    if out.returncode != 0 and not aborted:
        raise SystemExit(f"bench: a job exited {out.returncode}: {out.stderr[-2000:]}")
    if "fabtrain progress:" in out.stderr:  # the hook failed (a wait for the device under sync debug mode)
        raise SystemExit(f"bench: the hook failed in a job: {out.stderr[-2000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    written = root / f"metrics-{n}.jsonl"
    records = [json.loads(line) for line in written.read_text().splitlines()] if written.exists() else []
    if on and not records or not on and records:
        raise SystemExit(f"bench: the hook was {'on' if on else 'off'} yet {len(records)} records were written")
    # Every loss a record of rank 0 shows is one that rank 0 computed (on a GPU, read a record late).
    shown = [r["loss"] for r in records if r.get("rank") in (0, "0") and "loss" in r]
    wrong = [v for v in shown if v not in figures["losses"]]
    if on and (not shown or wrong):
        raise SystemExit(f"bench: rank 0's records show {len(shown)} losses, {len(wrong)} of them none it computed")
    figures["losses_shown"], figures["aborted"] = len(shown), aborted
    return figures


def bookkeeping(steps: int = 20000) -> float:
    """The hook's own CPU seconds a step, at most: what its wrappers tell the reporter for one step (a batch, a
    forward, a backward, an optimizer step), in a loop, records written as in a job. (The wrappers are in place
    for the sampled steps only, one a record; the others cost the optimizer post-hook's count.)"""
    import time
    import torch
    with tempfile.TemporaryDirectory(prefix="hook-bench-") as tmp:
        r = progress.Reporter({progress.ENV_METRICS: str(Path(tmp) / "m.jsonl"), "RANK": "0"})
        batch, loss = (torch.zeros(16, 128), torch.zeros(16, 1)), torch.zeros(())
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        c0 = time.process_time()
        for _ in range(steps):
            t = r.perf()
            r.batch(r.perf() - t, t, len(batch[0]))
            t = r.perf()
            r.add(progress.FORWARD, r.perf() - t, t)
            t = r.perf()
            r.backward(loss, r.perf() - t, t)
            t = r.perf()
            r.add(progress.OPTIMIZER, r.perf() - t, t)
            r.step(opt)
        r.on = False  # its writer thread ends
        return (time.process_time() - c0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4, help="jobs with the hook on, and as many off")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: NCCL, a rank per GPU, torch's sync debug mode on in the timed steps")
    ap.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    ap.add_argument("--layers", type=int, default=0, help="hidden width x width layers")
    ap.add_argument("--batch", type=int, default=16, help="samples a rank a step")
    ap.add_argument("--sync-debug", choices=("error", "warn", "default"), default="error",
                    help="torch.cuda.set_sync_debug_mode in the timed steps (cuda only)")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch
        args.ranks = torch.cuda.device_count()
        if not args.ranks:
            raise SystemExit("bench: --device cuda, but torch sees no GPU")
        print(f"GPUs: {args.ranks} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    else:
        args.ranks = 2
    with tempfile.TemporaryDirectory(prefix="hook-bench-") as tmp:
        root = Path(tmp)
        (root / "train.py").write_text(SCRIPT)
        hook = hook_folder(root / "job")
        runs = {True: [], False: []}
        for n in range(2 * args.repeats):
            on = n % 4 in (0, 3)  # on, off, off, on, ...: a drift in the machine falls on both alike
            runs[on].append(job(root, hook, on, n, args))
            print(f"job {n + 1}: hook {'on ' if on else 'off'} {runs[on][-1]['steps_per_s']:8.1f} steps/s, "
                  f"rank 0 CPU {runs[on][-1]['cpu_per_step'] * 1e3:.3f} ms a step"
                  + (f", {runs[on][-1]['losses_shown']} losses in its records, each one it computed" if on else "")
                  + (", then aborted at exit (exit 134)" if runs[on][-1]["aborted"] else ""), flush=True)
    on, off = (statistics.median(r["steps_per_s"] for r in runs[k]) for k in (True, False))
    cpu_on, cpu_off = (statistics.median(r["cpu_per_step"] for r in runs[k]) for k in (True, False))
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(f"median steps/s over {args.repeats} jobs each ({args.steps - WARMUP} steps timed a job, torchrun, "
          f"{args.ranks} rank{'s' if args.ranks > 1 else ''}, {backend}, width {args.width}, {args.layers} hidden layers, batch {args.batch}): "
          f"hook on {on:.1f}, hook off {off:.1f}")
    print(f"ratio on/off: {on / off:.3f} (target >= 0.99)")
    print("jobs aborted at exit after their figures (torch's race at exit): hook on %d of %d, off %d of %d"
          % (sum(r["aborted"] for r in runs[True]), len(runs[True]), sum(r["aborted"] for r in runs[False]),
             len(runs[False])))
    print(f"rank 0 CPU a step, median: hook on {cpu_on * 1e3:.3f} ms, off {cpu_off * 1e3:.3f} ms: "
          f"ratio off/on {cpu_off / cpu_on:.3f}")
    own = bookkeeping()
    print(f"the hook's own bookkeeping: {own * 1e6:.1f} us of CPU a step = {own / cpu_off:.4f} of a step here "
          f"(throughput ratio it allows: {1 / (1 + own / cpu_off):.4f})")


if __name__ == "__main__":
    main()
