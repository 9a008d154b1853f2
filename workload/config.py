"""Command-line flags, and the environment variables behind them.

Every flag can also come from an environment variable, so the programs run
unchanged under fabtrain (which sets PADDLE_INIT_* and FABTRAIN_*), under a
PaddlePaddle-style launcher, or by hand. A flag on the command line wins over
its variable, as paddle.init() arguments win over PADDLE_INIT_*.

Mistakes a person can make (a bad flag, a bad variable, a missing data dir)
raise UsageError, which `run_main` prints as one line and exit code 2.
"""
import argparse
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """A mistake the person running the program can fix."""


def run_main(main, prog):
    """Run main(); print a UsageError as one line, exit 2, no traceback."""
    try:
        return main()
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_bool(text):
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"
non_negative_int.__name__ = "non-negative integer"
positive_float.__name__ = "positive number"
parse_bool.__name__ = "boolean (0/1/true/false)"


def from_env(names, kind, default=None):
    """The first of the variables `names` that is set, converted by `kind`."""
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            return kind(raw)
        except ValueError:
            raise UsageError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    return default


def add(parser, flag, kind, default=None, env=(), help="", **kw):
    """A flag whose default comes from the environment when a variable is set."""
    if kind is bool:
        parser.add_argument(flag, action="store_true", default=from_env(env, parse_bool, default or False),
                            help=help + _env_note(env))
        return
    parser.add_argument(flag, type=kind, default=from_env(env, kind, default),
                        help=help + _env_note(env), **kw)


def _env_note(env):
    return f" [env {', '.join(env)}]" if env else ""


# ---------------------------------------------------------------------------
# Flag groups. Each program takes the groups it needs.

def add_cluster_flags(p):
    """Where the parameter servers are and how many trainers there are (Paddle v2 names)."""
    add(p, "--port", positive_int, 7164, ["PADDLE_INIT_PORT"],
        "rendezvous port on the first pserver")
    add(p, "--ports_num", positive_int, 1, ["PADDLE_INIT_PORTS_NUM"],
        "dense parameter blocks per pserver (see docs/workload.md)")
    add(p, "--ports_num_for_sparse", non_negative_int, 1, ["PADDLE_INIT_PORTS_NUM_FOR_SPARSE"],
        "0: embeddings travel as dense blocks; >=1: row-sparse updates")
    add(p, "--num_gradient_servers", positive_int, 1, ["PADDLE_INIT_NUM_GRADIENT_SERVERS"],
        "number of trainers")
    add(p, "--pservers", str, "127.0.0.1", ["PADDLE_INIT_PSERVERS"],
        "comma list of pserver IPs, in pserver-rank order")
    add(p, "--sgd", str, "sync", ["FABTRAIN_SGD"], "sync or async SGD", choices=["sync", "async"])
    add_timeout_flag(p)
    add(p, "--startup_timeout", positive_float, 300.0, ["FABTRAIN_STARTUP_TIMEOUT"],
        "seconds to wait for every process to join at start")


def add_timeout_flag(p):
    add(p, "--timeout", positive_float, 60.0, ["FABTRAIN_PG_TIMEOUT"],
        "process-group timeout: seconds any one message or collective may take before the job fails")


def add_training_flags(p):
    """The model, the data and the loop: shared by the PS trainer and DDP."""
    add(p, "--model", str, "word2vec", ["FABTRAIN_MODEL"], "word2vec, ngram or mlp",
        choices=["word2vec", "ngram", "mlp"])
    add(p, "--data", str, None, ["FABTRAIN_DATA_DIR"],
        "data dir written by prepare.py (default $FABTRAIN_WORKSPACE/data)")
    add(p, "--steps", non_negative_int, 0, [], "stop after this many batches (0: no limit)")
    add(p, "--num_passes", positive_int, 1, [], "passes over the shard")
    add(p, "--batch_size", positive_int, 64, [], "examples per batch, per trainer")
    add(p, "--eval_batch_size", positive_int, 256, [], "examples per evaluation batch")
    add(p, "--use_gpu", bool, False, ["PADDLE_INIT_USE_GPU"], "compute on the GPU")
    add(p, "--trainer_count", positive_int, 1, ["PADDLE_INIT_TRAINER_COUNT"],
        "compute threads per trainer (torch.set_num_threads)")
    add(p, "--metrics", str, None, ["FABTRAIN_METRICS"], "JSON-lines metrics file")
    add(p, "--log_every", positive_int, 10, [], "write a metrics record every N steps (and at least every second)")
    add(p, "--seed", non_negative_int, 1, [], "seed for initialisation, shuffling and negative sampling")
    add(p, "--optimizer", str, None, [], "sgd or adagrad (default: the model's)", choices=["sgd", "adagrad"])
    add(p, "--lr", positive_float, None, [], "learning rate (default: the model's)")
    add(p, "--emb_dim", positive_int, None, [], "embedding width (default: the model's)")
    add(p, "--hidden", positive_int, None, [], "hidden width of ngram / mlp")
    add(p, "--window", positive_int, 2, [], "word2vec context window")
    add(p, "--negatives", positive_int, 5, [], "word2vec negative samples per example")
    add(p, "--w2v_mode", str, "skipgram", [], "skipgram or cbow", choices=["skipgram", "cbow"])
    add(p, "--ngram_n", positive_int, 5, [], "N of the N-gram model (N-1 context words)")
    add(p, "--mlp_features", positive_int, 512, [], "hashed bag-of-words width of the mlp input")


