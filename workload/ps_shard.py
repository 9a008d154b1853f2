"""A pserver's share of the model, the rules that update it, and its checkpoints.

A ParameterShard holds the dense blocks and sparse-table rows one pserver
serves (the Layout says which), their optimiser state, and the counters a
checkpoint keeps with them. The trainers' threads (ps_serve.py) update it
and the main thread (pserver.py) saves it, always holding `cond`:

* sync SGD: a round's gradients wait in `pending` until every active
  trainer has sent one; then one update with their average, added up in
  trainer order;
* async SGD: a gradient is applied at once, unless it was computed on
  parameters too many updates old (PaddlePaddle's lagged-gradient rule);
* every `checkpoint_every` updates, and when the pserver stops, a
  checkpoint (checkpoint.py).
"""
import threading

import torch

from workload import checkpoint
from workload.config import UsageError
from workload.optim import new_state, update_rows
from workload.ps_protocol import pack


class ParameterShard:
    def __init__(self, pserver_id, config, layout, optimizer, dense, tables, *, num_trainers, max_lag,
                 checkpoint_dir, checkpoint_every, log):
        """dense: this pserver's dense blocks, concatenated; tables: name -> its rows here."""
        self.id = pserver_id
        self.config, self.layout, self.optimizer = config, layout, optimizer
        self.sync = config["sgd"] == "sync"
        self.max_lag = max_lag
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.log = log
        self.dense, self.dense_state = dense, new_state(optimizer, dense)
        self.tables = tables
        self.table_state = {name: new_state(optimizer, rows) for name, rows in tables.items()}

        # Everything below (and the values above) is guarded by `cond`.
        self.cond = threading.Condition()
        self.version = 0                                 # updates applied so far
        self.trainer_steps = [0] * num_trainers          # batches of each trainer applied (or discarded)
        self.discarded = [0] * num_trainers              # async: gradients dropped as too old
        self.active = set(range(num_trainers))           # trainers that have not said DONE
        self.pending = {}                                # sync: trainer -> (step, gradients) of this round
        self.last_saved = None

    # -- reading (callers hold `cond`) -----------------------------------------

    def read(self, pull_ids, want_dense):
        """The reply: (body of the asked-for rows, dense blocks to send or [])."""
        body = pack(floats=[self.tables[spec.name].index_select(0, ids)
                            for spec, ids in zip(self.layout.tables, pull_ids)])
        if not want_dense or not len(self.dense):
            return body, []
        # Sync SGD may send the dense block itself: the next update needs every trainer's next
        # STEP, which each sends only once its reply has arrived. Async updates at any time: copy.
        dense = self.dense if self.sync else self.dense.clone()
        return body, self.layout.local_blocks(dense, self.id)

    # -- updates (callers hold `cond`, but finish() takes it) ------------------

    def join_round(self, t, step, gradients):
        """Sync: trainer t's gradients for this round; applies the round if t was the last."""
        self.pending[t] = (step, gradients)
        self.apply_round_if_complete()

    def apply_round_if_complete(self):
        if not self.pending or not self.active <= set(self.pending):
            return
        # In trainer order, never arrival order: float addition is not associative, so this keeps
        # sync SGD reproducible bit for bit however the trainers' messages race (tests/test_workload.py).
        self.apply([g for _, (_, g) in sorted(self.pending.items())])
        for t, (step, _) in self.pending.items():
            self.trainer_steps[t] = step + 1
        self.pending.clear()
        self.updated()

    def apply_async(self, t, step, based_on, gradients):
        """Async: trainer t's gradients of its batch `step`, computed on parameters of version `based_on`."""
        # PaddlePaddle's lagged-gradient rule: drop a gradient computed on parameters
        # more than ratio x trainers updates old; it would pull the model backwards.
        if self.version - based_on > self.max_lag:
            self.discarded[t] += 1
        else:
            self.apply([gradients])
            self.updated()
        self.trainer_steps[t] = step + 1

    def apply(self, gradients):
        """One optimiser step with the average of these trainers' gradients."""
        n = len(gradients)
        if len(self.dense):
            dense = gradients[0][0]
            if n > 1:
                dense = dense.clone()
                for g in gradients[1:]:
                    dense.add_(g[0])
                dense.div_(n)
            self.optimizer.update(self.dense, dense, self.dense_state)
        for i, spec in enumerate(self.layout.tables):
            ids = torch.cat([g[1][i][0] for g in gradients])
            values = torch.cat([g[1][i][1] for g in gradients])
            if not len(ids):
                continue
            if n > 1:   # the same row from several trainers: add them up first
                ids, where = torch.unique(ids, return_inverse=True)
                values = torch.zeros(len(ids), spec.dim).index_add_(0, where, values)
                values.div_(n)
            update_rows(self.optimizer, self.tables[spec.name], self.table_state[spec.name], ids, values)

    def updated(self):
        self.version += 1
        if self.checkpoint_dir and self.version % self.checkpoint_every == 0:
            self.save()
        self.cond.notify_all()

    def finish(self, t):
        """Trainer t is done."""
        with self.cond:
            self.active.discard(t)
            if self.sync:
                self.apply_round_if_complete()   # the others may have been waiting only for t
            self.cond.notify_all()

    # -- checkpoints (callers hold `cond`) -------------------------------------

    def save(self):
        if not self.checkpoint_dir or self.last_saved == self.version:
            return
        state = {"version": self.version, "trainer_steps": list(self.trainer_steps),
                 "discarded": list(self.discarded), "config": self.config,
                 "dense": self.dense, "dense_state": self.dense_state,
                 "tables": self.tables, "table_state": self.table_state}
        checkpoint.save_atomic(state, checkpoint.pserver_path(self.checkpoint_dir, self.id, self.version))
        checkpoint.prune(self.checkpoint_dir, self.id)
        self.last_saved = self.version
        self.log(f"saved checkpoint at version {self.version}")

    def load(self, version):
        path = checkpoint.pserver_path(self.checkpoint_dir, self.id, version)
        state = checkpoint.load(path)
        for key in ("layout", "optimizer", "sgd", "num_trainers"):
            if state["config"][key] != self.config[key]:
                raise UsageError(f"{path} is from another job: its {key} differs; remove it to start afresh")
        self.version, self.trainer_steps, self.discarded = state["version"], state["trainer_steps"], state["discarded"]
        self.dense, self.dense_state = state["dense"], state["dense_state"]
        self.tables, self.table_state = state["tables"], state["table_state"]
        self.last_saved = self.version
        self.log(f"resumed from {path}")
