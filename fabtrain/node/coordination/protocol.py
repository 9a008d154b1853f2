"""The coordinator's wire format: JSON lines, bounded before parsing, authenticated both ways.

Every connection opens with a handshake in the clear; the job's secret never
travels, only HMACs keyed by it:

    agent -> coordinator   {"op":"hello","v":1,"job_id","node","nonce":<32 hex, fresh>}
    coordinator -> agent   {"op":"challenge","v":1,"job_id","nonce":<32 hex, fresh>,
                            "proof": HMAC(secret, ["coordinator", job_id, node, agent nonce, its nonce])}
                           or {"op":"error","error"} and the connection is closed

The agent checks the proof before it sends anything else: a program that took
the coordinator's port cannot make one, so it gets nothing but the hello.
From then on both sides use a session key, HMAC(secret, ["session", job_id,
node, both nonces]), and every line is a frame:

    <64 hex: HMAC-SHA256(session key, direction + " " + body)> <body: a JSON object with "n">\\n

``direction`` is "agent" or "coordinator" (who sent it) and ``n`` counts the
sender's frames on this connection from 1, so a frame of another connection
(other nonces), one sent the other way, one replayed, dropped or reordered is
refused. The agent's first frame is its proof: only a holder of the secret can
seal it. The MAC is checked on the raw bytes, before any JSON is parsed.

A beat names only what changed since the last beat sent on the same
connection (`beat_changes`): the first beat on a connection is whole, a field
a beat leaves out is as it was, and "op", "node" and "seq" are always there.
The frames' order and the MACs make that safe (nothing is lost or reordered
without the connection being refused); a new connection starts whole again.
Parsing a beat is most of what the coordinator does for it, and in a running
job only "seq" and the trainers' step rates change from beat to beat.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re

VERSION = 1
MAX_HELLO = 1024  # the one line anyone may send without a key: a hello is ~150 bytes
MAX_FRAME = 1 << 20  # a status line names every node; a few hundred nodes take ~100 KB
MAX_DEPTH = 8  # a beat nests 3 deep ({procs: {name: {state}}}); nothing needs more
MAX_NAME = 256  # job ids and node names
_HEX = re.compile(r"^[0-9a-f]{32}$")
_MAC_LEN = 64

# Strings first (their brackets are text), then everything but brackets goes; what is
# left is removed pair by pair from the inside, one level per pass.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_PAIR = re.compile(rb"\[\]|\{\}")


class ProtocolError(ValueError):
    """A line that is refused: too long, too deep, not JSON, a bad MAC, out of order."""


def nesting_ok(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """True if `data` nests arrays and objects at most `limit` deep, with brackets balanced.

    json.loads recurses once per level: 200,000 ``[`` raise RecursionError in
    whatever thread parses them. This decides in a few passes of C code
    (regular expressions), whatever the input; a line with no more opening
    brackets than `limit` (a beat has four) and as many closing ones cannot
    nest deeper, and is decided by counting alone.
    """
    squares, curlies = data.count(b"["), data.count(b"{")
    if squares + curlies <= limit and squares == data.count(b"]") and curlies == data.count(b"}"):
        return True
    return _balanced(data, limit)


def _balanced(data: bytes, limit: int) -> bool:
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        if not brackets:
            return True
        brackets, removed = _PAIR.subn(b"", brackets)
        if not removed:
            return False
    return not brackets


def parse(data: bytes, max_len: int) -> dict:
    """One JSON object from one line, refused before parsing if too long or too deep."""
    if len(data) > max_len:
        raise ProtocolError("line of %d bytes (at most %d)" % (len(data), max_len))
    if not nesting_ok(data):
        raise ProtocolError("nested deeper than %d levels, or unbalanced" % MAX_DEPTH)
    try:
        msg = _decode(data.decode())  # UTF-8 only; json.loads would first guess the encoding of bytes
    except ValueError as e:  # UnicodeDecodeError is one too
        raise ProtocolError("not JSON: %s" % e) from None
    if not isinstance(msg, dict):
        raise ProtocolError("not a JSON object")
    return msg


# json.dumps with any argument builds a new encoder each call: a third of a reply's sealing.
compact = json.JSONEncoder(separators=(",", ":")).encode
_decode = json.JSONDecoder().decode

BEAT_ALWAYS = frozenset(("op", "node", "seq"))  # what every beat says, changed or not


def beat_changes(beat: dict, last: dict) -> dict:
    """What of `beat` a connection carries after `last` (the beat sent before on it; {} for none):
    the fields that changed, and any `last` had that `beat` has not, as null."""
    changes = {k: v for k, v in beat.items() if k in BEAT_ALWAYS or k not in last or last[k] != v}
    for k in last.keys() - beat.keys():
        changes[k] = None
    return changes


def line(msg: dict) -> bytes:
    return (compact(msg) + "\n").encode()


def new_nonce() -> str:
    return os.urandom(16).hex()  # secrets.token_hex(16), without importing secrets (random, base64)


def _key(secret: str | None) -> bytes:
    # No secret (a job.json written by hand, the unit tests): the same protocol with an
    # empty key, which frames and orders lines but authenticates nobody.
    return (secret or "").encode()


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, json.dumps(parts).encode(), hashlib.sha256).hexdigest()


def _frame_hmac(key: bytes, side: bytes) -> hmac.HMAC:
    """HMAC-SHA256 keyed by `key` that has taken in "direction ": a frame's MAC is a copy of it fed the body.

    The direction has no space in it, so "direction body" is read one way only. Keying HMAC (the
    key's pads, OpenSSL's lookup of SHA-256) cost more than hashing a beat: hmac.digest did it for
    every frame (4.2 us), a copy of a keyed object does not (2.3 us, best of 5, 300-byte body)."""
    return hmac.new(key, side + b" ", hashlib.sha256)


def _name(msg: dict, field: str) -> str:
    value = msg.get(field)
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise ProtocolError("%s missing or not a name" % field)
    return value


def _nonce(msg: dict) -> str:
    value = msg.get("nonce")
    if not isinstance(value, str) or not _HEX.match(value):
        raise ProtocolError("nonce missing or not 32 hex digits")
    return value


# -- the handshake -------------------------------------------------------------------------------


def hello(job_id: str, node: str, nonce: str) -> bytes:
    return line({"op": "hello", "v": VERSION, "job_id": job_id, "node": node, "nonce": nonce})


def read_hello(data: bytes) -> dict:
    """The agent's hello, checked: {job_id, node, nonce}."""
    msg = parse(data, MAX_HELLO)
    if msg.get("op") != "hello":
        raise ProtocolError("expected a hello, got op %r" % str(msg.get("op"))[:40])
    if msg.get("v") != VERSION:
        raise ProtocolError("protocol version %r (this coordinator speaks %d)" % (str(msg.get("v"))[:20], VERSION))
    return {"job_id": _name(msg, "job_id"), "node": _name(msg, "node"), "nonce": _nonce(msg)}


def challenge(secret: str | None, job_id: str, node: str, agent_nonce: str, nonce: str) -> bytes:
    proof = _mac(_key(secret), "coordinator", job_id, node, agent_nonce, nonce)
    return line({"op": "challenge", "v": VERSION, "job_id": job_id, "nonce": nonce, "proof": proof})


def read_challenge(secret: str | None, job_id: str, node: str, agent_nonce: str, data: bytes) -> dict:
    """The coordinator's answer to our hello: {"nonce"} if it proved the secret, {"error"} if it refused us.

    Raises ProtocolError for anything else, a wrong proof above all.
    """
    msg = parse(data, MAX_HELLO)
    if msg.get("op") == "error":
        return {"error": str(msg.get("error"))[:300]}
    if msg.get("op") != "challenge":
        raise ProtocolError("answered the hello with op %r, not a challenge" % str(msg.get("op"))[:40])
    nonce = _nonce(msg)
    want = _mac(_key(secret), "coordinator", job_id, node, agent_nonce, nonce)
    if not isinstance(msg.get("proof"), str) or not hmac.compare_digest(msg["proof"], want):
        raise ProtocolError("it did not prove it knows the job's secret")
    return {"nonce": nonce}


# -- frames ------------------------------------------------------------------------------------


class Channel:
    """One authenticated connection, seen from one side: seals what it sends, opens what it gets."""

    def __init__(self, secret: str | None, job_id: str, node: str, agent_nonce: str, coordinator_nonce: str,
                 side: str):
        assert side in ("agent", "coordinator")
        key = _mac(_key(secret), "session", job_id, node, agent_nonce, coordinator_nonce).encode()
        # The key of this session's pulses (pulse.py): datagrams, so not the frames' key and order.
        self.session = agent_nonce
        self.pulse_key = _mac(_key(secret), "pulse", job_id, node, agent_nonce, coordinator_nonce).encode()
        mine = side.encode()
        self._sealing = _frame_hmac(key, mine)
        self._opening = _frame_hmac(key, b"coordinator" if mine == b"agent" else b"agent")
        self.sent = 0
        self.received = 0

    def seal(self, msg: dict, body: bytes | None = None) -> bytes:
        """One frame of `msg`; `body`, where given, is `msg` already encoded as compact JSON."""
        self.sent += 1
        if body is None:
            body = compact(dict(msg, n=self.sent)).encode()
        else:
            body = b'%s,"n":%d}' % (body[:-1], self.sent)
        mac = self._sealing.copy()
        mac.update(body)
        return b"%s %s\n" % (mac.hexdigest().encode(), body)

    def open(self, data: bytes) -> dict:
        """The message of one frame (without its newline) from the other side."""
        if len(data) > MAX_FRAME:
            raise ProtocolError("frame of %d bytes (at most %d)" % (len(data), MAX_FRAME))
        mac, _, body = data.partition(b" ")
        want = self._opening.copy()
        want.update(body)
        if len(mac) != _MAC_LEN or not hmac.compare_digest(mac, want.hexdigest().encode()):
            raise ProtocolError("bad MAC (forged, replayed from another connection, or not this job's secret)")
        msg = parse(body, MAX_FRAME)
        if msg.get("n") != self.received + 1:
            raise ProtocolError("frame %r out of order (expected %d): replayed or dropped" %
                                (msg.get("n"), self.received + 1))
        self.received += 1
        return msg


class LineReader:
    """Splits a byte stream into lines, refusing one that grows past `limit` before its newline."""

    def __init__(self, limit: int):
        self.limit = limit
        self.buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > self.limit:
            raise ProtocolError("a line longer than %d bytes" % self.limit)
        return lines
