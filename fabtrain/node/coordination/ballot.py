"""The votes' transport (election.py's rules over the network): one datagram each way, sealed like a pulse.

`Box` is what each agent of a job that elects runs, `ask` what a candidate
calls, first as a pre-vote (`pre`: answered from a copy of the voter, nothing
saved), then for real (agent/elect.py, docs/partitions.md, "Majority election"). Checked over real sockets by tests/unit/test_ballot.py.

    candidate -> voter   <64 hex: HMAC(key, "candidate " + body)> {"job_id", "candidate", "term", "known", "n"}
    voter -> candidate   <64 hex: HMAC(key, "voter " + body)>     {"job_id", "voter", "term", "granted", "known",
                                                                    "why", "coordinator", "n"}

The key is taken from the job's secret (it never travels), the side in the
MAC, so an answer cannot be passed off as a request. `n` is the
candidate's nonce for this round: an answer counts only for the request
that carried it. A replayed request repeats a vote already given to the
same candidate for the same term (one vote a term), or is refused as an
older term. A refusal names the coordinator the voter follows in its term,
sealed like the rest: a candidate behind it learns who won (`Voter.learn`),
and nobody without the key can make it follow another. The voter saves its term record (`TermFile.save`, fsync)
before its answer leaves: a vote given is a vote kept, across a restart of
the agent or the machine.
"""
from __future__ import annotations

import copy
import hashlib
import hmac
import math
import select
import socket
import threading
import time

from . import protocol
from .election import Ballot, Known, TermFile, Voter
from .protocol import ProtocolError
from .pulse import seal, verify

MAX_BALLOT = 1024


def ballot_key(secret: str | None, job_id: str) -> bytes:
    """The votes' key: from the job's secret, apart from the beats' and the pulses' keys."""
    return hmac.new((secret or "").encode(), b"ballot " + job_id.encode(), hashlib.sha256).digest()


def _known(value) -> Known:
    if not isinstance(value, dict):
        return Known()
    g, out, left = value.get("generation"), value.get("out"), value.get("restarts_left")
    return Known(g if type(g) is int else 0, tuple(sorted(n for n in out if isinstance(n, str)))
                 if isinstance(out, list) else (), left if type(left) is int else 0)


def _wire(k: Known) -> dict:
    return {"generation": k.generation, "out": list(k.out), "restarts_left": k.restarts_left}


def _open(key: bytes, side: bytes, data: bytes, job_id: str) -> dict:
    if len(data) > MAX_BALLOT:
        raise ProtocolError("datagram of %d bytes (at most %d)" % (len(data), MAX_BALLOT))
    verify(key, side, data)
    msg = protocol.parse(data.partition(b" ")[2], MAX_BALLOT)
    if msg.get("job_id") != job_id or type(msg.get("term")) is not int or not isinstance(msg.get("n"), str):
        raise ProtocolError("not a ballot of this job")
    return msg


