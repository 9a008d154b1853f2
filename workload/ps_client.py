"""The trainer's side of the parameter-server protocol (ps_protocol.py).

A PServerClient talks to every pserver at once: each request is cut by the
Layout into one message per pserver (its dense blocks, the rows it holds),
every message is sent and every reply posted before any is awaited, and the
replies are put back together: the rows asked for, per table, and the dense
values, received straight into the caller's flat vector.
"""
import torch

from workload.ps_protocol import (ABORT, ABORTED, CONFIG, DONE, HELLO, PSERVER, PULL, STEP, Header, JobAborted,
                                  Peer, PeerLost, body_bytes, carries_dense, config_json, pack, reply_sizes,
                                  split_sizes, unpack)


class PServerClient:
    def __init__(self, trainer_id, hosts, layout, timeout):
        self.trainer_id, self.layout = trainer_id, layout
        self.pservers = [Peer(PSERVER, p, p, timeout, host) for p, host in enumerate(hosts)]
        self.num_pservers = len(hosts)
        self.versions = [0] * self.num_pservers    # the version of the values last received from each
        self.discarded = [0] * self.num_pservers   # this trainer's gradients each pserver dropped (async)

    def route(self, ids_by_table):
        """For each pserver, the local ids of the rows it holds, per table; and where they go back."""
        per_pserver = [[] for _ in self.pservers]
        where = []
        for ids in ids_by_table:
            owner = ids % self.num_pservers
            masks = [owner == p for p in range(self.num_pservers)]
            for p, mask in enumerate(masks):
                per_pserver[p].append(ids[mask] // self.num_pservers)
            where.append(masks)
        return per_pserver, where

    # -- messages ----------------------------------------------------------------

    def send_config(self, config, dense_init):
        """Trainer 0 only: describe the job and give the pservers their initial dense values."""
        raw = config_json(config)
        pending = []
        for p, peer in enumerate(self.pservers):
            header = Header(CONFIG, trainer=self.trainer_id, config_bytes=len(raw))
            pending.append((peer, peer.send(header, pack(raw=raw), self.layout.dense_blocks(dense_init, p))))
        for peer, works in pending:
            peer.wait(works)

    def hello(self):
        """The step to start from: the batches every pserver has already applied for this trainer."""
        replies = self._exchange([(Header(HELLO, trainer=self.trainer_id), None, []) for _ in self.pservers])
        return min(header.step for header, _ in replies)

    def pull(self, ids_by_table, dense_out=None):
        """The rows of sorted unique ids, per table; with dense_out, the dense values land there too."""
        local, where = self.route(ids_by_table)
        requests = []
        for p in range(self.num_pservers):
            header = Header(PULL, trainer=self.trainer_id, want_dense=int(dense_out is not None))
            header.pull[:len(local[p])] = [len(ids) for ids in local[p]]
            requests.append((header, pack(ints=local[p]), []))
        return self._rows(self._exchange(requests, dense_out), ids_by_table, local, where)

    def step(self, step, dense_grad, row_grads, next_ids, dense_out):
        """Push one batch's gradients; the new dense values land in dense_out; returns the rows of next_ids.

        dense_grad: the flat dense gradient; row_grads: per table (sorted unique ids, gradient rows);
        next_ids: per table, sorted unique ids.
        """
        grad_local, grad_where = self.route([ids for ids, _ in row_grads])
        next_local, next_where = self.route(next_ids)
        requests = []
        for p in range(self.num_pservers):
            header = Header(STEP, trainer=self.trainer_id, step=step, version=self.versions[p])
            header.push[:len(grad_local[p])] = [len(ids) for ids in grad_local[p]]
            header.pull[:len(next_local[p])] = [len(ids) for ids in next_local[p]]
            rows = [grads[masks[p]] for (_, grads), masks in zip(row_grads, grad_where)]
            body = pack(ints=grad_local[p] + next_local[p], floats=rows)
            requests.append((header, body, self.layout.dense_blocks(dense_grad, p)))
        replies = self._exchange(requests, dense_out)
        for p, (header, _) in enumerate(replies):
            self.discarded[p] = header.discarded
        return self._rows(replies, next_ids, next_local, next_where)

    def done(self):
        self._exchange([(Header(DONE, trainer=self.trainer_id), None, []) for _ in self.pservers])

    def abort(self, lost):
        """Best effort: tell the other pservers which peer this trainer lost, then go."""
        for p, peer in enumerate(self.pservers):
            if lost.role == PSERVER and lost.rank == p:
                continue
            try:
                peer.wait(peer.send(Header(ABORT, trainer=self.trainer_id, lost_role=lost.role,
                                           lost_rank=lost.rank)), timeout=2.0)
            except PeerLost:
                pass

    # -- plumbing ----------------------------------------------------------------

    def _exchange(self, requests, dense_out=None):
        """Send requests[p] = (header, body, dense blocks) to pserver p, all at once; receive the
        replies' dense blocks into dense_out; return [(reply header, reply body)]."""
        posted = []
        for p, (peer, (header, body, dense)) in enumerate(zip(self.pservers, requests)):
            sends = peer.send(header, body, dense)
            header_buf, works = peer.post_recv_header(reply=True)
            body_buf, body_works = peer.post_recv_body(body_bytes(reply_sizes(header, self.layout)), reply=True)
            if carries_dense(header, reply=True):
                body_works += peer.post_recv_dense(self.layout.dense_blocks(dense_out, p), reply=True)
            posted.append((peer, sends, header_buf, works, body_buf, body_works))
        replies = []
        for p, (peer, sends, header_buf, works, body_buf, body_works) in enumerate(posted):
            peer.wait(works)
            header = Header.from_tensor(header_buf)
            if header.kind == ABORTED:
                raise JobAborted(p, header)
            peer.wait(body_works + sends)
            self.versions[p] = header.version
            replies.append((header, body_buf))
        return replies

    def _rows(self, replies, ids_by_table, local, where):
        """Put the rows of the pservers' replies back together, per table, in the order of ids_by_table."""
        tables = self.layout.tables
        rows = [torch.empty(len(ids), spec.dim) for ids, spec in zip(ids_by_table, tables)]
        for p, ((_, body), asked) in enumerate(zip(replies, local)):
            counts = [len(ids) * spec.dim for ids, spec in zip(asked, tables)]
            _, floats, _ = unpack(body, (0, sum(counts), 0))
            for i, (piece, spec) in enumerate(zip(split_sizes(floats, counts), tables)):
                rows[i][where[i][p]] = piece.view(-1, spec.dim)
        return rows
