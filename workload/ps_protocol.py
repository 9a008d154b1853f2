"""How trainers and pservers talk: torch.distributed point-to-point messages over gloo.

The world is every process of the job: pservers are ranks 0..P-1, trainers
ranks P..P+T-1 (rendezvous.py). A trainer talks to every pserver; pservers and
trainers never talk among themselves.

A message is
  * a fixed-size header (HEADER_LEN int64);
  * when it has any, one uint8 body: the int64 section (row ids), the float32
    section (row values or gradients), then raw bytes (JSON);
  * when it has any, the dense blocks this pserver holds, one gloo message
    each, sent straight from and received straight into their place in the
    flat dense vectors: a block is never copied to be packed or unpacked.
gloo needs the receiver to post a buffer of exactly the sender's size (it
aborts the process otherwise) and cannot send sparse tensors, so the header
says how many ids each table carries, and both ends compute every size from
the header and the Layout. Header, body and dense blocks travel under
different tags, so each is matched in order on its own.

Trainer -> pserver                              pserver -> trainer
  CONFIG  trainer 0 first: layout, optimiser,     (no reply)
          sgd mode as JSON; initial dense blocks
  HELLO                                           REPLY step = steps already applied (resume)
  PULL    ids wanted, per table                   REPLY the rows [+ dense blocks if want_dense]
  STEP    gradient of one batch: the rows' ids    REPLY (sync: once every trainer's gradient
          and gradients, the dense blocks' gradi-   is in) the rows of the next batch + the
          ents; and the ids the next batch needs    dense blocks
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
TAGS = {False: (1, 2, 3), True: (4, 5, 6)}   # (header, body, dense) tags of requests / replies


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

    def dense_blocks(self, flat, pserver):
        """Views of pserver's blocks in `flat`, the whole dense vector (trainer side)."""
        return [flat[s:e] for s, e in self.dense_ranges(pserver)]

    def local_blocks(self, local, pserver):
        """The same blocks as views of `local`, the concatenation of pserver's blocks (pserver side)."""
        views, offset = [], 0
        for s, e in self.dense_ranges(pserver):
            views.append(local[offset:offset + e - s])
            offset += e - s
        return views

    def join_dense(self, parts, out):
        """The whole dense vector, into `out`, from each pserver's concatenated blocks (checkpoints)."""
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

def request_sizes(header, layout):
    """(int64 count, float32 count, raw bytes) of a request's body."""
    if header.kind == CONFIG:
        return 0, 0, header.config_bytes
    if header.kind == PULL:
        return sum(header.pull), 0, 0
    if header.kind == STEP:
        pushed_rows = sum(n * t.dim for n, t in zip(header.push, layout.tables))
        return sum(header.push) + sum(header.pull), pushed_rows, 0
    return 0, 0, 0


def reply_sizes(request, layout):
    """The same for the reply to `request`."""
    if request.kind in (PULL, STEP):
        return 0, sum(n * t.dim for n, t in zip(request.pull, layout.tables)), 0
    return 0, 0, 0


def carries_dense(header, reply):
    """Whether a request (or the reply to it) is followed by the pserver's dense blocks."""
    if reply:
        return header.kind == STEP or (header.kind == PULL and bool(header.want_dense))
    return header.kind in (CONFIG, STEP)


def body_bytes(sizes):
    n_int, n_float, n_raw = sizes
    return 8 * n_int + 4 * n_float + n_raw


def pack(ints=(), floats=(), raw=b""):
    """One uint8 tensor: int64 section, float32 section, raw bytes (each section stays aligned)."""
    parts = [t.reshape(-1).contiguous().view(torch.uint8) for t in ints]
    parts += [t.reshape(-1).float().contiguous().view(torch.uint8) for t in floats]
    if raw:
        parts.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    if len(parts) == 1:
        return parts[0]            # a view: no copy of a large dense block
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
        # Received into buffers kept per peer and reused: a fresh multi-megabyte tensor a message
        # would cost page faults every step. What is read from one is used up (applied, or copied
        # into the model) before the next message from the same peer can arrive.
        self.buffers = {}

    def lost(self, error):
        return PeerLost(self.role, self.index, describe_gloo_error(error, self.timeout), self.host)

    def scratch(self, key, nbytes):
        if len(self.buffers.get(key, ())) < nbytes:
            self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffers[key][:nbytes]

    def send(self, header, body=None, dense=(), reply=False):
        """Start sending a message; returns the works to wait on."""
        header_tag, body_tag, dense_tag = TAGS[reply]
        try:
            works = [dist.isend(header.tensor(), self.rank, tag=header_tag)]
            if body is not None and body.numel():
                works.append(dist.isend(body, self.rank, tag=body_tag))
            works += [dist.isend(block, self.rank, tag=dense_tag) for block in dense if block.numel()]
            return works
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
            return buf, [dist.irecv(buf, self.rank, tag=TAGS[reply][0])]
        except RuntimeError as e:
            raise self.lost(e) from None

    def recv_header(self, reply=False):
        buf, works = self.post_recv_header(reply)
        self.wait(works)
        return Header.from_tensor(buf)

    def post_recv_body(self, nbytes, reply=False):
        """Start receiving a body of nbytes into this peer's reused buffer: (buffer, works)."""
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8), []
        buf = self.scratch(("body", reply), nbytes)
        try:
            return buf, [dist.irecv(buf, self.rank, tag=TAGS[reply][1])]
        except RuntimeError as e:
            raise self.lost(e) from None

    def post_recv_dense(self, blocks, reply=False):
        """Start receiving dense blocks, each straight into its view `blocks[i]`: works."""
        try:
            return [dist.irecv(block, self.rank, tag=TAGS[reply][2]) for block in blocks if block.numel()]
        except RuntimeError as e:
            raise self.lost(e) from None


class JobAborted(Exception):
    """A pserver ended the job because it lost a peer, and said which."""

    def __init__(self, pserver, header):
        super().__init__(f"pserver {pserver} ended the job: it lost {role_name(header.lost_role, header.lost_rank)}")
