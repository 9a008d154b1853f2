"""A parameter server: holds a share of the model and applies the trainers' gradients.

    python -m workload.pserver --port 7164 --pservers 10.0.0.1,10.0.0.2 --pserver_id 0 \\
        --num_gradient_servers 4 [--sgd sync|async] [--checkpoint_dir D --checkpoint_every N]

Every flag can come from the environment instead (PADDLE_INIT_*, FABTRAIN_RANK
for --pserver_id, FABTRAIN_CHECKPOINT_DIR...): see config.py.

A pserver's life:
  1. join the job (rendezvous.py); pserver 0 hosts the store on --port;
  2. agree with the other pservers on the checkpoint to resume from, if any;
  3. take the job's layout, optimiser and initial dense values from trainer 0
     (as a PaddlePaddle trainer 0 initialises the pservers), so a pserver
     needs no model code or data;
  4. serve, one thread per trainer: pulls, steps (sync: wait for every
     trainer, average, update once; async: update at once unless the gradient
     is too old), done;
  5. exit 0 when every trainer is done; 1, naming the peer, when one is
     lost; 143 after saving a checkpoint on SIGTERM.
"""
import json
import os
import signal
import sys
import threading
import time

import torch

from workload import checkpoint
from workload.config import UsageError, parse_pserver_args, run_main
from workload.metrics import MetricsWriter
from workload.optim import make_optimizer, new_state, update_rows
from workload.ps_protocol import (ABORT, ABORTED, CONFIG, DONE, HELLO, KIND_NAMES, PULL, REPLY, STEP, TRAINER,
                                  Header, Layout, Peer, PeerLost, body_bytes, carries_dense, pack, request_sizes,
                                  split_sizes, unpack)
from workload.rendezvous import StartupFailed, join_job
from workload.tables import init_rows

HEARTBEAT_S = 2.0


class Aborted(Exception):
    """The job failed elsewhere; this thread's trainer has been told."""


