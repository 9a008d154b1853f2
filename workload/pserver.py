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
  4. serve, one thread per trainer (ps_serve.py): pulls, steps (sync: wait
     for every trainer, average, update once; async: update at once unless the
     gradient is too old; ps_shard.py), done;
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
from workload.optim import make_optimizer
from workload.ps_protocol import CONFIG, KIND_NAMES, TRAINER, Layout, Peer, PeerLost, request_sizes, unpack
from workload.ps_serve import TrainerLoop, TrainerWatch
from workload.ps_shard import ParameterShard
from workload.rendezvous import StartupFailed, join_job
from workload.tables import init_rows

HEARTBEAT_S = 2.0


class ParameterServer:
    """Joins the job, takes the job's configuration from trainer 0, then
    watches from the main thread while TrainerLoop serves each trainer in
    its own thread, and ends the process (exit codes in the docstring above)."""

    def __init__(self, args):
        self.args = args
        self.id = args.pserver_id
        self.num_pservers = len(args.pserver_hosts)
        self.num_trainers = args.num_gradient_servers
        self.trainers = [Peer(TRAINER, t, self.num_pservers + t, args.timeout) for t in range(self.num_trainers)]
        self.metrics = MetricsWriter(args.metrics, "pserver", self.id)
        self.watch = TrainerWatch(args.timeout)
        self.shard = None       # the parameters this pserver serves, once setup() has them
        self.stop_requested = False

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
            self.shard.load(resume)
        shard = self.shard
        self.log(f"serving {shard.layout.dense_numel_on(self.id)} dense values and "
                 f"{sum(len(t) for t in shard.tables.values())} rows of {len(shard.tables)} sparse table(s), "
                 f"from version {shard.version}")

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
        layout = Layout.from_json(config["layout"])
        optimizer = make_optimizer(config["optimizer"])
        # Initial values: dense blocks from trainer 0, sparse rows from the deterministic row hash.
        dense = torch.empty(layout.dense_numel_on(self.id))
        trainer0.wait(trainer0.post_recv_dense(layout.local_blocks(dense, self.id)))
        tables = {spec.name: init_rows(spec, layout.global_ids(spec, self.id)) for spec in layout.tables}
        a = self.args
        self.shard = ParameterShard(self.id, config, layout, optimizer, dense, tables,
                                    num_trainers=self.num_trainers,
                                    max_lag=a.async_lagged_grad_discard_ratio * self.num_trainers,
                                    checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every,
                                    log=self.log)
        return config

    def check_config(self, config):
        """Trainer 0 and this pserver must describe the same job."""
        a = self.args
        mine = {"num_pservers": self.num_pservers, "num_trainers": self.num_trainers, "sgd": a.sgd,
                "ports_num": a.ports_num, "ports_num_for_sparse": a.ports_num_for_sparse}
        for key, value in mine.items():
            if config[key] != value:
                raise UsageError(f"trainer 0 has {key}={config[key]} but this pserver has {value}")

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

        loop = TrainerLoop(self.trainers, self.shard, self.watch)
        threads = [threading.Thread(target=loop.serve, args=(t,), daemon=True)
                   for t in range(self.num_trainers)]
        for thread in threads:
            thread.start()
        last_log = 0.0
        while any(thread.is_alive() for thread in threads):
            time.sleep(0.1)
            if self.stop_requested:     # first: under kill-all the trainers may die a moment earlier
                with self.shard.cond:
                    self.shard.save()
                    self.log(f"SIGTERM at version {self.shard.version}: exiting")
                return self.exit(143)
            for lost in self.watch.silent():
                loop.fail(lost)
            if loop.failure is not None:
                return self.abort(loop, threads)
            if self.metrics.seconds_since_write() >= HEARTBEAT_S:
                self.write_metrics()
                if time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    self.log(f"version {self.shard.version}, {len(self.shard.active)} trainer(s) active, "
                             f"{sum(self.shard.discarded)} gradient(s) discarded")
        if loop.failure is not None:
            return self.abort(loop, threads)
        with self.shard.cond:
            self.shard.save()
        self.write_metrics()
        self.log(f"all {self.num_trainers} trainer(s) done at version {self.shard.version}")
        return self.exit(0)

    def _capture(self, fn):
        self.error = None

        def target():
            try:
                fn()
            except Exception as e:     # re-raised in the main thread
                self.error = e
        return target

    def write_metrics(self):
        shard = self.shard
        with shard.cond:
            self.metrics.write(step=shard.version, updates=shard.version, discarded_gradients=sum(shard.discarded),
                               trainers_active=len(shard.active))

    def abort(self, loop, threads):
        print(f"pserver {self.id}: error: {loop.failure}", file=sys.stderr, flush=True)
        with self.shard.cond:
            self.shard.save()      # updates are applied whole under the lock: this state is consistent
        # Let the trainers waiting for a reply hear which peer was lost (threads
        # blocked on their own trainer will never finish: those learn it on their own).
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(
                thread.is_alive() and not self.watch.is_blocked(t) for t, thread in enumerate(threads)):
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
