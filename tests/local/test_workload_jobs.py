"""The reference workload as real processes on 127.0.0.1: pservers and trainers, DDP ranks, torchrun.

Each test starts a small job (a few seconds of training on a tiny corpus) and
checks what a user would: the parameters it ends with, its metrics, how it
resumes, and how it fails.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from workload import checkpoint
from workload.config import parse_ddp_args, parse_trainer_args
from workload.data import (BatchStream, collective_sources, derive_seed, list_shards, load_examples,
                           load_word_dict, shards_for, vocab_size)
from workload.metrics import read_metrics
from workload.models import build_model, optimizer_config
from workload.optim import ModuleOptimizer, make_optimizer
from workload.ddp import free_port
from workload.ps_protocol import Layout
from workload.sample import write_sample_corpus

from tests.support import REPO
ENV_PREFIXES = ("PADDLE_", "FABTRAIN_", "OMPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIXES)}
    env.update(PYTHONPATH=str(REPO), **{k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus")
    write_sample_corpus(path, vocab=150, train_shards=4, test_shards=2, sentences=30)
    return path


class Job:
    """Processes of one job, each with its own log files and metrics file under `workdir`."""

    def __init__(self, workdir):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs = {}

    def start(self, name, argv, env):
        out = open(self.workdir / f"{name}.out", "w")
        err = open(self.workdir / f"{name}.err", "w")
        self.procs[name] = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=out, stderr=err,
                                            stdin=subprocess.DEVNULL)

    def metrics_path(self, name):
        return self.workdir / f"{name}.jsonl"

    def metrics(self, name):
        path = self.metrics_path(name)
        return read_metrics(path) if path.exists() else []

    def stderr(self, name):
        return (self.workdir / f"{name}.err").read_text()

    def wait(self, timeout=90, names=None):
        """{name: exit code, or None if still running after `timeout` s}."""
        deadline = time.monotonic() + timeout
        codes = {}
        for name, proc in self.procs.items():
            if names and name not in names:
                continue
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def wait_for_step(self, name, step, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r.get("step", 0) >= step for r in self.metrics(name)):
                return
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{name} did not reach step {step}:\n{self.stderr(name)}")

    def signal(self, name, sig):
        self.procs[name].send_signal(sig)

    def kill_all(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def jobs(tmp_path):
    made = []

    def make(name="job"):
        made.append(Job(tmp_path / name))
        return made[-1]
    yield make
    for job in made:
        job.kill_all()


def start_ps_job(job, data, pservers=1, trainers=2, sgd="sync", host="127.0.0.1", port=None,
                 trainer_flags=(), pserver_flags=(), timeout=60):
    """P pservers (all on `host`, one port for the job) and T trainers, configured through the
    environment as fabtrain does; flags add to it."""
    env = clean_env(PADDLE_INIT_PORT=port or free_port(), PADDLE_INIT_PSERVERS=",".join([host] * pservers),
                    PADDLE_INIT_NUM_GRADIENT_SERVERS=trainers, PADDLE_INIT_PORTS_NUM_FOR_SPARSE=1,
                    FABTRAIN_SGD=sgd, FABTRAIN_DATA_DIR=data, FABTRAIN_PG_TIMEOUT=timeout)
    for p in range(pservers):
        job.start(f"pserver-{p}", ["-m", "workload.pserver", *pserver_flags],
                  {**env, "FABTRAIN_RANK": str(p), "FABTRAIN_METRICS": str(job.metrics_path(f"pserver-{p}"))})
    for t in range(trainers):
        job.start(f"trainer-{t}", ["-m", "workload.trainer", *trainer_flags],
                  {**env, "PADDLE_INIT_TRAINER_ID": str(t),
                   "FABTRAIN_METRICS": str(job.metrics_path(f"trainer-{t}"))})
    return job


def is_training_record(record):
    """Not an evaluation result, nor a heartbeat written during evaluation."""
    return "eval_loss" not in record and "evaluated" not in record


def assert_all_exit(job, code=0, timeout=90):
    codes = job.wait(timeout)
    details = "\n".join(f"--- {n}: {c}\n{job.stderr(n)[-2000:]}" for n, c in codes.items() if c != code)
    assert all(c == code for c in codes.values()), details


# -- sync SGD ------------------------------------------------------------------------------

def reference_run(data, flags, trainers, steps, order="concatenated", dtype=torch.float32):
    """One process, the same optimiser, each step on the trainers' batches. Returns the model and
    trainer 0's loss at each step (the mean over its own part of the step's batches).

    order="concatenated": one batch of every trainer's rows, one mean over all of them: what sync SGD
    is meant to equal. order="per_trainer": each trainer's batch on its own, its mean gradient, then
    the average of those added up in trainer order, as ParameterShard.apply does. The two are the
    same sum, added up in a different order: equal in exact arithmetic, not bit for bit in float32."""
    args = parse_trainer_args(["--data", str(data), *flags])
    word_dict = load_word_dict(data)
    model = build_model(args, vocab_size(word_dict)).to(dtype)
    optimizer = ModuleOptimizer(make_optimizer(optimizer_config(args)), model.parameters())
    streams = [BatchStream(load_examples(model, shards_for(list_shards(data, "train"), t, trainers), word_dict),
                           args.batch_size, args.seed, t) for t in range(trainers)]
    assert all(s.per_epoch > steps for s in streams), "every batch must be full for equal averaging"
    losses = {}
    for step in range(steps):
        parts = [model.make_batch(s.rows(step), s.generator(step)) for s in streams]
        if order == "concatenated":
            batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            optimizer.zero_grad()
            per_example = model(batch)
            losses[step + 1] = per_example[:args.batch_size].mean().item()
            per_example.mean().backward()
        else:
            grads = []
            for t, part in enumerate(parts):
                optimizer.zero_grad()
                loss = model(part).mean()
                loss.backward()
                if t == 0:
                    losses[step + 1] = loss.item()
                grads.append([p.grad for p in optimizer.params])
            for param, *per_trainer in zip(optimizer.params, *grads):
                total = per_trainer[0].clone()
                for g in per_trainer[1:]:
                    total.add_(g)
                param.grad = total.div_(trainers)
        optimizer.step()
    return model, losses


def single_threaded(fn, *args, **kwargs):
    """fn with one torch thread, as the trainers and pservers compute (trainer_count 1, --num_threads 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def flat_parameters(model, tables):
    """(tables, dense) of a one-process model, the dense ones in the pservers' order."""
    return ({name: getattr(model, name).weight.detach() for name in tables},
            torch.cat([p.detach().flatten() for n, p in model.named_parameters() if not n.startswith(tuple(tables))]))


def parameters_from_pservers(ckpt_dir, pservers):
    """The whole model put back together from the pservers' final checkpoints."""
    states = [checkpoint.load(checkpoint.pserver_path(ckpt_dir, p, checkpoint.pserver_versions(ckpt_dir, p)[-1]))
              for p in range(pservers)]
    layout = Layout.from_json(states[0]["config"]["layout"])
    dense = layout.join_dense([s["dense"] for s in states], torch.empty(layout.dense_numel))
    tables = {}
    for spec in layout.tables:
        tables[spec.name] = torch.empty(spec.num_rows, spec.dim)
        for p, s in enumerate(states):
            tables[spec.name][p::pservers] = s["tables"][spec.name]
    return dense, tables, states


@pytest.mark.timeout(120)
def test_sync_sgd_equals_one_process_on_the_concatenated_batches(jobs, corpus, tmp_path):
    """Sync SGD on pservers is one process on the concatenated batches: proved in two steps,
    because a direct float32 comparison cannot be tight on every machine.

    Why not compare with the float32 one-process run directly: the mean gradient over 32 examples and
    the average of two means over 16 are the same sum added up in another order, so in float32 they
    differ by rounding (~1e-9 on a gradient). AdaGrad magnifies that where a gradient is below its eps
    (1e-6): the step lr * g / (sqrt(sum g^2) + eps) changes by up to lr / eps = 5e4 times the change in g.
    Measured on a 2-core x86-64 machine (torch 2.13.0 CPU): an `emb` element whose step-3 gradient was
    -4.06e-7 came out -4.058e-7 (concatenated) and -4.048e-7 (pservers' order), and ended 2.48e-5 apart;
    the float32 one-process run itself is up to 2.06e-5 away from the float64 one, the job 3.17e-5. Which
    elements land in that regime depends on the machine's kernels, so no float32 tolerance below ~1e-4
    holds everywhere, and one that loose would hide real bugs. Instead:

    1. tolerance 0: the pservers' parameters are, bit for bit, those of one process doing the pservers'
       arithmetic: each trainer's mean gradient, added in trainer order (the pserver sorts the round by
       trainer, whatever order the gradients arrived in), halved, the same AdaGrad. Same operations on
       the same values with the same kernels (one thread) on this machine give the same bits on any machine.
    2. In float64 that arithmetic and the concatenated batch agree to 1e-10 (measured: 7e-15; float64
       rounding magnified 5e4 times stays below 1e-10), while float32 rounding alone moves them ~1e-5:
       the two are the same computation, and only the order of additions differs.
    """
    # ngram: a sparse embedding and dense layers, AdaGrad; 2 pservers on one IP, 2 blocks each.
    steps, pservers = 6, 2
    flags = ["--model", "ngram", "--batch_size", "16", "--steps", str(steps), "--log_every", "1", "--ports_num", "2"]
    job = start_ps_job(jobs(), corpus, pservers=pservers, trainers=2, trainer_flags=flags,
                       pserver_flags=["--checkpoint_dir", str(tmp_path / "ck"), "--ports_num", "2"])
    assert_all_exit(job, 0)                       # trainers done -> pservers exit 0 too

    dense, tables, states = parameters_from_pservers(tmp_path / "ck", pservers)
    assert all(s["version"] == steps and s["trainer_steps"] == [steps, steps] for s in states)
    initial = build_model(reference_args(corpus, flags), tables["emb"].shape[0])
    for name, table in tables.items():
        assert not torch.allclose(table, initial.get_submodule(name).weight.detach())   # training did move it

    # 1. Bit for bit: the pservers' arithmetic in one process.
    model, _ = single_threaded(reference_run, corpus, flags, trainers=2, steps=steps, order="per_trainer")
    expected_tables, expected_dense = flat_parameters(model, tables)
    for name, table in tables.items():
        differ = (table != expected_tables[name]).sum().item()
        assert differ == 0, f"{name}: {differ} values differ, by up to {(table - expected_tables[name]).abs().max():.3g}"
    assert len(dense) and torch.equal(dense, expected_dense), (dense - expected_dense).abs().max()

    # 2. That arithmetic is the concatenated batch's, up to the order of additions.
    exact = {order: flat_parameters(reference_run(corpus, flags, 2, steps, order, torch.float64)[0], tables)
             for order in ("per_trainer", "concatenated")}
    for a, b in zip([*exact["per_trainer"][0].values(), exact["per_trainer"][1]],
                    [*exact["concatenated"][0].values(), exact["concatenated"][1]]):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), (a - b).abs().max()

    records = job.metrics("trainer-0")
    assert [r["step"] for r in records if is_training_record(r)] == list(range(1, steps + 1))
    assert {"ts", "role", "rank", "step", "epoch", "loss", "samples_per_s", "lr"} <= set(records[0])
    assert records[-1]["eval_loss"] > 0 and records[-1]["eval_samples"] > 0


