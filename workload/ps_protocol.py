"""How trainers and pservers talk: torch.distributed point-to-point messages over gloo.

The world is every process of the job: pservers are ranks 0..P-1, trainers
ranks P..P+T-1 (rendezvous.py). A trainer talks to every pserver; pservers and
trainers never talk among themselves.

Every message is a fixed-size header (HEADER_LEN int64) and, when it carries
data, one uint8 body. gloo needs the receiver to post a buffer of exactly the
sender's size (it aborts the process otherwise) and cannot send sparse
tensors, so the header says how many ids each table carries and both sides
compute the body size from it and from the Layout. A body is the int64
section (row ids), then the float32 section (values), then raw bytes (JSON).

Trainer -> pserver                              pserver -> trainer
  CONFIG  trainer 0 first: layout, optimiser,     (no reply)
          sgd mode as JSON + initial dense values
  HELLO                                           REPLY step = steps already applied (resume)
  PULL    ids wanted, per table                   REPLY dense block values + the rows
  STEP    gradient of one batch (dense block +    REPLY (after the sync barrier) dense values
          rows' ids and gradients) and the ids      + the rows of the next batch
          of the next batch
  DONE    this trainer has finished               REPLY
  ABORT   this trainer lost another peer          (no reply)
A pserver that loses a peer answers ABORTED, naming it, instead of REPLY.
"""
import json
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from workload.tables import TableSpec

CONFIG, HELLO, PULL, STEP, DONE, ABORT, REPLY, ABORTED = range(1, 9)
KIND_NAMES = {CONFIG: "CONFIG", HELLO: "HELLO", PULL: "PULL", STEP: "STEP", DONE: "DONE",
              ABORT: "ABORT", REPLY: "REPLY", ABORTED: "ABORTED"}
PSERVER, TRAINER = 0, 1           # roles, as named in ABORT / ABORTED headers
MAX_TABLES = 4
HEADER_TAG, BODY_TAG, REPLY_HEADER_TAG, REPLY_BODY_TAG = 1, 2, 3, 4


def role_name(role, rank):
    return f"{'pserver' if role == PSERVER else 'trainer'} {rank}"


@dataclass
class Header:
    kind: int
    trainer: int = 0
    step: int = 0           # STEP: the trainer's batch number; HELLO reply: steps already applied
    version: int = 0        # STEP: version its gradient was computed on; REPLY: the pserver's version now
    discarded: int = 0      # REPLY: this trainer's gradients discarded as too old (async)
    lost_role: int = 0      # ABORT / ABORTED: the peer that was lost
    lost_rank: int = 0
    want_dense: int = 0     # PULL: send the dense block too
    config_bytes: int = 0   # CONFIG: length of the JSON
    push: list = field(default_factory=lambda: [0] * MAX_TABLES)   # rows whose gradients are sent, per table
    pull: list = field(default_factory=lambda: [0] * MAX_TABLES)   # rows asked for, per table

    SCALARS = ("kind", "trainer", "step", "version", "discarded", "lost_role", "lost_rank",
               "want_dense", "config_bytes")

    def tensor(self):
        values = [getattr(self, name) for name in self.SCALARS] + list(self.push) + list(self.pull)
        return torch.tensor(values, dtype=torch.long)

    @classmethod
    def from_tensor(cls, t):
        values = t.tolist()
        n = len(cls.SCALARS)
        header = cls(**dict(zip(cls.SCALARS, values[:n])))
        header.push, header.pull = values[n:n + MAX_TABLES], values[n + MAX_TABLES:n + 2 * MAX_TABLES]
        return header


HEADER_LEN = len(Header.SCALARS) + 2 * MAX_TABLES


