"""A pserver's side of the protocol: one thread per trainer answers its messages.

TrainerLoop.serve(t) runs in trainer t's thread and answers HELLO (where
to resume), PULL (rows and dense values), STEP (gradients in, fresh values
out; sync SGD answers once the round is applied), DONE and ABORT, reading
and updating the ParameterShard (ps_shard.py) under its lock.

The first peer lost ends the job (`failure`): every thread then tells its
trainer which peer it was (ABORTED), so each trainer's message can name it.

TrainerWatch notes since when each thread has been blocked on its own
trainer; the main thread (pserver.py) asks it which trainers are silent.
"""
import time

import torch

from workload.ps_protocol import (ABORT, ABORTED, DONE, HELLO, PULL, REPLY, STEP, TRAINER, Header, PeerLost,
                                  body_bytes, carries_dense, request_sizes, split_sizes, unpack)


class Aborted(Exception):
    """The job failed elsewhere; this thread's trainer has been told."""


class TrainerWatch:
    """Since when each trainer's thread has been blocked on that trainer:
    receiving from it or sending to it (a stopped trainer blocks a large
    reply too), but not waiting at the barrier for the others."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.since = {}

    def blocked(self, t):
        self.since[t] = time.monotonic()

    def released(self, t):
        self.since.pop(t, None)

    def is_blocked(self, t):
        return t in self.since

    def silent(self):
        """A PeerLost for every trainer whose thread has been blocked on it
        (a message not coming, or a reply not taken) for --timeout less a
        margin (a tenth of it, at least a second when the timeout allows).

        gloo's own timeout would fire at --timeout, but it closes every
        connection of the process, so the trainers waiting at the barrier
        could no longer be told which peer was lost. Acting a little earlier
        keeps the connections up for that message; the margin is wide enough
        that a busy machine delaying this 0.1 s check does not lose the race.
        """
        timeout = self.timeout
        margin = max(0.1 * timeout, min(1.0, 0.5 * timeout))
        limit = timeout - margin
        return [PeerLost(TRAINER, t, f"no message within {limit:g} s ({margin:g} s before --timeout)")
                for t, since in list(self.since.items()) if time.monotonic() - since > limit]


class TrainerLoop:
    def __init__(self, trainers, shard, watch):
        self.trainers = trainers      # ps_protocol.Peer of each trainer
        self.shard = shard
        self.watch = watch
        self.failure = None           # the first PeerLost; ends the job (guarded by shard.cond)

    def fail(self, lost):
        with self.shard.cond:
            if self.failure is None:
                self.failure = lost
            self.shard.cond.notify_all()

    def serve(self, t):
        """Answer trainer t until it is done or the job fails (the thread's target)."""
        peer, shard = self.trainers[t], self.shard
        try:
            while True:
                self.watch.blocked(t)
                header = peer.recv_header()
                if self.failure is not None:
                    raise Aborted()
                if header.kind == HELLO:
                    with shard.cond:
                        reply = Header(REPLY, step=shard.trainer_steps[t], version=shard.version)
                    peer.wait(peer.send(reply, reply=True))
                elif header.kind == PULL:
                    self.answer_pull(peer, header)
                elif header.kind == STEP:
                    self.answer_step(peer, header)
                elif header.kind == DONE:
                    shard.finish(t)
                    peer.wait(peer.send(Header(REPLY, version=shard.version), reply=True))
                    return
                elif header.kind == ABORT:
                    raise PeerLost(header.lost_role, header.lost_rank, f"reported by trainer {t}")
                else:
                    raise PeerLost(TRAINER, t, f"sent an unknown message kind {header.kind}")
        except PeerLost as lost:
            self.fail(lost)
        except Aborted:
            self.watch.released(t)   # the main thread's abort waits for this thread to tell its trainer
            self.tell_aborted(peer)
        finally:
            self.watch.released(t)

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
        shard = self.shard
        sizes = request_sizes(header, shard.layout)
        body, works = peer.post_recv_body(body_bytes(sizes))
        dense = None
        if carries_dense(header, reply=False) and len(shard.dense):
            dense = peer.scratch(("dense", False), 4 * len(shard.dense)).view(torch.float32)
            works += peer.post_recv_dense(shard.layout.local_blocks(dense, shard.id))
        peer.wait(works)
        ints, floats, _ = unpack(body, sizes)
        return ints, floats, dense

    def answer_pull(self, peer, header):
        shard = self.shard
        ints, _, _ = self.receive_body(peer, header)
        pull_ids = split_sizes(ints, header.pull[:len(shard.layout.tables)])
        with shard.cond:
            body, dense = shard.read(pull_ids, header.want_dense)
            reply = Header(REPLY, version=shard.version)
        peer.wait(peer.send(reply, body, dense, reply=True))

    def answer_step(self, peer, header):
        t, shard = header.trainer, self.shard
        ints, floats, dense_grad = self.receive_body(peer, header)
        gradients, pull_ids = self.decode_step(header, ints, floats, dense_grad)
        with shard.cond:
            if self.failure is not None:
                raise Aborted()
            if shard.sync:
                # The barrier: the last trainer of the round applies it; the others wait for it.
                this_round = shard.version
                self.watch.released(t)            # now trainer t waits for the others
                shard.join_round(t, header.step, gradients)
                shard.cond.wait_for(lambda: shard.version > this_round or self.failure is not None)
                if self.failure is not None:
                    raise Aborted()
                self.watch.blocked(t)             # sending the reply
            else:
                shard.apply_async(t, header.step, header.version, gradients)
            body, dense = shard.read(pull_ids, want_dense=True)
            reply = Header(REPLY, version=shard.version, discarded=shard.discarded[t])
        peer.wait(peer.send(reply, body, dense, reply=True))

    def decode_step(self, header, ints, floats, dense_grad):
        """(gradients, pull ids) of a STEP. gradients: (dense gradient, [(rows, gradient rows) per table])."""
        tables = self.shard.layout.tables
        n_tables = len(tables)
        push, pull = header.push[:n_tables], header.pull[:n_tables]
        push_ids = split_sizes(ints[:sum(push)], push)
        pull_ids = split_sizes(ints[sum(push):], pull)
        dims = [spec.dim for spec in tables]
        row_grads = split_sizes(floats, [n * d for n, d in zip(push, dims)])
        rows = [(ids, g.view(len(ids), d)) for ids, g, d in zip(push_ids, row_grads, dims)]
        return (dense_grad, rows), pull_ids