def reference_args(corpus, flags):
    return parse_trainer_args(["--data", str(corpus), *flags])


# -- async SGD ------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_async_sgd_discards_gradients_older_than_the_bound_and_counts_them(jobs, corpus):
    # A ratio of 0 tolerates no lag at all: whenever the other trainer updated in between, drop.
    job = start_ps_job(jobs(), corpus, trainers=2, sgd="async",
                       trainer_flags=["--model", "word2vec", "--batch_size", "8", "--steps", "60", "--log_every", "1"],
                       pserver_flags=["--async_lagged_grad_discard_ratio", "0"])
    assert_all_exit(job, 0)
    pserver = job.metrics("pserver-0")[-1]
    trainers = [job.metrics(f"trainer-{t}") for t in range(2)]
    discarded = [[r for r in m if is_training_record(r)][-1]["discarded_gradients"] for m in trainers]
    assert pserver["discarded_gradients"] == sum(discarded) > 0
    # every gradient was either applied (one update each) or discarded
    assert pserver["updates"] + pserver["discarded_gradients"] == 2 * 60


# -- checkpoints ------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_interrupted_job_resumes_with_the_same_loss_curve(jobs, corpus, tmp_path):
    # word2vec (two sparse tables). The uninterrupted run is computed in this process: by the test
    # above, sync SGD on pservers is one process doing the pservers' arithmetic (in their order of
    # additions, so AdaGrad cannot magnify float32 rounding differences over 150 steps).
    steps = 150
    flags = ["--model", "word2vec", "--batch_size", "8", "--steps", str(steps), "--log_every", "1"]
    ps_flags = ["--checkpoint_every", "25", "--checkpoint_dir", str(tmp_path / "ck")]
    _, expected = single_threaded(reference_run, corpus, flags, trainers=2, steps=steps, order="per_trainer")

    def losses(job):
        return {r["step"]: r["loss"] for r in job.metrics("trainer-0") if is_training_record(r)}

    first = start_ps_job(jobs("first"), corpus, trainer_flags=flags, pserver_flags=ps_flags)
    first.wait_for_step("trainer-0", 30)
    for name in ("pserver-0", "trainer-0", "trainer-1"):    # as fab kill-all: SIGTERM to every process
        first.signal(name, signal.SIGTERM)
    codes = first.wait(30)
    assert codes["pserver-0"] == 143, first.stderr("pserver-0")
    saved = checkpoint.pserver_versions(tmp_path / "ck", 0)[-1]
    assert 30 <= saved < steps        # the SIGTERM save: the periodic ones before step 30 were at 25

    second = start_ps_job(jobs("second"), corpus, trainer_flags=flags, pserver_flags=ps_flags)
    assert_all_exit(second, 0)
    resumed = losses(second)
    assert min(resumed) == saved + 1 and max(resumed) == steps
    assert f"resuming at step {saved}" in (second.workdir / "trainer-0.out").read_text()
    before = losses(first)
    curve = {**before, **resumed}
    # A trainer may be killed after the pserver applied its last step but before it logged it.
    assert set(range(1, steps + 1)) - set(curve) <= set(range(max(before) + 1, saved + 1))
    for step, loss in curve.items():
        assert loss == pytest.approx(expected[step], rel=1e-4, abs=1e-5), step


