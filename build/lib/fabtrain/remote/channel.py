"""One long-lived node_ops process per node, asked one request a line.

`Transport.call` starts a Python interpreter on the node for every op (node_ops
sent on the command line): simple, and right for a single command. Where one
fab task or the dashboard asks the same node again and again, the node's login
shell (a `.bashrc` that runs `conda init` or `pyenv init` costs tenths of a
second), the interpreter's start-up and the script's compile cost far more than
the op itself. A `Channel` pays them once: it starts node_ops in a small loop
that reads one JSON request a line on stdin and answers with node_ops' usual
reply (sentinel line + JSON). Used by the dashboard's StreamingCollector (a
collect every second) and by copy-data (verify before and after the copy).

The loop ends when its stdin closes (the controller closed the channel, or the
SSH connection dropped) or after IDLE_EXIT seconds without a request, so it can
never outlive its user for long. It carries no job marker: `kill-all` leaves it
alone, and it holds no port, no GPU and no file open.
"""
from __future__ import annotations

import base64
import json
import os
import select
import shlex
import socket
import subprocess
import time

from fabtrain.remote.transport import (_NODE_OPS_PACKED, SENTINEL, NodeError, SSHTransport, Transport,
                        describe_connect_error, quote_path)

IDLE_EXIT = 120  # seconds without a request before the node-side loop exits by itself

# The node-side loop: one request a line, {"op": ..., "payload": ...}, answered
# as node_ops answers on the command line (sentinel line + JSON).
# node_ops' children_of() scans all of /proc, and one collect calls it about
# three times per process; within one request the loop answers them from a
# single scan (same answer: every pid whose ppid is the given one), which is
# most of a collect's cost on a node with many processes.
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
    " try:q=json.loads(line);r={'ok':True,'result':g['OPS'][q['op']](q['payload'])}\n"
    " except g['UserFacing'] as e:r={'ok':False,'error':str(e)}\n"
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
    """One long-lived node_ops loop on one node: request a line, reply a line.

    Opening it costs what one `Transport.call` costs (the login shell, the
    interpreter, compiling node_ops); every request after that costs the node
    only the op's own work."""

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

    def request(self, op: str, payload: dict, timeout: float) -> dict:
        payload = {"workspace": self.node.workspace, "node": self.node.name, **payload}
        data = json.dumps({"op": op, "payload": payload}).encode() + b"\n"
        try:
            if self.chan is not None:
                self.chan.sendall(data)
            else:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
        except OSError as e:
            raise ChannelClosed(f"{self.node.name}: the node_ops loop is gone ({e.strerror or e})") from None
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
                raise NodeError(f"{self.node.name}: {op} timed out after {timeout:g} s")
            chunk = self._recv(left)
            if chunk is None:
                continue
            if not chunk:
                if noise:
                    raise NodeError(f"{self.node.name}: node-side command failed: {noise[-1]}")
                raise ChannelClosed(f"{self.node.name}: the node_ops loop ended")
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
