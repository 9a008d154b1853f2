"""The reference workload's pieces, in one process: flags and environment, data shards,
parameter layout and messages, tables, optimisers, checkpoints, metrics.

The multi-process behaviour (sync/async SGD, resume, failures, DDP) is in
test_workload_jobs.py.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from workload import checkpoint
from workload.config import UsageError, parse_ddp_args, parse_pserver_args, parse_trainer_args, run_main
from workload.data import (BatchStream, collective_sources, list_shards, load_examples, load_word_dict,
                           read_sentences, shards_for, vocab_size)
from workload.metrics import MetricsWriter, read_metrics
from workload.models import build_model, dense_parameters, sparse_modules
from workload.optim import AdaGrad, ModuleOptimizer, SGD
from workload.ps_protocol import (CONFIG, PULL, STEP, Header, Layout, carries_dense, pack, reply_sizes,
                                  request_sizes, unpack)
from workload.sample import write_sample_corpus
from workload.tables import RowTable, TableSpec, init_rows

from tests.support import REPO
pytestmark = pytest.mark.timeout(60)

ENV_PREFIXES = ("PADDLE_", "FABTRAIN_", "OMPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests start from an environment with none of the variables the workload reads."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIXES):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus")
    write_sample_corpus(path, vocab=120, train_shards=4, test_shards=2, sentences=12)
    return path


# -- flags and environment ------------------------------------------------------

def test_flag_wins_over_its_paddle_environment_variable(monkeypatch, corpus):
    monkeypatch.setenv("PADDLE_INIT_PORT", "7000")
    monkeypatch.setenv("PADDLE_INIT_NUM_GRADIENT_SERVERS", "3")
    monkeypatch.setenv("PADDLE_INIT_TRAINER_ID", "2")
    monkeypatch.setenv("PADDLE_INIT_PSERVERS", "10.0.0.1,10.0.0.2")
    monkeypatch.setenv("PADDLE_INIT_USE_GPU", "0")
    monkeypatch.setenv("PADDLE_INIT_TRAINER_COUNT", "4")
    args = parse_trainer_args(["--data", str(corpus), "--port", "7100"])
    assert args.port == 7100                                   # the flag
    assert args.num_gradient_servers == 3 and args.trainer_id == 2   # the variables
    assert args.pserver_hosts == ["10.0.0.1", "10.0.0.2"]
    assert args.trainer_count == 4 and args.use_gpu is False
    assert parse_trainer_args(["--data", str(corpus), "--trainer_id", "0"]).trainer_id == 0


def test_trainer_id_falls_back_to_ompi_rank_then_fabtrain_rank(monkeypatch, corpus):
    monkeypatch.setenv("PADDLE_INIT_NUM_GRADIENT_SERVERS", "4")
    monkeypatch.setenv("FABTRAIN_RANK", "3")
    assert parse_trainer_args(["--data", str(corpus)]).trainer_id == 3
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert parse_trainer_args(["--data", str(corpus)]).trainer_id == 1


def test_pserver_id_comes_from_fabtrain_rank(monkeypatch):
    monkeypatch.setenv("PADDLE_INIT_PSERVERS", "127.0.0.1,127.0.0.1")
    monkeypatch.setenv("FABTRAIN_RANK", "1")
    monkeypatch.setenv("FABTRAIN_CHECKPOINT_DIR", "/tmp/ck")
    args = parse_pserver_args([])
    assert args.pserver_id == 1 and args.checkpoint_dir == "/tmp/ck"
    with pytest.raises(UsageError, match="pserver id 2"):
        parse_pserver_args(["--pserver_id", "2"])


def test_data_dir_defaults_to_the_workspace_data(monkeypatch, tmp_path):
    write_sample_corpus(tmp_path / "data", vocab=20, train_shards=1, test_shards=1, sentences=2)
    monkeypatch.setenv("FABTRAIN_WORKSPACE", str(tmp_path))
    assert parse_ddp_args([]).data == tmp_path / "data"
    monkeypatch.setenv("FABTRAIN_DATA_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(UsageError, match="elsewhere does not exist"):
        parse_ddp_args([])


@pytest.mark.parametrize("argv, env, message", [
    (["--port", "x"], {}, "argument --port: invalid positive integer value: 'x'"),
    (["--sgd", "fast"], {}, "invalid choice: 'fast'"),
    (["--bogus"], {}, "unrecognized arguments: --bogus"),
    ([], {"PADDLE_INIT_PORTS_NUM": "two"}, "PADDLE_INIT_PORTS_NUM='two' is not a valid positive integer"),
    ([], {"PADDLE_INIT_NUM_GRADIENT_SERVERS": "2"}, "no trainer id"),
    (["--trainer_id", "5"], {}, "trainer id 5 is not below --num_gradient_servers 1"),
    (["--data", "/nonexistent/dir"], {}, "data dir /nonexistent/dir does not exist"),
])
def test_bad_trainer_input_is_one_line_and_exit_2(monkeypatch, capsys, corpus, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "--data" not in argv:
        argv = argv + ["--data", str(corpus)]
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: parse_trainer_args(argv), "workload.trainer")
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("workload.trainer: error: ") and message in err


def test_missing_word_dict_is_named(tmp_path):
    (tmp_path / "train.txt-00000").write_text("a b c\n")
    with pytest.raises(UsageError, match=r"word_dict.json not found \(run prepare.py first\)"):
        parse_trainer_args(["--data", str(tmp_path)])


@pytest.mark.parametrize("program", ["workload.trainer"])
def test_programs_print_no_traceback_for_bad_flags(program, tmp_path):
    out = subprocess.run([sys.executable, "-m", program, "--data" if program != "workload.pserver" else "--port",
                          str(tmp_path / "missing") if program != "workload.pserver" else "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIXES)})
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(f"{program}: error: ")


# -- data -------------------------------------------------------------------------

def test_trainer_reads_the_shards_whose_suffix_is_its_id_mod_trainers(corpus):
    shards = list_shards(corpus, "train")
    assert [s for s, _ in shards] == [0, 1, 2, 3]
    assert [p.name for p in shards_for(shards, 1, 2)] == ["train.txt-00001", "train.txt-00003"]
    assert [p.name for p in shards_for(shards, 2, 3)] == ["train.txt-00002"]
    assert [p.name for p in shards_for(list_shards(corpus, "test"), 1, 3)] == ["test.txt-00001"]


def test_bytes_that_are_not_utf8_are_replaced_not_fatal(corpus):
    words = [w for s in read_sentences([corpus / "train.txt-00000"]) for w in s]
    assert "w\ufffd1" in words
    assert load_examples(build_model(_args(corpus, "ngram"), 123), [corpus / "train.txt-00000"],
                         load_word_dict(corpus)).shape[1] == 5


def test_collective_ranks_share_lines_when_there_are_fewer_files_than_ranks(corpus):
    # 2 test files, 3 ranks: every rank reads both files and keeps every third line.
    parts = [collective_sources(corpus, "test", r, 3) for r in range(3)]
    assert all(len(paths) == 2 and shard == (r, 3) for r, (paths, shard) in enumerate(parts))
    lines = [read_sentences(paths, shard) for paths, shard in parts]
    everything = read_sentences(parts[0][0])
    assert sorted(map(tuple, sum(lines, []))) == sorted(map(tuple, everything))
    # 4 train files, 2 ranks: whole files by suffix.
    assert collective_sources(corpus, "train", 1, 2)[1] is None


def test_a_node_that_holds_some_shards_reads_them_whatever_its_rank_in_a_smaller_world(tmp_path):
    # `fab copy-data` gave this node its trainer's shards of 3 (train.txt-00001); the node that held 0 left, so
    # this node's trainer is now rank 0 of 2: it reads its own shard (0 mod 2 would name files it lacks).
    (tmp_path / "train.txt-00001").write_text("a b c\n")
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"files": {f"train.txt-0000{i}": {"kind": "train"}
                                                                  for i in range(3)}}))
    assert collective_sources(tmp_path, "train", 0, 2) == ([tmp_path / "train.txt-00001"], None)
    # Two trainers a node (LOCAL_WORLD_SIZE 2) with four of eight shards: each local rank reads half of them.
    for i in (2, 3, 6, 7):
        (tmp_path / f"test.txt-0000{i}").write_text("d e\n")
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"files": {f"test.txt-0000{i}": {"kind": "test"}
                                                                  for i in range(8)}}))
    halves = [collective_sources(tmp_path, "test", r, 4, local, 2)[0] for r, local in ((2, 0), (3, 1))]
    assert [[p.name for p in h] for h in halves] == [["test.txt-00002", "test.txt-00006"],
                                                     ["test.txt-00003", "test.txt-00007"]]


def test_sample_corpus_is_deterministic(tmp_path):
    write_sample_corpus(tmp_path / "a", vocab=50, sentences=5)
    write_sample_corpus(tmp_path / "b", vocab=50, sentences=5)
    for name in ("train.txt-00003", "test.txt-00001", "word_dict.json", "MANIFEST.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    word_dict = load_word_dict(tmp_path / "a")
    assert {"<unk>", "<s>", "<e>"} <= set(word_dict) and vocab_size(word_dict) == 53
    manifest = json.loads((tmp_path / "a" / "MANIFEST.json").read_text())
    assert manifest["split_count"] == 4 and manifest["files"]["train.txt-00002"]["shard"] == 2


def test_batches_are_reproducible_from_the_step_alone():
    examples = torch.arange(100).view(50, 2)
    a, b = BatchStream(examples, 8, seed=3, rank=1), BatchStream(examples, 8, seed=3, rank=1)
    assert a.per_epoch == 7
    later = [a.rows(s) for s in range(20)]
    assert torch.equal(b.rows(13), later[13])          # a resumed trainer reads the same batch
    epoch0 = torch.cat([a.rows(s) for s in range(7)])
    assert sorted(epoch0[:, 0].tolist()) == list(range(0, 100, 2))   # a pass sees every example once
    assert not torch.equal(a.rows(0), a.rows(7))                    # and the next pass reshuffles
    assert torch.equal(torch.rand(3, generator=a.generator(5)), torch.rand(3, generator=b.generator(5)))


# -- layout, messages, tables ------------------------------------------------------

def test_dense_blocks_cover_the_vector_round_robin_over_pservers():
    layout = Layout(num_pservers=3, blocks_per_pserver=2, dense_numel=101)
    blocks = layout.blocks()
    assert len(blocks) == 6 and blocks[0][0] == 0 and blocks[-1][1] == 101
    assert all(e1 == s2 for (_, e1), (s2, _) in zip(blocks, blocks[1:]))
    assert layout.dense_ranges(1) == [blocks[1], blocks[4]]           # block b on pserver b mod P
    flat = torch.randn(101)
    # What a trainer sends from its flat vector is what the pserver keeps, concatenated.
    local = [torch.cat(layout.dense_blocks(flat, p)) for p in range(3)]
    assert [len(x) for x in local] == [layout.dense_numel_on(p) for p in range(3)]
    for p in range(3):
        assert all(torch.equal(a, b) for a, b in zip(layout.local_blocks(local[p], p), layout.dense_blocks(flat, p)))
    assert torch.equal(layout.join_dense(local, torch.empty(101)), flat)
    # The blocks are views: received values land in place, sent gradients are not copied.
    layout.dense_blocks(flat, 2)[0].fill_(7.0)
    assert (flat[blocks[2][0]:blocks[2][1]] == 7.0).all()


def test_sparse_rows_are_spread_by_id_mod_pservers():
    spec = TableSpec("emb", 10, 4)
    layout = Layout(3, 1, 0, (spec,))
    assert [layout.local_rows(spec, p) for p in range(3)] == [4, 3, 3]
    assert layout.global_ids(spec, 1).tolist() == [1, 4, 7]


def test_header_and_body_round_trip_with_exact_sizes():
    layout = Layout(2, 1, 10, (TableSpec("a", 50, 3), TableSpec("b", 50, 2)))
    header = Header(STEP, trainer=1, step=7, version=3)
    header.push[:2], header.pull[:2] = [2, 1], [1, 3]
    assert Header.from_tensor(header.tensor()) == header
    ids = [torch.tensor([4, 6]), torch.tensor([2]), torch.tensor([8]), torch.tensor([0, 2, 4])]
    floats = [torch.randn(2, 3), torch.randn(1, 2)]
    body = pack(ints=ids, floats=floats)
    sizes = request_sizes(header, layout)
    assert sizes == (7, 6 + 2, 0) and len(body) == 8 * 7 + 4 * 8
    got_ints, got_floats, _ = unpack(body, sizes)
    assert torch.equal(got_ints, torch.cat(ids)) and torch.equal(got_floats, torch.cat([f.flatten() for f in floats]))
    assert reply_sizes(header, layout) == (0, 1 * 3 + 3 * 2, 0)
    assert carries_dense(header, reply=False) and carries_dense(header, reply=True)
    pull = Header(PULL)
    assert not carries_dense(pull, reply=True) and not carries_dense(pull, reply=False)
    config = Header(CONFIG, config_bytes=11)
    assert unpack(pack(raw=b'{"a": true}'), request_sizes(config, None))[2] == b'{"a": true}'


def test_row_init_does_not_depend_on_how_rows_are_split():
    spec = TableSpec("emb_in", 1000, 8, init_scale=0.1, seed=4)
    whole = init_rows(spec, torch.arange(1000))
    assert torch.equal(init_rows(spec, torch.arange(1, 1000, 3)), whole[1::3])
    assert whole.abs().max() <= 0.1 and whole.std() > 0.04          # uniform in [-0.1, 0.1)
    assert not torch.equal(whole, init_rows(TableSpec("emb_in", 1000, 8, 0.1, seed=5), torch.arange(1000)))


def test_ps_trainer_holds_only_the_rows_of_its_batch(corpus):
    model = build_model(_args(corpus, "word2vec"), vocab_size=5_000_000, remote=True)
    assert sum(p.numel() for p in model.parameters()) == 0             # no 5M-row table anywhere
    table = sparse_modules(model)["emb_in"]
    assert isinstance(table, RowTable)
    table.load(torch.tensor([3, 4_999_999]), torch.ones(2, 64))
    out = table(torch.tensor([[4_999_999, 3, 3]]))
    assert out.shape == (1, 3, 64) and table.rows.numel() == 2 * 64


def test_local_and_remote_models_start_from_the_same_dense_values(corpus):
    local = build_model(_args(corpus, "ngram"), 123, remote=False)
    remote = build_model(_args(corpus, "ngram"), 123, remote=True)
    for a, b in zip(dense_parameters(local, False), dense_parameters(remote, False)):
        assert torch.equal(a, b)


# -- optimisers ----------------------------------------------------------------------

@pytest.mark.parametrize("rule", [SGD(0.5), AdaGrad(0.5)])
def test_sparse_and_dense_gradients_give_the_same_update(corpus, rule):
    """In float64: AdaGrad's first step is lr * g / (|g| + eps), which turns a difference in g's last
    bits into one up to lr/eps = 5e5 times larger. In float32 the sparse and dense paths sum a repeated
    row in whatever order the CPU's kernels choose: stop 66's CI run failed here once at atol 1e-6."""
    models = [build_model(_args(corpus, "ngram"), 123, sparse_grad=sparse).double() for sparse in (False, True)]
    batch = {"context": torch.tensor([[1, 2, 3, 1], [5, 5, 6, 7]]), "target": torch.tensor([2, 9])}
    for model in models:
        opt = ModuleOptimizer(rule, model.parameters())
        for _ in range(2):
            opt.zero_grad()
            model(batch).mean().backward()
            opt.step()
    assert models[1].emb.weight.grad.is_sparse
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.equal(models[0].emb.weight[5], build_model(_args(corpus, "ngram"), 123).emb.weight[5])


# -- checkpoints and metrics --------------------------------------------------------------

def _sync_server(num_trainers, spec, dense_numel):
    """A pserver's ParameterShard only (no processes, no gloo): what a sync round changes."""
    from workload.ps_shard import ParameterShard

    return ParameterShard(0, {"sgd": "sync"}, Layout(1, 1, dense_numel, (spec,)), AdaGrad(0.05),
                          torch.linspace(-1, 1, dense_numel), {spec.name: init_rows(spec, torch.arange(spec.num_rows))},
                          num_trainers=num_trainers, max_lag=0, checkpoint_dir=None, checkpoint_every=1000,
                          log=print)