# -- failures -----------------------------------------------------------------------------------

LONG_RUN = ["--model", "word2vec", "--batch_size", "8", "--num_passes", "10000", "--log_every", "1"]


@pytest.mark.timeout(90)
def test_killed_trainer_fails_the_job_quickly_and_is_named(jobs, corpus):
    job = start_ps_job(jobs(), corpus, trainers=2, trainer_flags=LONG_RUN, timeout=60)
    job.wait_for_step("trainer-1", 5)
    killed_at = time.monotonic()
    job.signal("trainer-1", signal.SIGKILL)
    codes = job.wait(20)
    took = time.monotonic() - killed_at
    assert codes["pserver-0"] not in (0, None) and codes["trainer-0"] not in (0, None), codes
    assert took < 15                              # the peer's socket closed: far sooner than the 60 s timeout
    assert "lost trainer 1" in job.stderr("pserver-0")
    assert "lost trainer 1" in job.stderr("trainer-0")    # told by the pserver, which it was waiting on
    assert "Traceback" not in job.stderr("pserver-0") + job.stderr("trainer-0")


@pytest.mark.timeout(90)
def test_killed_pserver_fails_the_job_quickly_and_is_named(jobs, corpus):
    job = start_ps_job(jobs(), corpus, pservers=2, trainers=2, host="127.0.0.1", trainer_flags=LONG_RUN)
    job.wait_for_step("trainer-0", 5)
    killed_at = time.monotonic()
    job.signal("pserver-1", signal.SIGKILL)
    codes = job.wait(20)
    assert time.monotonic() - killed_at < 15
    for name in ("pserver-0", "trainer-0", "trainer-1"):
        assert codes[name] not in (0, None), (name, codes)
        assert "lost pserver 1" in job.stderr(name), (name, job.stderr(name))


