"""Collective training: every rank trains the whole model on its shard, gradients all-reduced (DDP),
or parameters sharded over the ranks (FSDP2's fully_shard).

Started by fabtrain once per rank, with the torch environment:
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=4 LOCAL_RANK=0 \\
        python -m workload.ddp --model word2vec --data DIR
or once per node by torchrun:
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500 \\
        -m workload.ddp --model word2vec --data DIR
Without RANK / WORLD_SIZE it trains alone (world size 1).

gloo on CPU, NCCL with --use_gpu. Data: rank r of W reads the train files
whose suffix is r mod W when there are at least W files, else a line shard
of every file (data.py). Each pass has the same number of batches on every
rank (the smallest rank's), so no rank waits in an all-reduce the others
never join. Evaluation counts every test example exactly once: ranks
evaluate disjoint parts and add up (loss sum, count); DistributedSampler's
padding with repeated examples would skew the result.
"""
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from workload import checkpoint
from workload.config import UsageError, parse_ddp_args, run_main
from workload.data import BatchStream, collective_sources, derive_seed, eval_batches, load_examples, \
    load_word_dict, vocab_size
from workload.metrics import MetricsWriter, TrainingLog
from workload.models import batch_length, build_model, optimizer_config, to_device
from workload.optim import ModuleOptimizer, make_optimizer
from workload.rendezvous import choose_gloo_interface


class DDPTrainer:
    def __init__(self, args, model, module, optimizer, stream, test_examples, log, device):
        self.args, self.model, self.module, self.optimizer = args, model, module, optimizer
        self.stream, self.test_examples, self.log, self.device = stream, test_examples, log, device
        all_steps = args.num_passes * stream.per_epoch
        self.last_step = min(args.steps, all_steps) if args.steps else all_steps
        self.step = 0
        self.snapshot = Path(args.checkpoint_dir) / "ddp-snapshot.pt" if args.checkpoint_dir else None

    def _run_batch(self, batch):
        self.optimizer.zero_grad()
        loss = self.model(to_device(batch, self.device)).mean()
        loss.backward()                # DDP all-reduces the gradients here, bucket by bucket
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        end = min(self.last_step, (epoch + 1) * self.stream.per_epoch)
        while self.step < end:
            batch = self.module.make_batch(self.stream.rows(self.step), self.stream.generator(self.step))
            loss = self._run_batch(batch)
            self.step += 1
            self.log.step(self.step, epoch, loss, batch_length(batch))
            if self.snapshot and self.step % self.args.checkpoint_every == 0:
                self._save_snapshot()

    @torch.no_grad()
    def _evaluate(self, epoch):
        batches = list(eval_batches(self.test_examples, self.args.eval_batch_size))
        if self.args.fsdp:
            # FSDP gathers parameters collectively in every forward: every rank must run as many.
            most = torch.tensor([len(batches)], device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            batches += [(i, self.test_examples[:0]) for i in range(len(batches), int(most))]
        forward = self.model if self.args.fsdp else self.module   # DDP's wrapper would sync buffers
        total = torch.zeros(2, dtype=torch.float64, device=self.device)   # (loss sum, examples)
        for i, rows in batches:
            batch = self.module.make_batch(rows, torch.Generator().manual_seed(derive_seed(self.args.seed, 9, i)))
            total[0] += forward(to_device(batch, self.device)).sum().item()
            total[1] += len(rows)
            self.log.heartbeat(self.step, epoch, evaluated=i + 1, of=len(batches))
        dist.all_reduce(total)
        self.log.evaluation(self.step, epoch, total[0].item(), int(total[1].item()))

    def _save_snapshot(self):
        # Every rank holds the same values under DDP. Each node's first rank keeps a copy on its own disk:
        # under min_nodes any node may leave, the first one included, so the next world's rank 0 may be on
        # a node that never was rank 0 (with a shared folder the copies are one file, each renamed in whole).
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            checkpoint.save_atomic({"step": self.step, "model": self.module.state_dict(),
                                    "optimizer": self.optimizer.state_dict()}, self.snapshot)

    def _load_snapshot(self):
        """The newest snapshot of any node, read by the lowest rank that holds it and handed to every rank
        (other nodes may hold none, or an older one: a node back after it left the job)."""
        state = None
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and self.snapshot and self.snapshot.is_file():
            state = checkpoint.load(self.snapshot)
        newest = torch.tensor([state["step"] if state else -1], device=self.device)
        dist.all_reduce(newest, op=dist.ReduceOp.MAX)
        if int(newest) < 0:
            return
        holds = state is not None and state["step"] == int(newest)
        source = torch.tensor([dist.get_rank() if holds else dist.get_world_size()], device=self.device)
        dist.all_reduce(source, op=dist.ReduceOp.MIN)
        source = int(source)
        if dist.get_rank() == source:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *(t for s in self.optimizer.state for t in s.values())]:
                dist.broadcast(tensor.data, source)
        self.step = int(newest)
        print(f"rank {dist.get_rank()}: resumed from rank {source}'s {self.snapshot} at step {self.step}", flush=True)

    def train(self):
        self._load_snapshot()
        while self.step < self.last_step:
            epoch, _ = self.stream.position(self.step)
            self._run_epoch(epoch)
            self._evaluate(epoch)
        if self.snapshot:
            self._save_snapshot()


