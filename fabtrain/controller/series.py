"""Metric series, thinned, and what was added to them since a cursor.

The dashboard's charts poll `SeriesBook.since(cursor)`: each reply carries a
new cursor, and the next reply holds only the points appended since, or a
whole series where its kept points changed (thinned, or a new job's).
"""
from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass

_epochs = itertools.count(1)

TRAINERS, NODES = "trainers", "nodes"  # a series belongs to a process (loss, ...) or to a node (cpu, ...)


class Series:
    """One metric series (e.g. trainer-0's loss), thinned to at most ~max_points.

    Stride doubling: keep every point until the buffer holds 2N, then drop
    every other one and keep only every 2nd new point, and so on. The result
    is evenly spaced over the whole run, always includes the latest point,
    and costs O(1) amortised per point — deterministic, unlike a random
    reservoir, so the chart does not jitter between refreshes.
    """

    def __init__(self, max_points: int = 1000):
        self.max_points = max_points
        self.stride = 1
        self.seen = 0
        self.points: list[tuple[float, float]] = []
        self.last: tuple[float, float] | None = None
        self.epoch = next(_epochs)  # changes whenever kept points are dropped: a reader starts over

    def add(self, x: float, y: float) -> None:
        self.last = (x, y)
        if self.seen % self.stride == 0:
            self.points.append((x, y))
            if len(self.points) >= 2 * self.max_points:
                self.points = self.points[::2]
                self.stride *= 2
                self.epoch = next(_epochs)
        self.seen += 1

    def export(self) -> list[tuple[float, float]]:
        if self.last is not None and (not self.points or self.points[-1] != self.last):
            return self.points + [self.last]
        return list(self.points)

    def trailing(self) -> tuple[float, float] | None:
        """The latest point when the kept points do not end with it (thinning skipped it)."""
        return self.last if self.last is not None and (not self.points or self.points[-1] != self.last) else None


@dataclass(frozen=True)
class SeriesChunk:
    group: str  # TRAINERS or NODES
    owner: str  # the process or node
    metric: str
    reset: bool  # the points start the series over: drop what was kept of it
    epoch: int  # identifies the kept points' generation (same epoch: `start` indexes the same list)
    start: int  # index of points[0] among the series' kept points
    stride: int
    points: list  # [(x, y), ...]
    last: tuple | None  # the latest point when not the last of the kept points


@dataclass(frozen=True)
class SeriesDelta:
    cursor: str  # pass back to `since` for the next delta
    full: bool  # every series is in `chunks` from its start (an unknown cursor, or a series went away)
    chunks: list[SeriesChunk]


class SeriesBook:
    """Every series of the job, and the last `keep` cursors handed out (shared by every reader)."""

    def __init__(self, max_points: int = 1000, keep: int = 256):
        self.max_points = max_points
        self.keep = keep
        self.series: dict[tuple[str, str, str], Series] = {}  # (group, owner, metric) -> series
        self.nonce = secrets.token_hex(3)
        self.cursors: OrderedDict[str, dict] = OrderedDict()  # cursor -> {key: (epoch, length, last)}
        self.counter = 0

    def add(self, group: str, owner: str, metric: str, x: float, y: float) -> Series:
        s = self.series.get((group, owner, metric))
        if s is None:
            s = self.series[(group, owner, metric)] = Series(self.max_points)
        s.add(x, y)
        return s

    def get(self, group: str, owner: str, metric: str) -> Series | None:
        return self.series.get((group, owner, metric))

    def forget(self, group: str, owner: str) -> None:
        for key in [k for k in self.series if k[0] == group and k[1] == owner]:
            del self.series[key]

    def export(self, group: str) -> dict[tuple[str, str], list]:
        """(owner, metric) -> every kept point and the latest, for one group."""
        return {(o, m): s.export() for (g, o, m), s in self.series.items() if g == group}

    def since(self, cursor: str | None = None) -> SeriesDelta:
        base = self.cursors.get(cursor) if cursor else None
        if base is not None and any(k not in self.series for k in base):
            base = None  # a series went away (a new job): everything, the reader starts over
        snap, chunks = {}, []
        for key, s in self.series.items():
            n = len(s.points)
            snap[key] = (s.epoch, n, s.last)
            old = base.get(key) if base is not None else None
            reset = not (old and old[0] == s.epoch and old[1] <= n)
            if not reset and old[1] == n and old[2] == s.last:
                continue  # nothing new in this series
            start = 0 if reset else old[1]
            chunks.append(SeriesChunk(key[0], key[1], key[2], reset, s.epoch, start, s.stride,
                                      s.points[start:n], s.trailing()))
        self.counter += 1
        new = f"{self.nonce}-{self.counter}"
        self.cursors[new] = snap
        while len(self.cursors) > self.keep:
            self.cursors.popitem(last=False)
        return SeriesDelta(new, base is None, chunks)