def test_sync_rounds_give_the_same_bits_whatever_order_the_gradients_arrive_in():
    """The pserver adds a round's gradients in trainer order, not arrival order: float addition is
    not associative, so with 3 trainers arrival order would change the bits (checked below)."""
    import itertools

    g = torch.Generator().manual_seed(3)
    spec, dense_numel, trainers, rounds = TableSpec("emb", 40, 4), 64, 3, 3

    def gradient():
        scale = 10.0 ** torch.randint(-3, 3, (1,), generator=g).item()   # magnitudes that round differently
        ids = torch.unique(torch.randint(0, spec.num_rows, (12,), generator=g))   # rows shared by trainers
        return (torch.randn(dense_numel, generator=g) * scale,
                [(ids, torch.randn(len(ids), spec.dim, generator=g) * scale)])
    grads = [[gradient() for _ in range(trainers)] for _ in range(rounds)]
    a, b, c = (grads[0][t][0] for t in range(3))
    assert not torch.equal((a + b) + c, (c + b) + a), "these gradients must be order-sensitive for the test to mean anything"

    results = []
    for arrival in itertools.permutations(range(trainers)):
        ps = _sync_server(trainers, spec, dense_numel)
        for r in range(rounds):
            for t in arrival:
                with ps.cond:
                    ps.join_round(t, r, grads[r][t])
        assert ps.version == rounds and ps.trainer_steps == [rounds] * trainers
        results.append([ps.dense, ps.dense_state["sum"], ps.tables["emb"], ps.table_state["emb"]["sum"]])
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for version in (10, 20, 30, 40):
        checkpoint.save_atomic({"version": version}, checkpoint.pserver_path(tmp_path, 1, version))
    checkpoint.prune(tmp_path, 1, keep=3)
    assert checkpoint.pserver_versions(tmp_path, 1) == [20, 30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"pserver-1-v{v:09d}.pt" for v in (20, 30, 40)]
    assert checkpoint.load(checkpoint.pserver_path(tmp_path, 1, 30)) == {"version": 30}


