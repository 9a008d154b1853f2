"""A collector that keeps one `collect` process open per node.

The plain Collector starts a Python interpreter on every node for every poll
(node_ops `collect`, sent on the command line): simple, and right for
`fab status`, but for a dashboard polling every second the interpreter's
start-up and the script's compile cost the node far more than the reading
itself (see docs/dashboard.md, "Performance"). `StreamingCollector` starts
node_ops once per node, in a small loop that reads one JSON request a line
on stdin and answers with node_ops' usual reply (sentinel line + JSON), so a
poll costs the node only op_collect's own work.

The loop ends when its stdin closes (the dashboard stopped, or the SSH
connection dropped) or after IDLE_EXIT seconds without a request, so it can
never outlive the dashboard for long. It carries no job marker: `kill-all`
leaves it alone, and it holds no port, no GPU and no file open.
Any failure closes the channel; the next poll opens a new one.
"""
from __future__ import annotations

import base64
import json
import os
import select
import shlex
import socket
import subprocess
import threading
import time

from orchestrator.collector import Collector
from orchestrator.transport import (_NODE_OPS_PACKED, SENTINEL, NodeError, SSHTransport, Transport,
                                    describe_connect_error, quote_path)

IDLE_EXIT = 120  # seconds without a request before the node-side loop exits by itself

# The node-side loop. node_ops' children_of() scans all of /proc, and one
# collect calls it about three times per process; within one request the loop
# answers them from a single scan (same answer: every pid whose ppid is the
# given one), which is most of a collect's cost on a node with many processes.
_LOOP = (
    "import base64,json,select,sys,zlib\n"
    "g={'__name__':'fabtrain_node_ops'}\n"
    "exec(zlib.decompress(base64.b64decode(sys.argv.pop(1))),g)\n"
    "S=g['SENTINEL']\n"
    "memo={}\n"
    "def children_of(pid):\n"
    " if 'k' not in memo:\n"
    "  k=memo['k']={}\n"
    "  for p in g['all_pids']():\n"
    "   st=g['proc_stat'](p)\n"
    "   if st is not None:k.setdefault(st[1],[]).append(p)\n"
    " return list(memo['k'].get(pid,()))\n"
    "if all(n in g for n in ('children_of','all_pids','proc_stat')):g['children_of']=children_of\n"
    "while select.select([sys.stdin],[],[],float(sys.argv[1]))[0]:\n"
    " line=sys.stdin.readline()\n"
    " if not line:break\n"
    " memo.clear()\n"
    " try:r={'ok':True,'result':g['op_collect'](json.loads(line))}\n"
    " except Exception as e:r={'ok':False,'error':'%s: %s'%(type(e).__name__,e)}\n"
    " sys.stdout.write('\\n%s\\n%s\\n'%(S,json.dumps(r)));sys.stdout.flush()\n"
)
_BOOTSTRAP = "import base64,sys;exec(base64.b64decode(sys.argv.pop(1)))"


def loop_argv(python: str) -> list[str]:
    packed_loop = base64.b64encode(_LOOP.encode()).decode()
    return [python, "-c", _BOOTSTRAP, packed_loop, _NODE_OPS_PACKED, str(IDLE_EXIT)]


def loop_command(python: str) -> str:
    """The same as one shell line for the node's login shell (only [A-Za-z0-9+/=] besides the python path)."""
    python, *rest = loop_argv(python)
    return " ".join([quote_path(python), *map(shlex.quote, rest)])


class ChannelClosed(NodeError):
    """The loop's stream ended (it exited when idle, or the connection dropped)."""


class Channel:
    """One long-lived node_ops collect loop on one node: request a line, reply a line."""

    def __init__(self, transport: Transport, timeout: float):
        self.node = transport.node
        self.buffer = b""
        self.proc = self.chan = None
        if isinstance(transport, SSHTransport):
            command = loop_command(self.node.python)
            transport.open()  # NodeError with the usual one-line reason if unreachable
            try:
                chan = transport.context.client.get_transport().open_session(timeout=timeout)
                chan.set_combine_stderr(True)
                chan.exec_command(command)
            except Exception as e:
                raise NodeError(describe_connect_error(self.node, e)) from None
            self.chan = chan
        else:
            argv = loop_argv(os.path.expanduser(self.node.python))
            try:
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, cwd=os.path.expanduser("~"))
            except OSError as e:
                raise NodeError(f"{self.node.name}: cannot run {argv[0]}: {e.strerror or e}") from None

    def request(self, payload: dict, timeout: float) -> dict:
        data = json.dumps(payload).encode() + b"\n"
        try:
            if self.chan is not None:
                self.chan.sendall(data)
            else:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
        except OSError as e:
            raise ChannelClosed(f"{self.node.name}: the collect loop is gone ({e.strerror or e})") from None
        deadline = time.monotonic() + timeout
        seen_sentinel = False
        noise = []
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                text = line.decode("utf-8", "replace")
                if seen_sentinel:
                    reply = json.loads(text)
                    if not reply["ok"]:
                        raise NodeError(f"{self.node.name}: {reply['error']}")
                    return reply["result"]
                if text == SENTINEL:
                    seen_sentinel = True
                elif text.strip():
                    noise.append(text)
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeError(f"{self.node.name}: collect timed out after {timeout:g} s")
            chunk = self._recv(left)
            if chunk is None:
                continue
            if not chunk:
                if noise:
                    raise NodeError(f"{self.node.name}: node-side command failed: {noise[-1]}")
                raise ChannelClosed(f"{self.node.name}: the collect loop ended")
            self.buffer += chunk

    def _recv(self, timeout: float) -> bytes | None:
        """Some bytes; b"" at the end of the stream; None if nothing came within timeout."""
        if self.chan is not None:
            self.chan.settimeout(timeout)
            try:
                return self.chan.recv(1 << 20)
            except socket.timeout:
                return None
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return None
        return os.read(fd, 1 << 20)

    def close(self) -> None:
        # The node-side loop sees EOF on its stdin and exits.
        if self.chan is not None:
            try:
                self.chan.shutdown_write()
            except Exception:
                pass
            self.chan.close()
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()


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
        payload = {"workspace": transport.node.workspace, "node": name, **payload}
        with self._channel_lock:
            channel = self._channels.get(name)
        try:
            if channel is None:
                channel = Channel(transport, timeout)
                with self._channel_lock:
                    self._channels[name] = channel
            reply = channel.request(payload, timeout)
            files = reply.get("files", {}).values()
            self._behind[name] = any(f.get("size", 0) - f.get("offset", 0) > self.CATCH_UP_BYTES for f in files)
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

    def _loop(self, name: str, interval: float) -> None:
        while not self._stop.is_set():
            began = time.time()
            self.poll_node(name)
            with self.lock:
                # Catching up on a long run (node_ops sends at most 1 MiB a file a poll): go on at once.
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