@pytest.mark.timeout(90)
def test_hung_trainer_fails_the_job_within_the_job_timeout(jobs, corpus):
    job = start_ps_job(jobs(), corpus, trainers=2, trainer_flags=LONG_RUN, timeout=4)
    job.wait_for_step("trainer-1", 5)
    stopped_at = time.monotonic()
    job.signal("trainer-1", signal.SIGSTOP)       # alive, silent: only the timeout can tell
    try:
        codes = job.wait(25, names=["pserver-0", "trainer-0"])
        took = time.monotonic() - stopped_at
        assert codes["pserver-0"] not in (0, None) and codes["trainer-0"] not in (0, None), codes
        assert 2.5 < took < 20
        assert "lost trainer 1: no message within 3 s (1 s before --timeout)" in job.stderr("pserver-0")
        assert "lost trainer 1" in job.stderr("trainer-0")
    finally:
        job.signal("trainer-1", signal.SIGCONT)


# -- collective mode ---------------------------------------------------------------------------------

def start_ddp_job(job, data, world, flags, port):
    for rank in range(world):
        name = f"rank-{rank}"
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank,
                        FABTRAIN_METRICS=job.metrics_path(name))
        job.start(name, ["-m", "workload.ddp", "--data", str(data), *flags], env)
    return job