class ParameterServer:
    def __init__(self, args):
        self.args = args
        self.id = args.pserver_id
        self.num_pservers = len(args.pserver_hosts)
        self.num_trainers = args.num_gradient_servers
        self.trainers = [Peer(TRAINER, t, self.num_pservers + t, args.timeout) for t in range(self.num_trainers)]
        self.metrics = MetricsWriter(args.metrics, "pserver", self.id)

        # Everything below is guarded by `cond`: trainer threads update it, the main thread saves it.
        self.cond = threading.Condition()
        self.version = 0                                 # updates applied so far
        self.trainer_steps = [0] * self.num_trainers     # batches of each trainer applied (or discarded)
        self.discarded = [0] * self.num_trainers         # async: gradients dropped as too old
        self.active = set(range(self.num_trainers))      # trainers that have not said DONE
        self.pending = {}                                # sync: trainer -> (step, gradients) of this round
        self.failure = None                              # the first PeerLost; ends the job
        self.last_saved = None
        self.stop_requested = False
        # trainer -> since when its thread has been blocked on that trainer: receiving
        # from it or sending to it (a stopped trainer blocks a large reply too), but
        # not waiting at the barrier for the others
        self.blocked_on = {}

    def log(self, text):
        print(f"pserver {self.id}: {text}", flush=True)

    # -- setup ---------------------------------------------------------------

    def describe_rank(self, rank):
        return f"pserver {rank}" if rank < self.num_pservers else f"trainer {rank - self.num_pservers}"

    def setup(self):
        a = self.args
        self.log(f"joining: {self.num_pservers} pserver(s), {self.num_trainers} trainer(s), "
                 f"store {a.pserver_hosts[0]}:{a.port}, sgd {a.sgd}")
        store = join_job(a.pserver_hosts[0], a.port, self.id, self.num_pservers + self.num_trainers,
                         self.describe_rank, a.startup_timeout, a.timeout)
        resume = self.agree_on_resume(store)
        config = self.receive_config()
        self.check_config(config)
        if resume is not None:
            self.load(resume)
        self.log(f"serving {self.layout.dense_numel_on(self.id)} dense values and "
                 f"{sum(len(t) for t in self.tables.values())} rows of {len(self.tables)} sparse table(s), "
                 f"from version {self.version}")

    def agree_on_resume(self, store):
        """The newest checkpoint version every pserver has, or None to start fresh."""
        mine = checkpoint.pserver_versions(self.args.checkpoint_dir, self.id)
        store.set(f"checkpoints/{self.id}", json.dumps(mine))
        everyone = [json.loads(store.get(f"checkpoints/{p}")) for p in range(self.num_pservers)]
        version = checkpoint.common_version(everyone)
        if version is None and any(everyone):
            raise StartupFailed(f"the pservers' checkpoints share no version ({everyone}); "
                                "remove them to start afresh")
        return version

    def receive_config(self):
        trainer0 = self.trainers[0]
        header = trainer0.recv_header()
        if header.kind != CONFIG:
            raise PeerLost(TRAINER, 0, f"sent {KIND_NAMES.get(header.kind, header.kind)} before CONFIG")
        body, works = trainer0.post_recv_body(header.config_bytes)
        trainer0.wait(works)
        config = json.loads(unpack(body, request_sizes(header, None))[2])
        self.config = config
        self.layout = Layout.from_json(config["layout"])
        self.optimizer = make_optimizer(config["optimizer"])
        self.sync = config["sgd"] == "sync"
        self.max_lag = self.args.async_lagged_grad_discard_ratio * self.num_trainers
        # Initial values: dense blocks from trainer 0, sparse rows from the deterministic row hash.
        self.dense = torch.empty(self.layout.dense_numel_on(self.id))
        trainer0.wait(trainer0.post_recv_dense(self.layout.local_blocks(self.dense, self.id)))
        self.dense_state = new_state(self.optimizer, self.dense)
        self.tables, self.table_state = {}, {}
        for spec in self.layout.tables:
            self.tables[spec.name] = init_rows(spec, self.layout.global_ids(spec, self.id))
            self.table_state[spec.name] = new_state(self.optimizer, self.tables[spec.name])
        return config

    def check_config(self, config):
        """Trainer 0 and this pserver must describe the same job."""
        a = self.args
        mine = {"num_pservers": self.num_pservers, "num_trainers": self.num_trainers, "sgd": a.sgd,
                "ports_num": a.ports_num, "ports_num_for_sparse": a.ports_num_for_sparse}
        for key, value in mine.items():
            if config[key] != value:
                raise UsageError(f"trainer 0 has {key}={config[key]} but this pserver has {value}")

    # -- checkpoints (callers hold `cond`) -------------------------------------

    def save(self):
        if not self.args.checkpoint_dir or self.last_saved == self.version:
            return
        state = {"version": self.version, "trainer_steps": list(self.trainer_steps),
                 "discarded": list(self.discarded), "config": self.config,
                 "dense": self.dense, "dense_state": self.dense_state,
                 "tables": self.tables, "table_state": self.table_state}
        checkpoint.save_atomic(state, checkpoint.pserver_path(self.args.checkpoint_dir, self.id, self.version))
        checkpoint.prune(self.args.checkpoint_dir, self.id)
        self.last_saved = self.version
        self.log(f"saved checkpoint at version {self.version}")

    def load(self, version):
        path = checkpoint.pserver_path(self.args.checkpoint_dir, self.id, version)
        state = checkpoint.load(path)
        for key in ("layout", "optimizer", "sgd", "num_trainers"):
            if state["config"][key] != self.config[key]:
                raise UsageError(f"{path} is from another job: its {key} differs; remove it to start afresh")
        self.version, self.trainer_steps, self.discarded = state["version"], state["trainer_steps"], state["discarded"]
        self.dense, self.dense_state = state["dense"], state["dense_state"]
        self.tables, self.table_state = state["tables"], state["table_state"]
        self.last_saved = self.version
        self.log(f"resumed from {path}")

    # -- serving one trainer (runs in its own thread) --------------------------

    def serve_trainer(self, t):
        peer = self.trainers[t]
        try:
            while True:
                self.blocked_on[t] = time.monotonic()
                header = peer.recv_header()
                if self.failure is not None:
                    raise Aborted()
                if header.kind == HELLO:
                    with self.cond:
                        reply = Header(REPLY, step=self.trainer_steps[t], version=self.version)
                    peer.wait(peer.send(reply, reply=True))
                elif header.kind == PULL:
                    self.answer_pull(peer, header)
                elif header.kind == STEP:
                    self.answer_step(peer, header)
                elif header.kind == DONE:
                    self.finish(t)
                    peer.wait(peer.send(Header(REPLY, version=self.version), reply=True))
                    return
                elif header.kind == ABORT:
                    raise PeerLost(header.lost_role, header.lost_rank, f"reported by trainer {t}")
                else:
                    raise PeerLost(TRAINER, t, f"sent an unknown message kind {header.kind}")
        except PeerLost as lost:
            with self.cond:
                if self.failure is None:
                    self.failure = lost
                self.cond.notify_all()
        except Aborted:
            self.blocked_on.pop(t, None)   # abort() waits for this thread to tell its trainer
            self.tell_aborted(peer)
        finally:
            self.blocked_on.pop(t, None)

    def tell_aborted(self, peer):
        """Best effort: tell a waiting trainer which peer the job lost, so its message can name it."""
        lost = self.failure
        header = Header(ABORTED, lost_role=lost.role, lost_rank=lost.rank)
        try:
            peer.wait(peer.send(header, reply=True), timeout=2.0)
        except PeerLost:
            pass

    def receive_body(self, peer, header):
        """(ids, row values, dense gradient or None) that follow `header`."""
        sizes = request_sizes(header, self.layout)
        body, works = peer.post_recv_body(body_bytes(sizes))
        dense = None
        if carries_dense(header, reply=False) and len(self.dense):
            dense = peer.scratch(("dense", False), 4 * len(self.dense)).view(torch.float32)
            works += peer.post_recv_dense(self.layout.local_blocks(dense, self.id))
        peer.wait(works)
        ints, floats, _ = unpack(body, sizes)
        return ints, floats, dense

    def answer_pull(self, peer, header):
        ints, _, _ = self.receive_body(peer, header)
        pull_ids = split_sizes(ints, header.pull[:len(self.layout.tables)])
        with self.cond:
            body, dense = self.read(pull_ids, header.want_dense)
            reply = Header(REPLY, version=self.version)
        peer.wait(peer.send(reply, body, dense, reply=True))

    def answer_step(self, peer, header):
        t = header.trainer
        ints, floats, dense_grad = self.receive_body(peer, header)
        gradients, pull_ids = self.decode_step(header, ints, floats, dense_grad)
        with self.cond:
            if self.failure is not None:
                raise Aborted()
            if self.sync:
                # The barrier: the last trainer of the round applies it; the others wait for it.
                self.pending[t] = (header.step, gradients)
                this_round = self.version
                self.blocked_on.pop(t, None)      # now trainer t waits for the others
                self.apply_round_if_complete()
                self.cond.wait_for(lambda: self.version > this_round or self.failure is not None)
                if self.failure is not None:
                    raise Aborted()
                self.blocked_on[t] = time.monotonic()  # sending the reply
            else:
                self.apply_async(t, header, gradients)
            body, dense = self.read(pull_ids, want_dense=True)
            reply = Header(REPLY, version=self.version, discarded=self.discarded[t])
        peer.wait(peer.send(reply, body, dense, reply=True))

    def decode_step(self, header, ints, floats, dense_grad):
        """(gradients, pull ids) of a STEP. gradients: (dense gradient, [(rows, gradient rows) per table])."""
        n_tables = len(self.layout.tables)
        push, pull = header.push[:n_tables], header.pull[:n_tables]
        push_ids = split_sizes(ints[:sum(push)], push)
        pull_ids = split_sizes(ints[sum(push):], pull)
        dims = [spec.dim for spec in self.layout.tables]
        row_grads = split_sizes(floats, [n * d for n, d in zip(push, dims)])
        rows = [(ids, g.view(len(ids), d)) for ids, g, d in zip(push_ids, row_grads, dims)]
        return (dense_grad, rows), pull_ids

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

    def finish(self, t):
        with self.cond:
            self.active.discard(t)
            if self.sync:
                self.apply_round_if_complete()   # the others may have been waiting only for t
            self.cond.notify_all()

    # -- updates (callers hold `cond`) -----------------------------------------

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

    def apply_async(self, t, header, gradients):
        # PaddlePaddle's lagged-gradient rule: drop a gradient computed on parameters
        # more than ratio x trainers updates old; it would pull the model backwards.
        if self.version - header.version > self.max_lag:
            self.discarded[t] += 1
        else:
            self.apply([gradients])
            self.updated()
        self.trainer_steps[t] = header.step + 1

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
        if self.args.checkpoint_dir and self.version % self.args.checkpoint_every == 0:
            self.save()
        self.cond.notify_all()

    # -- the main thread --------------------------------------------------------

    def request_stop(self, signum, frame):
        self.stop_requested = True

    def run(self):
        # Blocking gloo calls would delay a SIGTERM until they return, so every
        # blocking step runs in a thread and the main thread only watches.
        setup = threading.Thread(target=self._capture(self.setup), daemon=True)
        setup.start()
        while setup.is_alive():
            setup.join(0.2)
            if self.stop_requested:
                self.log("SIGTERM before serving: exiting")
                return self.exit(143)
        if self.error:
            raise self.error

        threads = [threading.Thread(target=self.serve_trainer, args=(t,), daemon=True)
                   for t in range(self.num_trainers)]
        for thread in threads:
            thread.start()
        last_log = 0.0
        while any(thread.is_alive() for thread in threads):
            time.sleep(0.1)
            if self.stop_requested:     # first: under kill-all the trainers may die a moment earlier
                with self.cond:
                    self.save()
                    self.log(f"SIGTERM at version {self.version}: exiting")
                return self.exit(143)
            self.check_silence()
            if self.failure is not None:
                return self.abort(threads)
            if self.metrics.seconds_since_write() >= HEARTBEAT_S:
                self.write_metrics()
                if time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    self.log(f"version {self.version}, {len(self.active)} trainer(s) active, "
                             f"{sum(self.discarded)} gradient(s) discarded")
        if self.failure is not None:
            return self.abort(threads)
        with self.cond:
            self.save()
        self.write_metrics()
        self.log(f"all {self.num_trainers} trainer(s) done at version {self.version}")
        return self.exit(0)

    def check_silence(self):
        """Declare a trainer lost when its thread has been blocked on it (a
        message not coming, or a reply not taken) for --timeout less a margin
        (a tenth of it, at least a second when the timeout allows).

        gloo's own timeout would fire at --timeout, but it closes every
        connection of the process, so the trainers waiting at the barrier
        could no longer be told which peer was lost. Acting a little earlier
        keeps the connections up for that message; the margin is wide enough
        that a busy machine delaying this 0.1 s check does not lose the race.
        """
        timeout = self.args.timeout
        margin = max(0.1 * timeout, min(1.0, 0.5 * timeout))
        limit = timeout - margin
        for t, since in list(self.blocked_on.items()):
            if time.monotonic() - since > limit:
                with self.cond:
                    if self.failure is None:
                        self.failure = PeerLost(TRAINER, t, f"no message within {limit:g} s "
                                                            f"({margin:g} s before --timeout)")
                    self.cond.notify_all()

    def _capture(self, fn):
        self.error = None

        def target():
            try:
                fn()
            except Exception as e:     # re-raised in the main thread
                self.error = e
        return target

    def write_metrics(self):
        with self.cond:
            self.metrics.write(step=self.version, updates=self.version, discarded_gradients=sum(self.discarded),
                               trainers_active=len(self.active))

    def abort(self, threads):
        print(f"pserver {self.id}: error: {self.failure}", file=sys.stderr, flush=True)
        with self.cond:
            self.save()      # updates are applied whole under the lock: this state is consistent
        # Let the trainers waiting for a reply hear which peer was lost (threads
        # blocked on their own trainer will never finish: those learn it on their own).
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(
                thread.is_alive() and t not in self.blocked_on for t, thread in enumerate(threads)):
            time.sleep(0.05)
        return self.exit(1)

    def exit(self, code):
        # os._exit: threads may still block in gloo receives that nobody will answer.
        self.metrics.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main():
    args = parse_pserver_args()
    torch.set_num_threads(args.num_threads)
    server = ParameterServer(args)
    signal.signal(signal.SIGTERM, server.request_stop)
    try:
        return server.run()
    except UsageError as e:
        print(f"workload.pserver: error: {e}", file=sys.stderr, flush=True)
        server.exit(2)
    except (PeerLost, StartupFailed) as e:
        print(f"pserver {args.pserver_id}: error: {e}", file=sys.stderr, flush=True)
        server.exit(1)


if __name__ == "__main__":
    run_main(main, "workload.pserver")
