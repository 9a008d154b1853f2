"""A parameter-server trainer: computes gradients on its shard; the pservers own the parameters.

    python -m workload.trainer --model word2vec --data DIR --trainer_id 0 --num_gradient_servers 2 \\
        --pservers 10.0.0.1,10.0.0.2 --port 7164 [--sgd sync|async] [--steps N] [--num_passes E]

Every flag can come from the environment instead (PADDLE_INIT_*, FABTRAIN_*): see config.py.

One step, for batch s:
  * the values batch s needs (dense blocks, and its rows of the sparse tables)
    came with the reply to step s-1;
  * forward and backward on those local copies;
  * send each pserver its share of the gradient, and the ids batch s+1 needs;
  * the reply (sync: once every trainer's gradient is in) brings the new
    values for batch s+1.
At the end of each pass the trainer evaluates on its test shard, pulling the
rows each evaluation batch needs.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from workload.config import UsageError, parse_trainer_args, run_main
from workload.data import BatchStream, derive_seed, eval_batches, list_shards, load_examples, load_word_dict, \
    shards_for, vocab_size
from workload.metrics import MetricsWriter, TrainingLog
from workload.models import batch_length, build_model, dense_parameters, optimizer_config, sparse_modules, \
    to_device
from workload.ps_client import PServerClient
from workload.ps_protocol import JobAborted, Layout, PeerLost
from workload.rendezvous import StartupFailed, join_job


class Trainer:
    def __init__(self, args, model, train_examples, test_examples, client, log, device):
        self.args, self.model, self.client, self.log, self.device = args, model, client, log, device
        self.test_examples = test_examples
        self.stream = BatchStream(train_examples, args.batch_size, args.seed, args.trainer_id)
        self.tables = sparse_modules(model) if args.ports_num_for_sparse else {}
        self._flatten_dense(dense_parameters(model, include_tables=not self.tables))
        all_steps = args.num_passes * self.stream.per_epoch
        self.last_step = min(args.steps, all_steps) if args.steps else all_steps
        self.step = 0

    def _flatten_dense(self, params):
        """Make the dense parameters and their gradients views of two flat vectors (as DDP's bucket
        views): pservers' values are received straight into one and gradients sent straight from the
        other, with no copy in between. On a GPU the vectors that travel are CPU copies."""
        self.values = flatten(params).detach()
        self.grads = torch.zeros_like(self.values)
        offset = 0
        for p in params:
            p.data = self.values[offset:offset + p.numel()].view_as(p)
            p.grad = self.grads[offset:offset + p.numel()].view_as(p)   # backward adds into it
            offset += p.numel()
        on_gpu = self.device.type == "cuda"
        self.wire_values = self.values.cpu() if on_gpu else self.values
        self.wire_grads = self.grads.cpu() if on_gpu else self.grads

    # -- moving values between the pservers and the model ------------------------

    def _ids(self, batch):
        """Sorted unique ids of each sparse table that `batch` reads (none when batch is None)."""
        if batch is None:
            return [torch.empty(0, dtype=torch.long) for _ in self.tables]
        wanted = self.model.table_inputs(batch)
        return [torch.unique(wanted[name]) for name in self.tables]

    def _load(self, ids, rows, dense_arrived=True):
        if dense_arrived and self.wire_values is not self.values:
            self.values.copy_(self.wire_values)
        for table, table_ids, table_rows in zip(self.tables.values(), ids, rows):
            table.load(table_ids, table_rows)

    def _batch(self, step):
        return self.model.make_batch(self.stream.rows(step), self.stream.generator(step))

    def _pull(self, batch, want_dense=True):
        ids = self._ids(batch)
        self._load(ids, self.client.pull(ids, self.wire_values if want_dense else None), want_dense)

    # -- training ----------------------------------------------------------------

    def _run_batch(self, batch):
        self.grads.zero_()          # the sparse rows' gradients were reset when they were loaded
        loss = self.model(to_device(batch, self.device)).mean()
        loss.backward()
        return loss.item()

    def _push_and_pull(self, next_batch):
        """Send this step's gradients; load the new dense values and the rows of next_batch."""
        if self.wire_grads is not self.grads:
            self.wire_grads.copy_(self.grads)
        row_grads = [(t.ids.cpu(), t.rows.grad.cpu()) for t in self.tables.values()]
        next_ids = self._ids(next_batch)
        rows = self.client.step(self.step, self.wire_grads, row_grads, next_ids, self.wire_values)
        self._load(next_ids, rows)

    def _run_epoch(self, epoch):
        end = min(self.last_step, (epoch + 1) * self.stream.per_epoch)
        batch = self._batch(self.step)
        self._pull(batch)
        while self.step < end:
            loss = self._run_batch(batch)
            next_batch = self._batch(self.step + 1) if self.step + 1 < end else None
            self._push_and_pull(next_batch)
            self.step += 1
            extra = {"discarded_gradients": sum(self.client.discarded)} if self.args.sgd == "async" else {}
            self.log.step(self.step, epoch, loss, batch_length(batch), **extra)
            batch = next_batch

    @torch.no_grad()
    def _evaluate(self, epoch):
        loss_sum, count = 0.0, 0
        for i, rows in eval_batches(self.test_examples, self.args.eval_batch_size):
            batch = self.model.make_batch(rows, torch.Generator().manual_seed(derive_seed(self.args.seed, 9, i)))
            self._pull(batch, want_dense=i == 0)    # one snapshot of the dense values for the whole pass
            loss_sum += self.model(to_device(batch, self.device)).sum().item()
            count += len(rows)
            self.log.heartbeat(self.step, epoch, evaluated=count, of=len(self.test_examples))
        self.log.evaluation(self.step, epoch, loss_sum, count)

    def train(self):
        self.step = self.client.hello()
        me = f"trainer {self.args.trainer_id}"
        if self.step >= self.last_step:
            print(f"{me}: nothing left to do: the pservers' checkpoint already holds all {self.last_step} steps "
                  "(remove the checkpoint dir to train afresh)", flush=True)
        elif self.step:
            print(f"{me}: resuming at step {self.step} of {self.last_step}", flush=True)
        while self.step < self.last_step:
            epoch, _ = self.stream.position(self.step)
            self._run_epoch(epoch)
            if len(self.test_examples):
                self._evaluate(epoch)
        self.client.done()


