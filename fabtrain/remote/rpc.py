"""The node-ops call protocol: the one way the controller runs fabtrain.node code on a node.

Each node-side process starts from a fixed launcher, the only thing on any
command line (any user of a machine can read every process's argv in /proc,
and a `start` payload carries the job's secret):

    <python> -c 'import binascii,sys;exec(binascii.a2b_base64(sys.argv[1]))' <BOOTSTRAP in base64>

Everything else goes over its stdin:

    <n>\\n<n bytes: {"idle_exit": s, "modules": {name: [is_package, digest, offset, size]}}\\n
                 then each module's source, zlib'd on its own, at its offset>
    {"op": "status", "payload": {...}}\\n       a request a line, as many as wanted

The bootstrap reads the code, imports it as `fabtrain.node.*` from memory (a
meta-path finder over the sources: nothing to deploy first, and a copy of
fabtrain on the node is never mixed in; what it compiles it keeps in the
user's ~/.cache/fabtrain/code, named by the module's digest, the sha256 of its
source). A source is unpacked only when it is needed: a module not in that cache,
`get_source` (the launcher writes itself out), or a runtime folder to write
(fabtrain.node.runtime); a node that has the code compiled reads only the
index. The rest of stdin goes to fabtrain.node.serve, which answers each request with the reply frame: a
SENTINEL line, then one JSON line. What comes before the sentinel is an
op's streamed output (`logs --follow`) or noise from the login shell. A
reply is read through its op's type (fabtrain.contract.opreplies.REPLIES):
the caller gets the typed reply, or the node's NodeError when it is malformed.

A `Channel` is one node-side process. `call` opens one, asks one
request and closes it; the dashboard's collector and copy-data keep one open
per node and ask many, paying the login shell, the interpreter's start and
the compile once.
"""
from __future__ import annotations

import base64
import collections
import functools
import hashlib
import json
import re
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from fabtrain.contract.opreplies import REPLIES, MalformedReply
from fabtrain.contract.replies import SENTINEL
from fabtrain.contract import RUNTIME_PACKAGES
from fabtrain.remote.transport import FAILED, NO_REPLY, NodeError, Transport, fan_out

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # .../fabtrain
IDLE_EXIT = 120  # seconds without a request before a node-side process exits by itself
OPEN_TIMEOUT = 60  # for opening a session when the request itself may wait forever (logs --follow)

# binascii, not base64: the base64 module imports re and struct, ~10 ms of every node-side call
LAUNCHER = "import binascii,sys;exec(binascii.a2b_base64(sys.argv[1]))"

# The oldest Python the node side runs on (docs/getting-started.md: "Install, and your own project").
NODE_PYTHON_MIN = (3, 8)