def setup_distributed(args):
    """(rank, world size, device) from the torch environment; alone when there is none."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.use_gpu:
        if not torch.cuda.is_available():
            raise UsageError("--use_gpu / PADDLE_INIT_USE_GPU given but torch sees no GPU")
        if args.sparse_embedding:
            raise UsageError("NCCL cannot all-reduce sparse gradients: drop --sparse_embedding with --use_gpu")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        torch.set_num_threads(args.trainer_count)
        device, backend = torch.device("cpu"), "gloo"
        choose_gloo_interface(os.environ["MASTER_ADDR"])
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    return dist.get_rank(), dist.get_world_size(), device


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wrap(model, args, device, world_size):
    """DDP, or FSDP2 over an explicit 1-D mesh of all ranks (a CPU mesh on CPU)."""
    if not args.fsdp:
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world_size,))
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main():
    args = parse_ddp_args()
    rank, world, device = setup_distributed(args)
    me = f"rank {rank}"

    word_dict = load_word_dict(args.data)
    module = build_model(args, vocab_size(word_dict), sparse_grad=args.sparse_embedding).to(device)
    local = (int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    train_paths, line_shard = collective_sources(args.data, "train", rank, world, *local)
    test_paths, test_line_shard = collective_sources(args.data, "test", rank, world, *local)
    if not train_paths:
        raise UsageError(f"no train.txt-* file for rank {rank} of {world} in {args.data}")
    train = load_examples(module, train_paths, word_dict, line_shard)
    test = load_examples(module, test_paths, word_dict, test_line_shard)

    # The same number of batches a pass on every rank: the smallest.
    per_epoch = torch.tensor([-(-len(train) // args.batch_size)], device=device)
    dist.all_reduce(per_epoch, op=dist.ReduceOp.MIN)
    if int(per_epoch) == 0:
        raise UsageError(f"a rank has no {args.model} examples to train on")
    stream = BatchStream(train, args.batch_size, args.seed, rank, per_epoch=int(per_epoch))
    how = "FSDP" if args.fsdp else ("DDP, sparse embedding gradients" if args.sparse_embedding else "DDP")
    print(f"{me}/{world}: {args.model} with {how}, {len(train)} train / {len(test)} test examples, "
          f"{stream.per_epoch} batches a pass, vocabulary {vocab_size(word_dict)}", flush=True)

    model = wrap(module, args, device, world)
    optimizer = ModuleOptimizer(make_optimizer(optimizer_config(args)), module.parameters())
    log = TrainingLog(MetricsWriter(args.metrics, "trainer", rank), me, args.log_every, optimizer_config(args)["lr"])
    trainer = DDPTrainer(args, model, module, optimizer, stream, test, log, device)
    try:
        trainer.train()
        # Every rank has finished every collective before any tears its group down: a
        # rank that closes its gloo connections while a peer still has work in flight
        # can make that peer's gloo threads abort the process (SIGABRT, "terminate called
        # without an active exception"); seen once in CI at the end of a sparse-gradient
        # torchrun run. A barrier first is the usual remedy.
        dist.barrier()
    except RuntimeError as e:     # a collective failed: a peer died or timed out
        print(f"{me}: error: a collective failed (a peer exited or hung): {str(e).splitlines()[0][:300]}",
              file=sys.stderr, flush=True)
        os._exit(1)
    print(f"{me}: done after {trainer.step} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "workload.ddp"))
