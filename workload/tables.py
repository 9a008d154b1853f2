"""Embedding tables that can live on the parameter servers, row by row.

A TableSpec describes a table (rows, width, how to initialise it). The same
spec gives either a local nn.Embedding (DDP, single process) or a RowTable,
which holds only the rows of the current batch: the trainer pulls those rows
from the pservers, and pushes back only their gradients, so a trainer never
holds a large table whole.

Initial values are a hash of (seed, table, row, column), not a draw from a
random generator: every pserver can initialise exactly its own rows, with the
same values whatever the number of pservers, and a single-process run gets the
same table too.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TableSpec:
    name: str        # the module attribute that holds the table, e.g. "emb_in"
    num_rows: int
    dim: int
    init_scale: float = 0.0   # values uniform in [-scale, scale); 0 gives zeros
    seed: int = 0

    def to_json(self):
        return dict(name=self.name, num_rows=self.num_rows, dim=self.dim,
                    init_scale=self.init_scale, seed=self.seed)


def _mix64(x):
    """splitmix64's finaliser on int64 tensors (multiplication wraps, shifts masked to be logical)."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687          # 0xbf58476d1ce4e5b9
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685          # 0x94d049bb133111eb
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def init_rows(spec, ids):
    """The initial values of rows `ids` (1-D int64) of table `spec`: shape [len(ids), dim]."""
    if spec.init_scale == 0.0:
        return torch.zeros(len(ids), spec.dim)
    salt = (spec.seed * 1_000_003 + sum(map(ord, spec.name))) * 0x9E3779B9
    cells = ids.long().unsqueeze(1) * spec.dim + torch.arange(spec.dim) + salt
    unit = ((_mix64(cells) >> 40) & 0xFFFFFF).float() / float(1 << 24)   # [0, 1)
    return (unit * 2.0 - 1.0) * spec.init_scale


class RowTable(nn.Module):
    """An embedding whose rows live on the pservers; holds only the rows loaded for one batch."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.register_buffer("ids", torch.empty(0, dtype=torch.long), persistent=False)
        self.rows = nn.Parameter(torch.empty(0, spec.dim))

    def load(self, ids, rows):
        """ids: sorted unique row ids; rows: their values, one row each."""
        self.ids = ids.to(self.rows.device)
        self.rows.data = rows.to(self.rows.device)
        self.rows.grad = None

    def forward(self, ids):
        # Every id of the batch was loaded, so searchsorted finds its exact position.
        return F.embedding(torch.searchsorted(self.ids, ids.contiguous()), self.rows)


def make_table(spec, remote, sparse_grad=False):
    """A RowTable when the rows live on pservers, else a full nn.Embedding with the same initial values."""
    if remote:
        return RowTable(spec)
    # from_pretrained draws nothing from torch's generator, so the dense layers built after the
    # table get the same initial values whether the table is local or remote.
    return nn.Embedding.from_pretrained(init_rows(spec, torch.arange(spec.num_rows)), freeze=False,
                                        sparse=sparse_grad)