# Runs on the node, from the launcher. Everything down to the version check must run on
# any Python (2.7 too): an older interpreter answers the first request with one line
# that names it, instead of failing to compile the node code.
BOOTSTRAP = '''\
import json
import os
import sys
import zlib


def read_until(data, done):
    while not done(data):
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the controller went away before sending the code
            sys.exit(0)
        data += chunk
    return data


data = read_until(b"", lambda d: b"\\n" in d)
size, data = data.split(b"\\n", 1)
size = int(size)
data = read_until(data, lambda d: len(d) >= size)
if sys.version_info < %(minimum)r:
    read_until(data[size:], lambda d: b"\\n" in d)  # the request this answers
    found = "%%d.%%d.%%d" %% tuple(sys.version_info[:3])
    error = ("%%s is %%s; fabtrain's node side needs Python %(shown)s or newer: "
             "set nodes[].python or cluster.python" %% (sys.executable or "python", found))
    sys.stdout.write("\\n%(sentinel)s\\n%%s\\n" %% json.dumps({"ok": False, "error": error}))
    sys.stdout.flush()
    sys.exit(0)

import importlib.machinery  # not importlib.abc/util: importing those costs more than the rest of a status call
import marshal
import stat


def code_cache():
    """This user's folder of compiled node code, or None where there is none to trust.

    Compiling the node code is most of what a node-side call costs after the
    interpreter's start; the code objects are kept per Python version and per
    module digest, so a changed module is simply a new file. Only a folder that
    is this user's alone is used (a code object is run as it is read)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "fabtrain", "code", sys.implementation.cache_tag or "none")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:  # a read-only or full home: compile every time
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return folder


def compiled(folder, name, digest, source, filename):
    """The module's code object: from the cache where it is there and whole, else compiled
    from source() (and kept)."""
    path = folder and os.path.join(folder, "%%s-%%s" %% (name, digest))
    if path:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                return marshal.load(f)
        except (OSError, EOFError, ValueError, TypeError):
            pass
    code = compile(source(), filename, "exec")
    if path:
        part = "%%s.%%d.part" %% (path, os.getpid())
        try:  # whole or not at all: written aside, then renamed into place
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                marshal.dump(code, f)
            os.replace(part, path)
        except (OSError, ValueError):
            try:
                os.unlink(part)
            except OSError:
                pass
    return code


class SentModules(object):
    """A meta-path finder and loader over the sent modules (the import protocol asks only for
    these methods; get_source is what linecache and the launcher ask a loader for)."""

    def __init__(self, index, packed):
        self.index = index  # name: [is_package, digest, offset, size]
        self.packed = packed
        self.cache = code_cache()

    def find_spec(self, name, path=None, target=None):
        if name not in self.index:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=self.index[name][0])

    def create_module(self, spec):
        return None

    def get_source(self, name):
        _, _, offset, size = self.index[name]
        return zlib.decompress(self.packed[offset:offset + size]).decode("utf-8")

    def items(self):
        """(name, (is_package, source)) of every sent module: what node ops write out as the runtime."""
        for name in sorted(self.index):
            yield name, (self.index[name][0], self.get_source(name))

    def exec_module(self, module):
        name = module.__name__
        is_package, digest = self.index[name][:2]
        # No file on the node: __file__ says so; the loader gives the text (for code that writes itself out).
        module.__file__ = "<sent>/" + name.replace(".", "/") + ("/__init__.py" if is_package else ".py")
        code = compiled(self.cache, name, digest, lambda: self.get_source(name), module.__file__)
        exec(code, module.__dict__)


header, packed = data[:size].split(b"\\n", 1)
code = json.loads(header.decode())
sent = SentModules(code["modules"], packed)
sys.meta_path.insert(0, sent)
import fabtrain
fabtrain.__sent__ = sent  # what node ops write out as the runtime (fabtrain.node.runtime)
from fabtrain.node import serve
sys.exit(serve.main(data[size:], code["idle_exit"]))
''' % {"minimum": NODE_PYTHON_MIN, "shown": "%d.%d" % NODE_PYTHON_MIN, "sentinel": SENTINEL}


def launcher_argv(python: str) -> list[str]:
    """The node-side process's whole command line: the same for every call, nothing secret."""
    return [python, "-c", LAUNCHER, base64.b64encode(BOOTSTRAP.encode()).decode()]


@functools.lru_cache(maxsize=None)
def node_modules() -> dict[str, tuple[bool, str]]:
    """Every module of the node runtime, fabtrain/contract/ and fabtrain/node/ (subpackages too):
    name -> (is_package, source).

    `fabtrain` itself is only its docstring here: the node gets fabtrain.contract and
    fabtrain.node and nothing of the controller's code."""
    root = PACKAGE_ROOT.parent
    # fabtrain/__init__.py is only a docstring, sent whole: node ops write these very sources out as
    # the runtime (fabtrain.node.runtime), whose version is a hash of the files (fabtrain.plan.runtime).
    top = PACKAGE_ROOT / "__init__.py"
    modules: dict[str, tuple[bool, str]] = {"fabtrain": (True, top.read_text() if top.exists() else "")}
    paths = [path for package in RUNTIME_PACKAGES for path in sorted((PACKAGE_ROOT / package).rglob("*.py"))]
    for path in paths:
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            modules[".".join(parts[:-1])] = (True, path.read_text())
        else:
            modules[".".join(parts)] = (False, path.read_text())
        # A folder without __init__.py is still a package to import from.
        for depth in range(2, len(parts)):
            modules.setdefault(".".join(parts[:depth]), (True, ""))
    return modules