SLOW_SAVE = """
import builtins, sys, time, torch
from workload import checkpoint


class SlowFile:
    # A file whose writes trickle out in 64 KiB pieces, so that the test can kill the save midway.
    def __init__(self, f):
        self.f = f

    def write(self, data):
        view = memoryview(data).cast("B")
        for i in range(0, len(view), 1 << 16):
            self.f.write(view[i:i + (1 << 16)])
            self.f.flush()
            time.sleep(0.005)
        return len(view)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


checkpoint.open = lambda path, mode: SlowFile(builtins.open(path, mode))
checkpoint.save_atomic({"version": int(sys.argv[2]), "dense": torch.ones(8 << 20)}, sys.argv[1])   # 32 MiB
print("saved", flush=True)
"""


@pytest.mark.parametrize("target", ["a new version", "the same name"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path, target):
    previous = {"version": 1, "dense": torch.arange(1000, dtype=torch.float32)}
    checkpoint.save_atomic(previous, checkpoint.pserver_path(tmp_path, 0, 1))
    final = checkpoint.pserver_path(tmp_path, 0, 2 if target == "a new version" else 1)
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE)
    child = subprocess.Popen([sys.executable, str(script), str(final), "2"], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        temp = final.with_name(f".{final.name}.tmp{child.pid}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not temp.exists() or temp.stat().st_size < 4 << 20):
            assert child.poll() is None, "the save ended before it could be interrupted"
            time.sleep(0.01)
        child.kill()                      # SIGKILL while the temp file is being written
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "saved" not in child.stdout.read()
    assert 4 << 20 <= temp.stat().st_size < 32 << 20      # it was killed midway through the data
    # Nothing half-written under a checkpoint's name: the previous one loads whole, and is the newest.
    assert checkpoint.pserver_versions(tmp_path, 0) == [1]
    loaded = checkpoint.load(checkpoint.pserver_path(tmp_path, 0, 1))
    assert loaded["version"] == 1 and torch.equal(loaded["dense"], previous["dense"])


def test_a_save_whose_write_fails_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    path = checkpoint.pserver_path(tmp_path, 0, 5)
    checkpoint.save_atomic({"version": 5}, path)

    def disk_full(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_atomic({"version": 6}, path)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_atomic({"version": 6}, checkpoint.pserver_path(tmp_path, 0, 6))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert checkpoint.load(path) == {"version": 5}


def test_resume_uses_the_newest_version_every_pserver_has():
    assert checkpoint.common_version([[10, 20, 23], [10, 20, 21]]) == 20
    assert checkpoint.common_version([[], []]) is None
    assert checkpoint.common_version([[10], [20]]) is None


def test_metrics_records_are_json_lines_with_the_contract_keys(tmp_path):
    path = tmp_path / "m" / "trainer-0.jsonl"
    writer = MetricsWriter(str(path), "trainer", 0)
    writer.write(step=1, epoch=0, loss=float("nan"), samples_per_s=10.0, lr=0.1)
    writer.write(step=2, epoch=0, loss=2.5, samples_per_s=12.0, lr=0.1, eval_loss=2.0)
    records = read_metrics(path)        # readable while the writer is still open: flushed per line
    assert [r["step"] for r in records] == [1, 2] and records[0]["loss"] is None
    assert {"ts", "role", "rank", "step", "epoch", "loss", "samples_per_s", "lr"} <= set(records[1])


def _args(corpus, model):
    return parse_ddp_args(["--data", str(corpus), "--model", model])