class Box(threading.Thread):
    """A voter's ballot box: answers each sealed request with its Voter's vote, saved first."""

    def __init__(self, job_id: str, secret: str | None, host: str, port: int, voter: Voter, term_file: TermFile,
                 lock: threading.Lock | None = None, clock=time.monotonic):
        super().__init__(name="ballot-box", daemon=True)
        self.job_id, self.key, self.voter, self.term_file = job_id, ballot_key(secret, job_id), voter, term_file
        self.lock = lock or threading.Lock()  # the agent's, where it also feeds the voter its coordinator's lines
        self.clock = clock
        self.refused = 0
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.address = self.sock.getsockname()[:2]
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.2)
            if not ready:
                continue
            try:
                data, addr = self.sock.recvfrom(MAX_BALLOT + 1)
            except OSError:
                continue
            reply = self.answer(data)
            if reply is not None:
                try:
                    self.sock.sendto(reply, addr)
                except OSError:
                    pass

    def answer(self, data: bytes) -> bytes | None:
        """The sealed answer to one datagram, or None (not a request of this job: refused, unanswered)."""
        try:
            msg = _open(self.key, b"candidate", data, self.job_id)
            candidate = msg.get("candidate")
            if not isinstance(candidate, str):
                raise ProtocolError("a request names no candidate")
        except ProtocolError:
            self.refused += 1
            return None
        with self.lock:
            if msg.get("pre") is True:  # would it vote? asked first, so a candidate that cannot win raises no term
                dry = copy.copy(self.voter)
                dry.state = copy.copy(self.voter.state)
                ballot = dry.request(candidate, msg["term"], _known(msg.get("known")), self.clock())
            else:
                ballot = self.voter.request(candidate, msg["term"], _known(msg.get("known")), self.clock())
            if self.voter.changed:
                self.term_file.save(self.voter.state)  # on disk before the vote leaves
                self.voter.changed = False
        # quiet: how long ago it last heard a coordinator, rounded down (the candidate's estimate errs late)
        quiet = None if ballot.heard_at is None else max(0.0, math.floor((self.clock() - ballot.heard_at) * 1000) / 1000)
        return seal(self.key, b"voter", {"job_id": self.job_id, "voter": ballot.voter, "term": ballot.term,
                                         "granted": ballot.granted, "known": _wire(ballot.known),
                                         "why": ballot.why, "coordinator": ballot.coordinator, "quiet": quiet,
                                         "n": msg["n"]})

    def stop(self) -> None:
        self._stopping.set()
        self.join(1)
        self.sock.close()


def ask(job_id: str, secret: str | None, candidate: str, term: int, known: Known, boxes: dict,
        timeout: float, enough: int, pre: bool = False) -> list[Ballot]:
    """Ask every voter in `boxes` (node -> (host, port)) for its vote in `term`; the answers (one a node, each
    for this request) once `enough` are granted, every voter has answered, or `timeout` is over. Requests go again every 0.2 s to the
    voters that have not answered (a datagram may be lost)."""
    key, nonce = ballot_key(secret, job_id), protocol.new_nonce()
    request = seal(key, b"candidate", {"job_id": job_id, "candidate": candidate, "term": term,
                                       "known": _wire(known), "n": nonce, "pre": pre})
    host = next(iter(boxes.values()))[0] if boxes else "0.0.0.0"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    answers: dict = {}
    deadline, resend = time.monotonic() + timeout, 0.0
    try:
        while time.monotonic() < deadline and sum(b.granted for b in answers.values()) < enough \
                and len(answers) < len(boxes):  # every voter answered: waiting longer changes nothing
            if time.monotonic() >= resend:
                for node, where in boxes.items():
                    if node not in answers:
                        try:
                            sock.sendto(request, tuple(where))
                        except OSError:
                            pass
                resend = time.monotonic() + 0.2
            ready, _, _ = select.select([sock], [], [], max(0.0, min(resend, deadline) - time.monotonic()))
            if ready:
                _take(sock, key, job_id, nonce, boxes, answers)
    finally:
        sock.close()
    return list(answers.values())


def _take(sock: socket.socket, key: bytes, job_id: str, nonce: str, boxes: dict, answers: dict) -> None:
    try:
        data, _ = sock.recvfrom(MAX_BALLOT + 1)
        msg = _open(key, b"voter", data, job_id)
    except (OSError, ProtocolError):
        return
    voter = msg.get("voter")
    if msg["n"] != nonce or voter not in boxes or voter in answers:
        return
    coordinator, quiet = msg.get("coordinator"), msg.get("quiet")
    # When it last heard a coordinator, on this clock: the answer's arrival less its quiet (the answer's time in
    # flight only makes that later). Not a number of seconds (an older voter's answer, say): it cannot say.
    known_quiet = type(quiet) in (int, float) and math.isfinite(quiet) and quiet >= 0
    answers[voter] = Ballot(voter, msg["term"], msg.get("granted") is True, _known(msg.get("known")),
                            msg.get("why") if isinstance(msg.get("why"), str) else "",
                            coordinator if isinstance(coordinator, str) else None,
                            time.monotonic() - quiet if known_quiet else None)