def resolve_data_dir(args):
    """--data, else $FABTRAIN_DATA_DIR (already its default), else $FABTRAIN_WORKSPACE/data; must hold word_dict.json."""
    data = args.data
    if not data and os.environ.get("FABTRAIN_WORKSPACE"):
        data = os.path.join(os.environ["FABTRAIN_WORKSPACE"], "data")
    if not data:
        raise UsageError("no data dir: give --data or set FABTRAIN_DATA_DIR or FABTRAIN_WORKSPACE")
    path = Path(data).expanduser()
    if not path.is_dir():
        raise UsageError(f"data dir {path} does not exist")
    if not (path / "word_dict.json").is_file():
        raise UsageError(f"{path}/word_dict.json not found (run prepare.py first)")
    return path


def parse_pservers(text):
    hosts = [h.strip() for h in text.split(",")]
    if not text.strip() or any(not h or any(c.isspace() for c in h) for h in hosts):
        raise UsageError(f"--pservers / PADDLE_INIT_PSERVERS {text!r} is not a comma list of IPs")
    return hosts


def resolve_trainer_id(args):
    """--trainer_id, else PADDLE_INIT_TRAINER_ID, OMPI_COMM_WORLD_RANK, FABTRAIN_RANK; 0 for a lone trainer."""
    trainer_id = args.trainer_id
    if trainer_id is None:
        trainer_id = from_env(["PADDLE_INIT_TRAINER_ID", "OMPI_COMM_WORLD_RANK", "FABTRAIN_RANK"], non_negative_int)
    if trainer_id is None:
        if args.num_gradient_servers > 1:
            raise UsageError("no trainer id: give --trainer_id or set PADDLE_INIT_TRAINER_ID")
        trainer_id = 0
    if trainer_id >= args.num_gradient_servers:
        raise UsageError(f"trainer id {trainer_id} is not below --num_gradient_servers {args.num_gradient_servers}")
    return trainer_id


def parse_trainer_args(argv=None):
    p = OneLineParser(prog="workload.trainer", description="Parameter-server trainer.")
    add_cluster_flags(p)
    add_training_flags(p)
    add(p, "--trainer_id", non_negative_int, None, [],
        "this trainer's index [env PADDLE_INIT_TRAINER_ID, OMPI_COMM_WORLD_RANK, FABTRAIN_RANK]")
    args = p.parse_args(argv)
    args.pserver_hosts = parse_pservers(args.pservers)
    args.trainer_id = resolve_trainer_id(args)
    args.data = resolve_data_dir(args)
    return args


def parse_pserver_args(argv=None):
    p = OneLineParser(prog="workload.pserver", description="Parameter server.")
    add_cluster_flags(p)
    add(p, "--pserver_id", non_negative_int, None, ["FABTRAIN_RANK"], "this pserver's rank among the pservers")
    add(p, "--checkpoint_dir", str, None, ["FABTRAIN_CHECKPOINT_DIR"], "where to save and resume (none: no checkpoints)")
    add(p, "--checkpoint_every", positive_int, 100, [], "save every N updates (and on SIGTERM)")
    add(p, "--async_lagged_grad_discard_ratio", float, 1.5, [],
        "async: discard a gradient more than ratio x trainers updates old")
    add(p, "--metrics", str, None, ["FABTRAIN_METRICS"], "JSON-lines metrics file")
    add(p, "--num_threads", positive_int, 1, [], "torch threads for the optimiser")
    args = p.parse_args(argv)
    args.pserver_hosts = parse_pservers(args.pservers)
    if args.pserver_id is None:
        if len(args.pserver_hosts) > 1:
            raise UsageError("no pserver id: give --pserver_id or set FABTRAIN_RANK")
        args.pserver_id = 0
    if args.pserver_id >= len(args.pserver_hosts):
        raise UsageError(f"pserver id {args.pserver_id} but --pservers lists {len(args.pserver_hosts)} pserver(s)")
    return args


def parse_ddp_args(argv=None):
    p = OneLineParser(prog="workload.ddp", description="Collective (DDP / FSDP) trainer.")
    add_training_flags(p)
    add_timeout_flag(p)
    add(p, "--sparse_embedding", bool, False, [], "nn.Embedding(sparse=True): all-reduce only the touched rows")
    add(p, "--fsdp", bool, False, [], "shard parameters with FSDP2 fully_shard instead of DDP")
    add(p, "--checkpoint_dir", str, None, ["FABTRAIN_CHECKPOINT_DIR"], "where to save and resume (none: no checkpoints)")
    add(p, "--checkpoint_every", positive_int, 100, [], "save every N steps")
    args = p.parse_args(argv)
    args.data = resolve_data_dir(args)
    if args.fsdp and args.sparse_embedding:
        raise UsageError("--fsdp cannot shard sparse embeddings; drop --sparse_embedding")
    if args.fsdp and args.checkpoint_dir:
        raise UsageError("checkpoints are not implemented with --fsdp")
    return args