def flatten(tensors):
    return parameters_to_vector(tensors) if tensors else torch.empty(0)


def pick_device(args):
    if not args.use_gpu:
        torch.set_num_threads(args.trainer_count)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--use_gpu / PADDLE_INIT_USE_GPU given but torch sees no GPU")
    index = int(os.environ.get("LOCAL_RANK", args.trainer_id)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def main():
    args = parse_trainer_args()
    me = f"trainer {args.trainer_id}"
    device = pick_device(args)

    # Data first: a trainer joins the job only when it is ready to train, so
    # slow loading never counts against the pservers' timeouts.
    word_dict = load_word_dict(args.data)
    sparse = args.ports_num_for_sparse > 0
    model = build_model(args, vocab_size(word_dict), remote=sparse).to(device)
    T = args.num_gradient_servers
    train_files = shards_for(list_shards(args.data, "train"), args.trainer_id, T)
    if not train_files:
        raise UsageError(f"no train.txt-* file in {args.data} with a suffix = {args.trainer_id} mod {T}")
    train = load_examples(model, train_files, word_dict)
    test = load_examples(model, shards_for(list_shards(args.data, "test"), args.trainer_id, T), word_dict)
    if not len(train):
        raise UsageError(f"{', '.join(f.name for f in train_files)} hold no {args.model} examples")
    print(f"{me}: {args.model}, {len(train)} train / {len(test)} test examples from "
          f"{len(train_files)} file(s), vocabulary {vocab_size(word_dict)}, {args.sgd} SGD", flush=True)

    layout = Layout(len(args.pserver_hosts), args.ports_num,
                    sum(p.numel() for p in dense_parameters(model, include_tables=not sparse)),
                    tuple(model.table_specs) if sparse else ())
    P = len(args.pserver_hosts)
    join_job(args.pserver_hosts[0], args.port, P + args.trainer_id, P + T,
             lambda r: f"pserver {r}" if r < P else f"trainer {r - P}", args.startup_timeout, args.timeout)
    client = PServerClient(args.trainer_id, args.pserver_hosts, layout, args.timeout)
    log = TrainingLog(MetricsWriter(args.metrics, "trainer", args.trainer_id), me, args.log_every,
                      optimizer_config(args)["lr"])
    trainer = Trainer(args, model, train, test, client, log, device)
    if args.trainer_id == 0:
        config = {"layout": layout.to_json(), "optimizer": optimizer_config(args), "sgd": args.sgd,
                  "num_pservers": P, "num_trainers": T, "ports_num": args.ports_num,
                  "ports_num_for_sparse": args.ports_num_for_sparse, "model": args.model}
        client.send_config(config, trainer.wire_values)
    try:
        trainer.train()
    except PeerLost as lost:
        client.abort(lost)
        return fail(me, lost)
    except JobAborted as e:
        return fail(me, e)
    print(f"{me}: done after {trainer.step} steps", flush=True)
    dist.destroy_process_group()
    return 0


def fail(me, error):
    print(f"{me}: error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)    # gloo may still hold receives nobody will answer; do not wait for them


def run():
    try:
        return run_main(main, "workload.trainer")
    except (StartupFailed, PeerLost) as e:
        fail("workload.trainer", e)


if __name__ == "__main__":
    sys.exit(run())