@dataclass(frozen=True)
class Layout:
    """Where every parameter lives.

    Dense parameters are flattened into one vector (in named_parameters
    order) and cut into P x ports_num equal blocks; block b lives on pserver
    b mod P (PaddlePaddle spreads blocks the same way). Row r of a sparse
    table lives on pserver r mod P, at local index r // P.
    """
    num_pservers: int
    blocks_per_pserver: int
    dense_numel: int
    tables: tuple = ()

    def blocks(self):
        n = self.num_pservers * self.blocks_per_pserver
        edges = [self.dense_numel * i // n for i in range(n + 1)]
        return list(zip(edges[:-1], edges[1:]))

    def dense_ranges(self, pserver):
        return [b for i, b in enumerate(self.blocks()) if i % self.num_pservers == pserver]

    def dense_numel_on(self, pserver):
        return sum(end - start for start, end in self.dense_ranges(pserver))

    def split_dense(self, flat):
        """One tensor per pserver: the concatenation of its blocks of `flat`."""
        return [torch.cat([flat[s:e] for s, e in self.dense_ranges(p)]) if self.dense_numel_on(p) else flat[:0]
                for p in range(self.num_pservers)]

    def join_dense(self, parts, out):
        """The inverse of split_dense, written into `out`."""
        for p, part in enumerate(parts):
            offset = 0
            for s, e in self.dense_ranges(p):
                out[s:e].copy_(part[offset:offset + e - s])
                offset += e - s
        return out

    def local_rows(self, spec, pserver):
        return (spec.num_rows - pserver + self.num_pservers - 1) // self.num_pservers

    def global_ids(self, spec, pserver):
        """The ids of the rows pserver `pserver` holds, in local order."""
        return torch.arange(pserver, spec.num_rows, self.num_pservers)

    def to_json(self):
        return dict(num_pservers=self.num_pservers, blocks_per_pserver=self.blocks_per_pserver,
                    dense_numel=self.dense_numel, tables=[t.to_json() for t in self.tables])

    @classmethod
    def from_json(cls, d):
        return cls(d["num_pservers"], d["blocks_per_pserver"], d["dense_numel"],
                   tuple(TableSpec(**t) for t in d["tables"]))


# ---------------------------------------------------------------------------
# Body sizes: (int64 count, float32 count, raw bytes), computed the same way by both ends.

def request_sizes(header, layout, pserver):
    if header.kind == CONFIG:     # the JSON; the initial dense values follow as a second body
        return 0, 0, header.config_bytes
    if header.kind == PULL:
        return sum(header.pull), 0, 0
    if header.kind == STEP:
        pushed_rows = sum(n * t.dim for n, t in zip(header.push, layout.tables))
        return sum(header.push) + sum(header.pull), layout.dense_numel_on(pserver) + pushed_rows, 0
    return 0, 0, 0


def reply_sizes(request, layout, pserver):
    pulled_rows = sum(n * t.dim for n, t in zip(request.pull, layout.tables))
    if request.kind == PULL:
        return 0, (layout.dense_numel_on(pserver) if request.want_dense else 0) + pulled_rows, 0
    if request.kind == STEP:
        return 0, layout.dense_numel_on(pserver) + pulled_rows, 0
    return 0, 0, 0


def body_bytes(sizes):
    n_int, n_float, n_raw = sizes
    return 8 * n_int + 4 * n_float + n_raw


def pack(ints=(), floats=(), raw=b""):
    """One uint8 tensor: int64 section, float32 section, raw bytes (each section stays aligned)."""
    parts = [t.reshape(-1).contiguous().view(torch.uint8) for t in ints]
    parts += [t.reshape(-1).float().contiguous().view(torch.uint8) for t in floats]
    if raw:
        parts.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(body, sizes):
    """(int64 tensor, float32 tensor, raw bytes) of a body packed with these sizes."""
    n_int, n_float, n_raw = sizes
    ints = body[:8 * n_int].view(torch.long)
    floats = body[8 * n_int:8 * n_int + 4 * n_float].view(torch.float32)
    raw = bytes(body[8 * n_int + 4 * n_float:].tolist()) if n_raw else b""
    return ints, floats, raw


def split_sizes(flat, sizes):
    """Split a 1-D tensor into consecutive pieces of these lengths."""
    return list(torch.split(flat, list(sizes))) if len(flat) else [flat[:0] for _ in sizes]


def config_json(config):
    return json.dumps(config, sort_keys=True).encode()


# ---------------------------------------------------------------------------
# Point-to-point with one peer. gloo's errors become PeerLost, naming the peer.

class PeerLost(Exception):
    def __init__(self, role, rank, reason, host=None):
        where = f" ({host})" if host else ""
        super().__init__(f"lost {role_name(role, rank)}{where}: {reason}")
        self.role, self.rank, self.reason = role, rank, reason


def describe_gloo_error(error, timeout):
    text = str(error)
    if "Timed out" in text or "timed out" in text:
        return f"no message within {timeout:g} s (the process-group timeout)"
    if "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
        return "connection closed (the process exited or its machine is unreachable)"
    return text.splitlines()[0][:300]


class Peer:
    """The messages exchanged with one peer process (global rank `rank`)."""

    def __init__(self, role, index, rank, timeout, host=None):
        self.role, self.index, self.rank, self.timeout, self.host = role, index, rank, timeout, host

    def lost(self, error):
        return PeerLost(self.role, self.index, describe_gloo_error(error, self.timeout), self.host)

    def send(self, header, body=None, reply=False):
        """Start sending; returns the works to wait on."""
        tags = (REPLY_HEADER_TAG, REPLY_BODY_TAG) if reply else (HEADER_TAG, BODY_TAG)
        try:
            works = [dist.isend(header.tensor(), self.rank, tag=tags[0])]
            if body is not None and body.numel():
                works.append(dist.isend(body, self.rank, tag=tags[1]))
            return works
        except RuntimeError as e:
            raise self.lost(e) from None

    def send_body(self, body):
        """A further body after the first (CONFIG's initial values)."""
        try:
            return [dist.isend(body, self.rank, tag=BODY_TAG)] if body.numel() else []
        except RuntimeError as e:
            raise self.lost(e) from None

    def wait(self, works, timeout=None):
        try:
            for work in works:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            raise self.lost(e) from None

    def post_recv_header(self, reply=False):
        """Start receiving a header: (buffer, works)."""
        buf = torch.empty(HEADER_LEN, dtype=torch.long)
        try:
            return buf, [dist.irecv(buf, self.rank, tag=REPLY_HEADER_TAG if reply else HEADER_TAG)]
        except RuntimeError as e:
            raise self.lost(e) from None

    def recv_header(self, reply=False):
        buf = torch.empty(HEADER_LEN, dtype=torch.long)
        try:
            dist.recv(buf, self.rank, tag=REPLY_HEADER_TAG if reply else HEADER_TAG)
        except RuntimeError as e:
            raise self.lost(e) from None
        return Header.from_tensor(buf)

    def post_recv_body(self, nbytes, reply=False):
        """Start receiving a body of nbytes: (buffer, works)."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if not nbytes:
            return buf, []
        try:
            return buf, [dist.irecv(buf, self.rank, tag=REPLY_BODY_TAG if reply else BODY_TAG)]
        except RuntimeError as e:
            raise self.lost(e) from None

    def recv_body(self, nbytes, reply=False):
        buf, works = self.post_recv_body(nbytes, reply)
        self.wait(works)
        return buf


class JobAborted(Exception):
    """A pserver ended the job because it lost a peer, and said which."""

    def __init__(self, pserver, header):
        super().__init__(f"pserver {pserver} ended the job: it lost {role_name(header.lost_role, header.lost_rank)}")
