"""Parameter-server SGD against DDP, on this machine, with the same number of trainers, in one run.

    .venv/bin/python bench/train.py            # about 2-3 minutes on 2 CPU cores

(a) word2vec with a 50,000-word vocabulary: PS sync, PS async, DDP as most
    users run it (dense embedding gradients: both 50,000-row tables are
    all-reduced every step) and DDP with nn.Embedding(sparse=True);
(b) the dense MLP: PS sync, PS async, DDP;
(c) the PS protocol's payload bandwidth (a dense block pushed and pulled
    through a real pserver) against raw gloo send/recv of the same bytes.

Every job is the real programs (python -m workload.pserver / trainer / ddp)
on 127.0.0.1, one torch thread each. samples/s is the sum over the trainers
of each one's median step rate after a warm-up, read from its metrics file.
Prints each figure and the ratios against the targets of docs/workload.md.
"""
import os
import sys

# Import from the repository root, not from bench/: a module there named like a stdlib one would
# shadow the standard library's for every import that follows.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(sys.path[0])

from workload.ddp import free_port  # noqa: E402
from workload.metrics import read_metrics  # noqa: E402
from workload.sample import write_sample_corpus  # noqa: E402

TRAINERS = 2
ENV_PREFIXES = ("PADDLE_", "FABTRAIN_", "OMPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def base_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIXES)}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra.items()})
    return env


def run_all(procs, timeout=240):
    for name, proc in procs.items():
        code = proc.wait(timeout)
        if code != 0:
            raise SystemExit(f"bench: {name} exited {code}")


def throughput(metrics_files, warmup):
    """Samples/s summed over the trainers: each trainer's median over its steps after `warmup`.

    Every step is a metrics record (--log_every 1) whose samples_per_s is that step's rate. The
    median, not the mean, because other work on this machine stalls a few steps at random.
    """
    total = 0.0
    for path in metrics_files:
        rates = sorted(r["samples_per_s"] for r in read_metrics(path)
                       if "eval_loss" not in r and "evaluated" not in r and r["step"] > warmup)
        total += rates[len(rates) // 2]
    return total


def ps_job(workdir, data, flags, sgd, batch_size, warmup):
    port, procs = free_port(), {}
    env = base_env(PADDLE_INIT_PORT=port, PADDLE_INIT_PSERVERS="127.0.0.1", FABTRAIN_SGD=sgd,
                   PADDLE_INIT_NUM_GRADIENT_SERVERS=TRAINERS, PADDLE_INIT_PORTS_NUM_FOR_SPARSE=1)
    log = open(workdir / f"ps-{sgd}.log", "a")
    procs["pserver"] = subprocess.Popen([sys.executable, "-m", "workload.pserver"], cwd=REPO, env=env,
                                        stdout=log, stderr=log)
    files = []
    for t in range(TRAINERS):
        files.append(workdir / f"ps-{sgd}-{t}-{time.monotonic_ns()}.jsonl")
        procs[f"trainer {t}"] = subprocess.Popen(
            [sys.executable, "-m", "workload.trainer", "--data", str(data), "--trainer_id", str(t), *flags,
             "--batch_size", str(batch_size), "--metrics", str(files[-1]), "--log_every", "1"],
            cwd=REPO, env=env, stdout=log, stderr=log)
    run_all(procs)
    return throughput(files, warmup)


def ddp_job(workdir, data, flags, batch_size, warmup):
    port, procs, files = free_port(), {}, []
    log = open(workdir / "ddp.log", "a")
    for rank in range(TRAINERS):
        files.append(workdir / f"ddp-{rank}-{time.monotonic_ns()}.jsonl")
        env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, WORLD_SIZE=TRAINERS, LOCAL_RANK=rank)
        procs[f"rank {rank}"] = subprocess.Popen(
            [sys.executable, "-m", "workload.ddp", "--data", str(data), *flags, "--batch_size", str(batch_size),
             "--metrics", str(files[-1]), "--log_every", "1"], cwd=REPO, env=env, stdout=log, stderr=log)
    run_all(procs)
    return throughput(files, warmup)


# -- (c) bandwidth: two helper processes, started as `bench/train.py --role ...` -----------------

def raw_gloo(rank, port, numel, iterations):
    """Rank 0 sends `numel` floats, rank 1 sends them back: the bytes of one PS push + pull."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    buf, times = torch.ones(numel), []
    for _ in range(iterations + 3):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(2 * 4 * numel / median(times[3:]))
    dist.destroy_process_group()


def median(values):
    """The median round trip: the other engineers' jobs on this machine make single ones noisy."""
    return sorted(values)[len(values) // 2]


def ps_client(port, numel, iterations):
    """A trainer without a model: push a dense gradient of `numel` floats, pull the values back."""
    import torch
    from workload.ps_client import PServerClient
    from workload.ps_protocol import Layout
    from workload.rendezvous import join_job
    layout = Layout(1, 1, numel)
    join_job("127.0.0.1", port, 1, 2, str, 60, 60)
    client = PServerClient(0, ["127.0.0.1"], layout, 60)
    client.send_config({"layout": layout.to_json(), "optimizer": {"name": "sgd", "lr": 0.0}, "sgd": "sync",
                        "num_pservers": 1, "num_trainers": 1, "ports_num": 1, "ports_num_for_sparse": 1,
                        "model": "none"}, torch.zeros(numel))
    client.hello()
    grad, values, times = torch.ones(numel), torch.empty(numel), []
    for i in range(iterations + 3):
        start = time.perf_counter()
        client.step(i, grad, [], [], values)
        times.append(time.perf_counter() - start)
    print(2 * 4 * numel / median(times[3:]))
    client.done()


def bandwidth(numel, iterations, rounds=2):
    """(PS bytes/s, raw gloo bytes/s): the best of `rounds` alternating runs of each."""
    me = [sys.executable, str(Path(__file__).resolve())]
    sizes = ["--numel", str(numel), "--iterations", str(iterations)]
    ps, raw = [], []
    for _ in range(rounds):
        port = free_port()
        pair = [subprocess.Popen([*me, "--role", "raw", "--rank", str(r), "--port", str(port), *sizes],
                                 env=base_env(), stdout=subprocess.PIPE, text=True) for r in range(2)]
        raw.append(float(pair[0].communicate(timeout=120)[0]))
        pair[1].wait(60)
        port = free_port()
        env = base_env(PADDLE_INIT_PORT=port, PADDLE_INIT_PSERVERS="127.0.0.1", PADDLE_INIT_NUM_GRADIENT_SERVERS=1)
        server = subprocess.Popen([sys.executable, "-m", "workload.pserver"], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL)
        client = subprocess.run([*me, "--role", "ps-client", "--port", str(port), *sizes], env=env,
                                capture_output=True, text=True, timeout=120)
        if client.returncode != 0:
            raise SystemExit(f"bench: ps client failed:\n{client.stderr[-2000:]}")
        server.wait(60)
        ps.append(float(client.stdout.split()[-1]))
    return max(ps), max(raw)


def main():
    p = argparse.ArgumentParser(description="PS vs DDP benchmark (see the module docstring)")
    p.add_argument("--vocab", type=int, default=50_000)
    p.add_argument("--only", choices=["word2vec", "mlp", "bandwidth"], help="run one part")
    p.add_argument("--role", choices=["raw", "ps-client"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, default=4 << 20, help=argparse.SUPPRESS)
    p.add_argument("--iterations", type=int, default=10, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "raw":
        return raw_gloo(a.rank, a.port, a.numel, a.iterations)
    if a.role == "ps-client":
        return ps_client(a.port, a.numel, a.iterations)

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fabtrain-bench-"))
    w2v_data, mlp_data = work / "w2v", work / "mlp"
    write_sample_corpus(w2v_data, vocab=a.vocab, train_shards=TRAINERS, test_shards=TRAINERS, sentences=400,
                        test_sentences=2, min_len=10, max_len=30, bad_bytes=False)
    write_sample_corpus(mlp_data, vocab=2000, train_shards=TRAINERS, test_shards=TRAINERS, sentences=3000,
                        test_sentences=2, bad_bytes=False)
    common = ["--trainer_count", "1"]
    w2v = [*common, "--model", "word2vec", "--steps", "80", "--emb_dim", "64"]
    mlp = [*common, "--model", "mlp", "--steps", "30", "--mlp_features", "1024", "--hidden", "1024"]
    w2v_batch, mlp_batch = 256, 128

    print(f"== {TRAINERS} trainers on {os.cpu_count()} CPU core(s); word2vec vocabulary {a.vocab}, "
          f"emb_dim 64, batch {w2v_batch}; mlp 1024-1024-1024-8, batch {mlp_batch}", flush=True)
    results = {}
    jobs = [
        ("word2vec PS sync", lambda: ps_job(work, w2v_data, w2v, "sync", w2v_batch, 10)),
        ("word2vec PS async", lambda: ps_job(work, w2v_data, w2v, "async", w2v_batch, 10)),
        ("word2vec DDP dense", lambda: ddp_job(work, w2v_data, w2v, w2v_batch, 10)),
        ("word2vec DDP sparse", lambda: ddp_job(work, w2v_data, [*w2v, "--sparse_embedding"], w2v_batch, 10)),
        ("mlp PS sync", lambda: ps_job(work, mlp_data, mlp, "sync", mlp_batch, 5)),
        ("mlp PS async", lambda: ps_job(work, mlp_data, mlp, "async", mlp_batch, 5)),
        ("mlp DDP", lambda: ddp_job(work, mlp_data, mlp, mlp_batch, 5)),
    ]
    for name, run in jobs:
        if a.only in (None, name.split()[0]):
            results[name] = run()
            print(f"{name:22s} {results[name]:10.0f} samples/s", flush=True)
    if a.only in (None, "bandwidth"):
        results["PS"], results["raw"] = bandwidth(4 << 20, 15)
        print(f"{'PS push+pull 16 MiB':22s} {results['PS'] / 1e6:10.0f} MB/s", flush=True)
        print(f"{'raw gloo send+recv':22s} {results['raw'] / 1e6:10.0f} MB/s", flush=True)

    print("== ratios (target)")
    for label, top, bottom, target in [
        ("word2vec PS sync / DDP dense", "word2vec PS sync", "word2vec DDP dense", 2.0),
        ("word2vec PS sync / DDP sparse", "word2vec PS sync", "word2vec DDP sparse", 0.8),
        ("mlp PS sync / DDP", "mlp PS sync", "mlp DDP", 0.67),
        ("PS payload / raw gloo bandwidth", "PS", "raw", 0.5),
        ("word2vec PS async / PS sync", "word2vec PS async", "word2vec PS sync", None),
        ("mlp PS async / PS sync", "mlp PS async", "mlp PS sync", None),
    ]:
        if top in results and bottom in results:
            ratio = results[top] / results[bottom]
            verdict = "" if target is None else (f">= {target}  ok" if ratio >= target else f">= {target}  MISSED")
            print(f"{label:34s} {ratio:6.2f}   {verdict}")
    print(f"== {time.monotonic() - started:.0f} s; logs in {work}")


if __name__ == "__main__":
    main()