@pytest.mark.timeout(150)
def test_collective_evaluation_counts_each_test_example_once(jobs, tmp_path):
    # One test file of 5 sentences, 2 ranks: 3 + 2 examples. DistributedSampler would pad to 6.
    data = tmp_path / "uneven"
    write_sample_corpus(data, vocab=60, train_shards=2, test_shards=1, sentences=20, test_sentences=[5])
    flags = ["--model", "mlp", "--batch_size", "4", "--num_passes", "2", "--eval_batch_size", "2", "--log_every", "1"]
    ddp = start_ddp_job(jobs("ddp"), data, 2, [*flags, "--checkpoint_dir", str(tmp_path / "ck")], free_port())
    assert_all_exit(ddp, 0)
    fsdp = start_ddp_job(jobs("fsdp"), data, 2, [*flags, "--fsdp"], free_port())
    assert_all_exit(fsdp, 0)

    evals = [r for r in ddp.metrics("rank-0") if "eval_loss" in r]
    assert [r["eval_samples"] for r in evals] == [5, 5]
    # The reported loss is the mean over the 5 examples of the final model, computed here in one process.
    args = parse_ddp_args(["--data", str(data), *flags])
    model = build_model(args, vocab_size(load_word_dict(data)))
    model.load_state_dict(checkpoint.load(tmp_path / "ck" / "ddp-snapshot.pt")["model"])
    test, _ = collective_sources(data, "test", 0, 1)
    examples = load_examples(model, test, load_word_dict(data))
    assert len(examples) == 5
    with torch.no_grad():
        expected = sum(model(model.make_batch(examples[i:i + 2], torch.Generator().manual_seed(
            derive_seed(args.seed, 9, i // 2)))).sum().item() for i in range(0, 5, 2)) / 5
    assert evals[-1]["eval_loss"] == pytest.approx(expected, rel=1e-5)
    # A restarted job resumes from rank 0's snapshot on every rank, and trains the third pass only.
    more = start_ddp_job(jobs("more"), data, 2, [*flags, "--checkpoint_dir", str(tmp_path / "ck"),
                                                  "--num_passes", "3"], free_port())
    assert_all_exit(more, 0)
    last_step = evals[-1]["step"]
    for rank in range(2):
        steps = [r["step"] for r in more.metrics(f"rank-{rank}") if is_training_record(r)]
        assert steps == list(range(last_step + 1, last_step + 1 + len(steps))) and steps, (rank, steps)
        assert f"at step {last_step}" in (more.workdir / f"rank-{rank}.out").read_text()
    # FSDP shards the parameters yet computes the same thing.
    fsdp_evals = [r for r in fsdp.metrics("rank-1") if "eval_loss" in r]
    assert fsdp_evals[-1]["eval_samples"] == 5
    assert fsdp_evals[-1]["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-4)


@pytest.mark.timeout(180)
def test_each_node_keeps_a_snapshot_and_the_newest_any_node_holds_is_resumed(jobs, tmp_path):
    # Two ranks as two nodes (LOCAL_RANK 0 each, a checkpoint folder each), as under min_nodes: the first node
    # may be lost, so the next world's rank 0 may hold no snapshot, or an older one than another node's.
    data = tmp_path / "d"
    write_sample_corpus(data, vocab=60, train_shards=2, test_shards=1, sentences=20, test_sentences=[5])
    folders = [tmp_path / "ck-node1", tmp_path / "ck-node2"]

    def run(name, passes):
        job, port = jobs(name), free_port()
        for rank in range(2):
            env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, WORLD_SIZE=2, LOCAL_RANK=0,
                            FABTRAIN_METRICS=job.metrics_path(f"rank-{rank}"))
            job.start(f"rank-{rank}", ["-m", "workload.ddp", "--data", str(data), "--model", "mlp", "--batch_size",
                                       "4", "--log_every", "1", "--num_passes", str(passes),
                                       "--checkpoint_dir", str(folders[rank])], env)
        assert_all_exit(job, 0)
        return job

    run("two", 2)
    older = checkpoint.load(folders[0] / "ddp-snapshot.pt")["step"]
    kept = (folders[0] / "ddp-snapshot.pt").read_bytes()
    assert checkpoint.load(folders[1] / "ddp-snapshot.pt")["step"] == older  # every node saved its own copy
    run("three", 3)
    newer = checkpoint.load(folders[1] / "ddp-snapshot.pt")["step"]
    assert newer > older
    (folders[0] / "ddp-snapshot.pt").write_bytes(kept)  # node1 holds the older one, as a node back after it left
    four = run("four", 4)
    for rank in range(2):
        steps = [r["step"] for r in four.metrics(f"rank-{rank}") if is_training_record(r)]
        assert steps and steps[0] == newer + 1, (rank, steps[:3], older, newer)
        assert f"resumed from rank 1's" in (four.workdir / f"rank-{rank}.out").read_text()


@pytest.mark.timeout(120)
def test_torchrun_starts_the_collective_job_with_sparse_embeddings(jobs, corpus, tmp_path):
    job = jobs()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out = subprocess.run([torchrun, "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          "-m", "workload.ddp", "--data", str(corpus), "--model", "word2vec", "--sparse_embedding",
                          "--steps", "12", "--log_every", "1"],
                         cwd=REPO, env=clean_env(FABTRAIN_METRICS=tmp_path / "m.jsonl"), capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_metrics(tmp_path / "m.jsonl")       # both ranks append to the one file
    assert {r["rank"] for r in records} == {0, 1}
    assert max(r["step"] for r in records) == 12
    assert "DDP, sparse embedding gradients" in out.stdout
    del job
