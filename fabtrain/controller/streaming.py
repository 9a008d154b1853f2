"""A collector that keeps one `collect` loop open per node.

The plain Collector starts a Python interpreter on every node for every poll
(a one-shot `collect` call): simple, and right for `fab watch`, but for
a dashboard polling every second the interpreter's start-up and the node
code's compile cost the node far more than the reading itself (see
docs/dashboard.md, "Performance"). `StreamingCollector` asks
each node through one `fabtrain.remote.rpc.Channel`, so a poll costs the
node only op_collect's own work. Any failure closes the channel; the next
poll opens a new one.
"""
from __future__ import annotations

import threading
import time

from fabtrain.remote.rpc import Channel, ChannelClosed
from fabtrain.controller.collector import Collector
from fabtrain.remote.transport import NodeError, describe_connect_error


class StreamingCollector(Collector):
    """A Collector whose polls go through one open channel per node (background mode)."""

    CATCH_UP_BYTES = 64 * 1024  # this much unread in a file after a poll: poll again at once

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._channels: dict[str, Channel] = {}
        self._channel_lock = threading.Lock()
        self._behind: dict[str, bool] = {}

    def _collect(self, name: str, transport, payload: dict, timeout: float) -> dict:
        try:
            return self._request(name, transport, payload, timeout)
        except ChannelClosed:
            # A loop that ended (idle, or its connection dropped): one fresh try before calling the node down.
            return self._request(name, transport, payload, timeout)

    def _request(self, name: str, transport, payload: dict, timeout: float) -> dict:
        with self._channel_lock:
            channel = self._channels.get(name)
        try:
            if channel is None:
                channel = Channel(transport, timeout)
                with self._channel_lock:
                    self._channels[name] = channel
            reply = channel.request("collect", payload, timeout)
            self._behind[name] = self._is_behind(reply)
            return reply
        except Exception as e:
            if channel is not None:
                with self._channel_lock:
                    if self._channels.get(name) is channel:
                        del self._channels[name]
                channel.close()
            if isinstance(e, NodeError):
                raise
            raise NodeError(describe_connect_error(transport.node, e)) from None

    def _is_behind(self, reply) -> bool:
        """More than CATCH_UP_BYTES left unread in a file (the reply is checked later, in _apply)."""
        files = reply.get("files") if isinstance(reply, dict) else None
        if not isinstance(files, dict):
            return False
        return any(isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("offset"), int)
                   and f["size"] - f["offset"] > self.CATCH_UP_BYTES for f in files.values())

    def _loop(self, name: str, interval: float) -> None:
        while not self._stop.is_set():
            began = time.time()
            self.poll_node(name)
            with self.lock:
                # Catching up on a long run (node ops sends at most MAX_BYTES of a file a poll): go on at once.
                behind = bool(self.nodes[name].up) and self._behind.pop(name, False)
            self._stop.wait(0 if behind else max(0.0, interval - (time.time() - began)))
        with self._channel_lock:
            channel = self._channels.pop(name, None)
        if channel is not None:
            channel.close()

    def stop(self) -> None:
        super().stop()
        with self._channel_lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