@functools.lru_cache(maxsize=4)
def code_frame(idle_exit: float | None) -> bytes:
    """The first thing on a node-side process's stdin: the node code, behind its length.

    Each module is compressed on its own, behind a small index: a node that has the code
    compiled reads the index and unpacks nothing: decompressing and parsing all of it would be
    paid by every node-side call."""
    index, packed = {}, []
    offset = 0
    for name, (is_package, source) in node_modules().items():
        data = zlib.compress(source.encode(), 9)
        # A module's digest names its compiled code in the node's cache (BOOTSTRAP's code_cache).
        index[name] = [is_package, hashlib.sha256(source.encode()).hexdigest()[:32], offset, len(data)]
        packed.append(data)
        offset += len(data)
    blob = json.dumps({"idle_exit": idle_exit, "modules": index}).encode() + b"\n" + b"".join(packed)
    return b"%d\n" % len(blob) + blob


class ReplyParser:
    """A node-side process's stdout, cut into events: ("line", text) for what an op
    printed (or a login shell), ("reply", dict) for the frame that ends a request,
    ("garbled", text) for a frame whose JSON does not parse."""

    def __init__(self):
        self.buffer = bytearray()
        self.scanned = 0  # how much of buffer is known to hold no newline
        self.in_frame = False
        self.events: collections.deque = collections.deque()

    def feed(self, data: bytes) -> None:
        self.buffer += data
        start = 0
        # Search only what is new: a multi-megabyte reply comes in many pieces.
        while (end := self.buffer.find(b"\n", max(start, self.scanned))) >= 0:
            text = self.buffer[start:end].decode("utf-8", "replace")
            start = end + 1
            if self.in_frame:
                self.in_frame = False
                try:
                    reply = json.loads(text)
                except ValueError:
                    reply = None
                ok = isinstance(reply, dict) and "ok" in reply
                self.events.append(("reply", reply) if ok else ("garbled", text[:200]))
            elif text == SENTINEL:
                self.in_frame = True
            else:
                self.events.append(("line", text))
        del self.buffer[:start]
        self.scanned = len(self.buffer)


class ChannelClosed(NodeError):
    """The node-side process ended without a word (it exited when idle, or the connection dropped)."""


_print_lock = threading.Lock()  # streamed lines from many nodes, each whole


