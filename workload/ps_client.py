"""The trainer's side of the parameter-server protocol (ps_protocol.py).

A PServerClient talks to every pserver at once: each request is cut by the
Layout into one message per pserver (its dense blocks, the rows it holds),
all are sent before any reply is awaited, and the replies are put back
together into the whole dense vector and the rows asked for.
"""
import torch

from workload.ps_protocol import (ABORT, ABORTED, CONFIG, DONE, HELLO, PSERVER, PULL, STEP, Header, JobAborted,
                                  Peer, PeerLost, body_bytes, config_json, pack, reply_sizes, split_sizes, unpack)


class PServerClient:
    def __init__(self, trainer_id, hosts, layout, timeout):
        self.trainer_id, self.layout = trainer_id, layout
        self.pservers = [Peer(PSERVER, p, p, timeout, host) for p, host in enumerate(hosts)]
        self.num_pservers = len(hosts)
        self.versions = [0] * self.num_pservers    # the version of the values last received from each
        self.discarded = [0] * self.num_pservers   # this trainer's gradients each pserver dropped (async)

    # -- routing ---------------------------------------------------------------

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
        parts = self.layout.split_dense(dense_init)
        pending = []
        for p, peer in enumerate(self.pservers):
            works = peer.send(Header(CONFIG, trainer=self.trainer_id, config_bytes=len(raw)), pack(raw=raw))
            pending.append((peer, works + peer.send_body(parts[p].contiguous())))
        for peer, works in pending:
            peer.wait(works)

    def hello(self):
        """The step to start from: the batches every pserver has already applied for this trainer."""
        replies = self._exchange([(Header(HELLO, trainer=self.trainer_id), None) for _ in self.pservers])
        return min(header.step for header, _ in replies)

    def pull(self, ids_by_table, want_dense):
        """(dense vector or None, rows per table) for sorted unique ids per table."""
        local, where = self.route(ids_by_table)
        requests = []
        for p in range(self.num_pservers):
            header = Header(PULL, trainer=self.trainer_id, want_dense=int(want_dense))
            header.pull[:len(local[p])] = [len(ids) for ids in local[p]]
            requests.append((header, pack(ints=local[p])))
        return self._unpack_values(self._exchange(requests), ids_by_table, local, where, want_dense)

    def step(self, step, dense_grad, row_grads, next_ids):
        """Push one batch's gradients, get the new dense values and the rows of `next_ids`.

        row_grads: per table (sorted unique ids, gradient rows); next_ids: per table, sorted unique ids.
        """
        grad_local, grad_where = self.route([ids for ids, _ in row_grads])
        next_local, next_where = self.route(next_ids)
        dense_parts = self.layout.split_dense(dense_grad)
        requests = []
        for p in range(self.num_pservers):
            header = Header(STEP, trainer=self.trainer_id, step=step, version=self.versions[p])
            header.push[:len(grad_local[p])] = [len(ids) for ids in grad_local[p]]
            header.pull[:len(next_local[p])] = [len(ids) for ids in next_local[p]]
            rows = [grads[masks[p]] for (_, grads), masks in zip(row_grads, grad_where)]
            requests.append((header, pack(ints=grad_local[p] + next_local[p], floats=[dense_parts[p]] + rows)))
        replies = self._exchange(requests)
        for p, (header, _) in enumerate(replies):
            self.discarded[p] = header.discarded
        return self._unpack_values(replies, next_ids, next_local, next_where, True)

    def done(self):
        self._exchange([(Header(DONE, trainer=self.trainer_id), None) for _ in self.pservers])

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

    def _exchange(self, requests):
        """Send requests[p] to pserver p, all at once; return [(reply header, reply body)]."""
        posted = []
        for p, (peer, (header, body)) in enumerate(zip(self.pservers, requests)):
            sends = peer.send(header, body)
            header_buf, header_works = peer.post_recv_header(reply=True)
            body_buf, body_works = peer.post_recv_body(body_bytes(reply_sizes(header, self.layout, p)), reply=True)
            posted.append((peer, sends, header_buf, header_works, body_buf, body_works))
        replies = []
        for p, (peer, sends, header_buf, header_works, body_buf, body_works) in enumerate(posted):
            peer.wait(header_works)
            header = Header.from_tensor(header_buf)
            if header.kind == ABORTED:
                raise JobAborted(p, header)
            peer.wait(body_works + sends)
            replies.append((header, body_buf))
        return replies

    def _unpack_values(self, replies, ids_by_table, local, where, want_dense):
        """Put the pservers' replies back together: (dense vector or None, rows per table)."""
        layout = self.layout
        dense_parts, rows = [], [torch.empty(len(ids), spec.dim) for ids, spec in zip(ids_by_table, layout.tables)]
        for p, ((header, body), request_ids) in enumerate(zip(replies, local)):
            self.versions[p] = header.version
            n_dense = layout.dense_numel_on(p) if want_dense else 0
            counts = [len(ids) for ids in request_ids]
            _, floats, _ = unpack(body, (0, n_dense + sum(n * t.dim for n, t in zip(counts, layout.tables)), 0))
            dense_parts.append(floats[:n_dense])
            pieces = split_sizes(floats[n_dense:], [n * t.dim for n, t in zip(counts, layout.tables)])
            for i, (piece, spec) in enumerate(zip(pieces, layout.tables)):
                rows[i][where[i][p]] = piece.view(-1, spec.dim)
        dense = None
        if want_dense and layout.dense_numel:
            dense = layout.join_dense(dense_parts, torch.empty(layout.dense_numel))
        return dense, rows
