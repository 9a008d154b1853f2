"""Who is in the job, as the agents see it, and what each agent has already been told.

Pure (no sockets, no clock). Every node that beat is an entry ``[ts, done,
lost]`` (ts: epoch seconds of the coordinator's last news of it: it joined,
went done, was lost or came back). Entries change rarely, so they do not
travel with every beat: each change is appended to a log, an agent's beat
says which version it holds (``{"epoch", "at"}``), and the reply carries only
the entries that changed since (all of them for an agent that holds nothing,
another coordinator's epoch, or a version too far behind). A beat from an
agent that is up to date is answered with no roster at all, whatever the
number of nodes.

The epoch is new for every coordinator (and after the log is compacted), so
an agent that reconnects to a restarted coordinator gets the whole roster
once, never a delta against a log it did not see.
"""
from __future__ import annotations

import os

COMPACT_AFTER = 4  # entries the log may hold per node before it starts over under a new epoch


def new_epoch() -> str:
    return os.urandom(6).hex()


def known_version(value) -> tuple[str | None, int]:
    """(epoch, at) from what a beat says it holds; (None, 0) for nothing or something malformed."""
    if not isinstance(value, dict):
        return None, 0
    epoch, at = value.get("epoch"), value.get("at")
    if not isinstance(epoch, str) or not isinstance(at, int) or isinstance(at, bool):
        return None, 0
    return epoch, at


class Roster:
    def __init__(self, epoch: str | None = None):
        self.epoch = epoch or new_epoch()
        self.entries: dict[str, list] = {}  # node -> [ts, done, lost]
        self.log: list[str] = []  # nodes in the order they changed; the version is its length

    @property
    def version(self) -> int:
        return len(self.log)

    def set(self, node: str, ts: float | None, done: bool, lost: bool) -> bool:
        """Record `node`'s state; True if that is news (a new node, or done or lost changed)."""
        old = self.entries.get(node)
        if old is not None and old[1] == done and old[2] == lost:
            return False
        self.entries[node] = [ts, done, lost]
        self.log.append(node)
        if len(self.log) > COMPACT_AFTER * len(self.entries) + 1024:
            self.epoch, self.log = new_epoch(), []  # every agent gets the whole roster once more
        return True

    def since(self, known) -> dict | None:
        """The roster a reply carries for an agent that holds `known`: None if it is up to date."""
        epoch, at = known_version(known)
        if epoch == self.epoch and at == self.version:
            return None
        if epoch != self.epoch or not 0 <= at < self.version or self.version - at >= len(self.entries):
            names, full = list(self.entries), True
        else:
            names, full = list(dict.fromkeys(self.log[at:])), False
        return {"epoch": self.epoch, "at": self.version, "full": full,
                "nodes": {n: self.entries[n] for n in names}}

    def names(self, index: int) -> list[str]:
        """The nodes whose flag `index` (1: done, 2: lost) is set, sorted."""
        return sorted(n for n, e in self.entries.items() if e[index])


def merged(held: dict, roster) -> dict:
    """An agent's copy of the roster (node -> [ts, done, lost]) after a reply's `roster`."""
    if not isinstance(roster, dict) or not isinstance(roster.get("nodes"), dict):
        return held
    out = {} if roster.get("full") else dict(held)
    for node, entry in roster["nodes"].items():
        if isinstance(entry, list) and len(entry) == 3:
            out[node] = entry
    return out
