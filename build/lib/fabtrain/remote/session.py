"""Connections opened once per `fab` invocation and reused by every task.

`fab deploy start-pserver start-trainers` runs three tasks in one process;
they share one Session, so each node is connected to once. Closed at exit.
"""
from __future__ import annotations

import atexit
from typing import Any, Callable, Iterable

from fabtrain.config.cluster import Cluster, Node, load_cluster
from fabtrain.remote.transport import Reply, Transport, fan_out, make_transport

_sessions: dict[str, "Session"] = {}


class Session:
    def __init__(self, cluster: Cluster, config=None):
        self.cluster = cluster
        self.config = config
        self._transports: dict[str, Transport] = {}

    def transport(self, node: Node) -> Transport:
        if node.name not in self._transports:
            self._transports[node.name] = make_transport(node, self.config)
        return self._transports[node.name]

    def map(self, fn: Callable[[Transport], Any], nodes: Iterable[Node] | None = None) -> list[Reply]:
        """fn(transport) on each node (default: all), in parallel, bounded by ssh.parallel."""
        nodes = list(self.cluster.nodes if nodes is None else nodes)
        return fan_out([self.transport(n) for n in nodes], fn, self.cluster.parallel)

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()


def get_session(path: str | None = None, config=None) -> Session:
    """The session for this cluster file in this process, made on first use."""
    cluster = load_cluster(path)
    key = cluster.path
    if key not in _sessions:
        _sessions[key] = Session(cluster, config)
    return _sessions[key]


def close_all() -> None:
    for s in _sessions.values():
        s.close()
    _sessions.clear()


atexit.register(close_all)