class Channel:
    """One node-side process on one node: a request, its reply; again, until closed.

    Opening it costs what one `call` costs (the login shell, the
    interpreter, compiling the node code); every request after that costs
    the node only the op's own work. A request that gets no reply in time
    leaves the channel unusable (the late reply would answer the next one):
    close it and open another."""

    def __init__(self, transport: Transport, timeout: float | None = None):
        self.node = transport.node
        self.stream = transport.open_stream(launcher_argv(self.node.python), timeout or OPEN_TIMEOUT)
        self.parser = ReplyParser()
        self.unsent = code_frame(IDLE_EXIT)  # goes with the first request, under its deadline
        self.noise: collections.deque = collections.deque(maxlen=5)
        self.broken: str | None = None

    def request(self, op: str, payload: dict, timeout: float | None = None, *, stream=None, last: bool = False) -> Any:
        """The result of one op, read through its type where fabtrain.contract.opreplies has one (NodeError if
        it failed, did not answer in time, or answered with a malformed reply).

        stream: a file the op's printed lines go to as they come; last: no
        request follows (the node-side process exits after this reply)."""
        if self.broken:
            raise ChannelClosed(f"{self.node.name}: {self.broken}")
        payload = {"workspace": self.node.workspace, "node": self.node.name, **payload}
        data = self.unsent + json.dumps({"op": op, "payload": payload}).encode() + b"\n"
        self.unsent = b""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.stream.send(data, deadline)
            if last:
                self.stream.close_input()
        except TimeoutError:
            raise self._fail(f"connected, no reply within {timeout:g} s ({op}; the node may be overloaded)",
                             NO_REPLY) from None
        except OSError:
            raise self._ended() from None
        return self._reply(op, timeout, deadline, stream)

    def _reply(self, op: str, timeout: float | None, deadline: float | None, stream) -> Any:
        events = self.parser.events
        while True:
            while events:
                kind, value = events.popleft()
                if kind == "reply":
                    if not value["ok"]:
                        raise NodeError(f"{self.node.name}: {value.get('error')}", FAILED,
                                        code=value.get("code"), detail=value.get("detail"))
                    return self._typed(op, value.get("result"))
                if kind == "garbled":
                    raise self._fail(f"garbled reply: {value}", FAILED)
                if stream is not None and value:
                    with _print_lock:
                        stream.write(value + "\n")
                        stream.flush()
                elif value.strip():
                    self.noise.append(value.strip())
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._fail(f"connected, no reply within {timeout:g} s ({op}; the node may be overloaded)",
                                 NO_REPLY)
            try:
                chunk = self.stream.recv(left)
            except OSError:
                chunk = b""
            if chunk is None:
                continue
            if not chunk:
                raise self._ended()
            self.parser.feed(chunk)

    def _typed(self, op: str, result: Any) -> Any:
        """The op's reply read through its type (fabtrain.contract.opreplies), where it has one: a malformed
        one is this node's failure, in one line. The channel stays usable: the frame itself was whole."""
        shape = REPLIES.get(op)
        if shape is None:
            return result
        try:
            return shape.from_wire(self.node.name, result)
        except MalformedReply as e:
            raise NodeError(str(e), FAILED) from None

    def _fail(self, why: str, kind: str) -> NodeError:
        self.broken = why
        return NodeError(f"{self.node.name}: {why}", kind)

    def _ended(self) -> NodeError:
        """Why the process ended without a reply: its last word on stderr or stdout, else how it exited."""
        last_error, exit_text = self.stream.ended()
        said = last_error or (self.noise[-1] if self.noise else "")
        # A Python traceback's last line: what it says, not the exception's class name.
        said = re.sub(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit): ", "", said)
        if said:
            return self._fail(f"node-side command failed: {said}", FAILED)
        self.broken = f"the node-side process ended ({exit_text})"
        return ChannelClosed(f"{self.node.name}: {self.broken}")

    def close(self) -> None:
        # A healthy process exits on the end of its input; a stuck one is not waited for.
        self.stream.close(wait=0 if self.broken else 2.0)


def call(transport: Transport, op: str, payload: dict, *, timeout: float | None = None, stream=None) -> Any:
    """One op on one node: open a channel, one request, close it; its reply's result (NodeError if none).
    stream: where an op's printed lines go."""
    channel = Channel(transport, timeout)
    try:
        return channel.request(op, payload, timeout, stream=stream, last=True)
    finally:
        channel.close()


class Channels:
    """One node-side process a node, kept across the fan-outs of one command (a start's port
    probe, then the start): each node pays the login shell, the interpreter's start and the
    compile once, not once a step. `call` is `rpc.call`'s twin; `last=True` ends that node's
    process with its reply. What is still open is closed on leaving the `with` block."""

    def __init__(self):
        self.open: dict[str, Channel] = {}  # one fan-out thread a node uses its entry at a time

    def call(self, transport: Transport, op: str, payload: dict, *, timeout: float | None = None,
             last: bool = False, stream=None) -> Any:
        channel = self.open.pop(transport.node.name, None)
        if channel is None or channel.broken:
            if channel is not None:
                channel.close()
            channel = Channel(transport, timeout)
        try:
            result = channel.request(op, payload, timeout, stream=stream, last=last)
        except BaseException:
            channel.close()
            raise
        if last:
            channel.close()
        else:
            self.open[transport.node.name] = channel
        return result

    def __enter__(self) -> "Channels":
        return self

    def __exit__(self, *exc) -> None:
        channels, self.open = list(self.open.values()), {}
        fan_out(channels, lambda c: c.close(), max(1, len(channels)), name=lambda c: c.node.name)
