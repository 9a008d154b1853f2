"""What each node op answers, defined once: the node builds its reply through these types and the
controller reads it back through them, so writer and reader cannot name different fields.

A type lists its fields, each with the check of its value:

    class Verify(Shape):
        OP = "verify"
        FIELDS = {"files": mapping(text), "disk_free": integer}

On the node an op builds `Verify(files=..., disk_free=...)` (a field the type does not name raises,
as contract/records.py's `record` does: a bug in the writer) and answers with its `wire()`: every
field, None where none was given. On the controller, fabtrain.remote.rpc reads the reply of every op in REPLIES through
its type's `from_wire(node, value)`: every field is checked and nested types are built, or it raises
MalformedReply, one line that names the node, the op and the field

    node2: malformed probe reply: "disk_free" is text, not an integer

which the controller reports as that node's failure, as it reports an unreachable node. The controller
then reads the typed reply's attributes, never the dict: a reply that was read is a whole one.

A reply's *records* are not checked here: a status reply's processes, health.json and last event are
what the agents and the user's programs wrote, and the controller cleans them field by field
(fabtrain/controller/records.py, from the tables in contract/records.py), as the collector does with
every `collect` reply: one bad record is dropped, not the node. Here they are held to be objects.

Standard library only and cheap to import (no dataclasses, no typing): every node-side call imports it.
"""
from fabtrain.contract.jobid import is_job_id


class MalformedReply(ValueError):
    """A reply the controller cannot read; str() is the one line that says whose, which op's and why."""


class _Wrong(Exception):
    """What is wrong with a value (`why`), and where below the field it is (`where`: ".pid", "[2]")."""

    def __init__(self, why, where=""):
        super().__init__(why)
        self.why, self.where = why, where


def _what(v):
    return {dict: "an object", list: "a list", str: "text", bool: "true/false", type(None): "null"}.get(
        type(v), "a number")


# -- checks: each returns the value to keep, or raises _Wrong ------------------------------------------


def number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Wrong("is %s, not a number" % _what(v))
    # NaN and infinity pass JSON's parser; an integer past 2**64 overflows every float it meets.
    if v != v or v in (float("inf"), float("-inf")) or (isinstance(v, int) and not -(1 << 63) <= v < (1 << 64)):
        raise _Wrong("is not a finite number")
    return v


def integer(v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Wrong("is %s, not an integer" % ("a fraction" if isinstance(v, float) else _what(v)))
    return v


def flag(v):
    if not isinstance(v, bool):
        raise _Wrong("is %s, not true/false" % _what(v))
    return v


def text(v):
    if not isinstance(v, str):
        raise _Wrong("is %s, not text" % _what(v))
    return v


def rank(v):
    """A process's rank: an integer, or text (contract/records.py RANK)."""
    return v if isinstance(v, str) else integer(v)


def within(lo, hi):
    """An integer from lo to hi: a TCP port, a count of ports (one that the controller would spell out as a
    range of ports must not be a billion)."""
    def run(v):
        if not lo <= integer(v) <= hi:
            raise _Wrong("is %d, not %d to %d" % (v, lo, hi))
        return v
    return run


port = within(0, 65535)


def positive(v):
    """A number above zero: a time the controller divides by."""
    if not number(v) > 0:
        raise _Wrong("is not above zero")
    return v


def job_id(v):
    if not is_job_id(v):
        raise _Wrong("is %s, not a job id" % (repr(v[:40]) if isinstance(v, str) else _what(v)))
    return v


def record(v):
    """An object the controller cleans itself, field by field (contract/records.py's tables)."""
    if not isinstance(v, dict):
        raise _Wrong("is %s, not an object" % _what(v))
    return v


def maybe(check):
    """The check, or null."""
    return lambda v: None if v is None else check(v)


def list_of(check):
    def run(v):
        if not isinstance(v, list):
            raise _Wrong("is %s, not a list" % _what(v))
        return [_below("[%d]" % i, check, item) for i, item in enumerate(v)]
    return run


def mapping(check):
    """An object of any names, each value checked."""
    def run(v):
        return {name: _below("." + name, check, item) for name, item in record(v).items()}
    return run


def entries(required, optional=None):
    """An object kept as it came, for a record other code reads as a dict (a GPU inventory: contract/gpus.py
    reads it on both sides): the fields in `required` must be there, those in `optional` may be missing,
    each checked; others are kept unchecked."""
    def run(v):
        record(v)
        for name, check in required.items():
            if name not in v:
                raise _Wrong("is missing", "." + name)
            _below("." + name, check, v[name])
        for name, check in (optional or {}).items():
            if name in v:
                _below("." + name, check, v[name])
        return v
    return run


def kept(check, value):
    """value where it passes the check, else None: for a node that copies into its reply what a file says
    (job.json, health.json), which holds whatever was written there."""
    try:
        return check(value)
    except _Wrong:
        return None


def _below(where, check, value):
    try:
        return check(value)
    except _Wrong as e:
        raise _Wrong(e.why, where + e.where) from None


def _wire(v):
    if isinstance(v, Shape):
        return v.wire()
    if isinstance(v, (list, tuple)):
        return [_wire(item) for item in v]
    if isinstance(v, dict):
        return {name: _wire(item) for name, item in v.items()}
    return v


# -- the types -----------------------------------------------------------------------------------------


class Shape(object):
    """Named fields (FIELDS: name -> check), read-only; a reply's type also names its op (OP)."""

    OP = ""
    FIELDS = {}

    def __init__(self, **values):
        unknown = set(values) - set(self.FIELDS)
        if unknown:
            raise TypeError("not fields of %s: %s" % (type(self).__name__, ", ".join(sorted(unknown))))
        for name in self.FIELDS:
            object.__setattr__(self, name, values.get(name))

    def __setattr__(self, name, value):
        raise AttributeError("%s is read as it came: its %s cannot be set" % (type(self).__name__, name))

    def wire(self):
        """The reply as it goes out: every field, nested types as their own wire."""
        return {name: _wire(getattr(self, name)) for name in self.FIELDS}

    @classmethod
    def checked(cls, value):
        """The type, from a wire value whose every field passes its check; else _Wrong (a nested type's check)."""
        if not isinstance(value, dict):
            raise _Wrong("is %s, not an object" % _what(value))
        values = {}
        for name, check in cls.FIELDS.items():
            if name not in value:
                raise _Wrong("is missing", "." + name)
            values[name] = _below("." + name, check, value[name])
        return cls(**values)

    @classmethod
    def from_wire(cls, node, value):
        """The reply node `node` sent, read through this type; MalformedReply names the node, op and field."""
        try:
            return cls.checked(value)
        except _Wrong as e:
            where = e.where[1:] if e.where.startswith(".") else e.where
            said = '"%s" %s' % (where, e.why) if where else "it %s" % e.why
            raise MalformedReply("%s: malformed %s reply: %s" % (node, cls.OP or cls.__name__, said)) from None

    def replaced(self, **changes):
        """A copy with `changes` (a field each): the type is read-only, so a reader that judges part of a
        reply passes on a changed copy of it."""
        return type(self)(**dict({name: getattr(self, name) for name in self.FIELDS}, **changes))

    def __eq__(self, other):
        return type(other) is type(self) and self.wire() == other.wire()

    __hash__ = None

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join("%s=%r" % (n, getattr(self, n)) for n in self.FIELDS))


# `fab check` (node/probe.py) --------------------------------------------------------------------------

class Tools(Shape):
    """The programs a node needs on its PATH, each found there or not."""
    FIELDS = {"rsync": flag, "stdbuf": flag}

    def missing(self):
        return [name for name in self.FIELDS if not getattr(self, name)]


# node/gpuinv.py's inventory, as contract/gpus.py reads it (its other fields are the node's own).
GPU_PROCESS = entries({"pid": integer, "user": text, "command": text}, {"mem": maybe(number)})
GPU = entries({"index": integer, "free": flag, "health": list_of(text), "processes": list_of(GPU_PROCESS)},
              {"leased_by": integer, "lease_job": maybe(text), "lease_user": maybe(text)})
GPU_INVENTORY = entries({"source": text, "gpus": list_of(GPU)}, {"error": text})


class Probe(Shape):
    """What `fab check` reads of a node."""
    OP = "probe"
    FIELDS = {
        "hostname": text, "python": text, "python_path": maybe(text), "workspace": text,
        "workspace_conflict": maybe(text),  # the workspace is another node's: in words
        "time": number,  # the node's clock as it answered
        "boot_id": maybe(text),  # the same on the controller: one machine, one clock (contract/clock.py)
        "cpus": maybe(integer), "tools": Tools.checked,
        "disk_free": integer, "disk_total": integer, "mem_total": maybe(integer),  # bytes
        "psutil": maybe(text), "paddle": maybe(text), "torch": maybe(text),  # versions, None: not installed
        "cuda": maybe(text), "gpus": integer,  # what torch sees
        "torch_error": maybe(text),  # a torch that cannot be imported
        "gpu_inventory": maybe(GPU_INVENTORY),  # who holds each GPU; not asked on a Slurm cluster's login node
    }


class Provision(Shape):
    OP = "provision"
    FIELDS = {"workspace": text, "venv": maybe(text)}  # venv: its python, where one was asked for


# a job's processes: start, status, logs, kill -------------------------------------------------------------

class Started(Shape):
    """A process a start started: the pid of its program (the one fabtrain shows) and of its launcher."""
    FIELDS = {"name": text, "role": text, "rank": rank, "pid": integer, "launcher_pid": integer}


class NotStarted(Shape):
    """A process that could not be started or exited at once: its exit code and its log's last lines."""
    FIELDS = {"name": text, "exit_code": integer, "log": list_of(text)}


class Start(Shape):
    OP = "start"
    FIELDS = {"job_dir": text, "started": list_of(Started.checked), "failed": list_of(NotStarted.checked),
              "warnings": list_of(text)}


class Status(Shape):
    """A node's job as node ops see it; with no job there (job_id None) only `processes`, empty, is given."""
    OP = "status"
    FIELDS = {
        "job_id": maybe(job_id),
        "code": maybe(record),  # which code it runs: {"commit", "dirty"} or {"hash"}
        "slurm": maybe(record),  # in a Slurm allocation: {"job_id", "node", "nodes"} (records.slurm_job)
        "processes": list_of(record),  # contract/records.py STATUS_PROCESS each (records.process)
        "killed": maybe(flag), "killed_by": maybe(text),  # the `killed` marker, and who stopped it
        "stop_reason": maybe(text),  # a failed start's why (all or nothing)
        "health_ts": maybe(number), "health": maybe(record),  # health.json's time; itself, where asked
        "last_event": maybe(record),  # events.jsonl's last line (records.event_record)
        "time": maybe(number),  # the node's clock: health.json's times are the node's
    }


class Logs(Shape):
    OP = "logs"
    FIELDS = {"job_id": maybe(job_id)}  # None: no job here (the lines themselves were streamed before it)


class Killed(Shape):
    """A process a kill signalled, and with what. `child`: a process under a job process's program (False:
    the program); `orphan`: found by its job marker alone; `starter`: the daemon that started a rank."""
    FIELDS = {"job_id": text, "name": text, "pid": integer, "child": maybe(flag), "orphan": maybe(flag),
              "starter": maybe(flag), "signal": text}


class Kill(Shape):
    OP = "kill"
    FIELDS = {"killed": list_of(Killed.checked),
              "left": list_of(integer),  # pids still alive after the escalation
              "untrusted": list_of(text)}  # run records of live processes that are not the job's: never signalled


class Marked(Shape):
    """One workspace of a Slurm allocation's kill-all: the job marked killed there (None: none runs there,
    or it has ended and keeps its outcome), and the Slurm job it ran as."""
    FIELDS = {"marked": maybe(job_id), "slurm_job": maybe(text)}


class MarkKilled(Shape):
    OP = "mark_killed"
    FIELDS = {"nodes": list_of(Marked.checked)}  # in the order of the workspaces asked


# what the controller watches: `fab watch` and the dashboard (controller/collector.py) ----------------------

class Chunk(Shape):
    """What `collect` read of one file of the job folder: whole lines (`data`) from the offset asked up to
    `offset`, and the file's `size` (a file shorter than the offset asked was replaced: read from its top)."""
    FIELDS = {"offset": within(0, 1 << 62), "size": within(0, 1 << 62), "data": text}


def _anything(v):
    return v


class Collect(Shape):
    """A node's job as the controller watches it, read incrementally (node ops' `collect`): its processes, its
    `killed` marker and stop, health.json, who holds the GPUs (where asked; None: not asked), and what was
    appended to events.jsonl, metrics/ and the logs followed since the offsets asked (`files`: by the file's
    name in the job folder). With no job there, `job_id` is None and only `time` and `gpus` are given.

    The collector reads it with `parts`: a field that fails its check is read as None and said, never the
    node's loss; a bad chunk of `files` is left out alone. Its records (processes, health.json) are cleaned
    field by field after (controller/records.py, from contract/records.py's tables)."""
    OP = "collect"
    FIELDS = {
        "time": number,  # the node's clock: health.json's times are the node's
        "job_id": maybe(job_id),
        "gpus": maybe(record),  # contract/gpus.py summary
        "processes": maybe(list_of(_anything)),  # contract/records.py STATUS_PROCESS each, checked one by one
        "killed": maybe(flag), "killed_by": maybe(text), "stop_reason": maybe(text),  # as Status's
        "slurm": maybe(record),
        "health": maybe(record),  # contract/records.py HEALTH
        "files": maybe(mapping(Chunk.checked)),
    }

    @classmethod
    def parts(cls, value):
        """(the reply, every field that fails its check read as None; [(field, why)] of those). A missing
        field (an older node's reply) reads as None, unsaid."""
        values, wrong = {}, []
        for name, check in cls.FIELDS.items():
            if name == "files" and isinstance(value.get(name), dict):
                values[name] = {}
                for rel, chunk in value[name].items():
                    try:
                        values[name][rel] = Chunk.checked(chunk)
                    except _Wrong as e:
                        said = "%s %s" % (e.where[1:] or "it", e.why)
                        wrong.append(("files", "a malformed file chunk (%s: %s)" % (str(rel)[:80], said)))
                continue
            try:
                values[name] = check(value[name]) if value.get(name) is not None else None
            except _Wrong as e:
                wrong.append((name, "%s%s %s" % (name, e.where, e.why)))
        return cls(**values), wrong


# copy-data ---------------------------------------------------------------------------------------------

class Verify(Shape):
    OP = "verify"
    FIELDS = {"files": mapping(text),  # name -> "ok", "mismatch", "missing" or "error: <why>"
              "disk_free": integer}  # bytes, where the files are


# the network: fab check, plan and start (node/netcheck.py), fab check --bandwidth (node/bandwidth.py) ------

class Route(Shape):
    """How this node reaches a peer's address: the local address and interface a connection leaves by
    (both None: no route)."""
    FIELDS = {"local": maybe(text), "iface": maybe(text)}


class Owner(Shape):
    """Who holds a taken port, as /proc shows it: the process, and the fabtrain job it is part of (None: not
    one, by its environment)."""
    FIELDS = {"pid": integer, "command": text, "workspace": maybe(text), "job_id": maybe(text)}


class Listened(Shape):
    """A port this node will hold for the job, as asked (port, what, setting, expect), and what came of it:
    state "ok" (free; served: `accepted` connections), "taken" (`owner`: who holds it, None where /proc does
    not show it) or "error" (`error`: why it cannot be listened on)."""
    FIELDS = {"port": port, "what": text, "setting": maybe(text), "expect": maybe(integer),
              "state": text, "accepted": maybe(integer), "owner": maybe(Owner.checked), "error": maybe(text)}


class Reached(Shape):
    """A port of another node that this node connected to, as asked (node, address, port, what), and what
    came of it: state "ok" (the check's own listener answered), "other" (another program did), "refused",
    "timeout" or "error"; the local address and interface it left by, the connect's ms, the attempts."""
    FIELDS = {"node": text, "address": text, "port": port, "what": text, "state": text,
              "attempts": maybe(integer), "local": maybe(text), "iface": maybe(text), "ms": maybe(number),
              "error": maybe(text)}


class Claim(Shape):
    """Ports another running fabtrain job on this machine holds or is about to (its job.json's `listens`):
    `count` of them from `port`, on `address` (None: every address)."""
    FIELDS = {"port": port, "count": within(1, 65536), "what": text, "address": maybe(text),
              "workspace": text, "job_id": text}


class Netcheck(Shape):
    """The network as one node sees it, for the job's ports."""
    OP = "netcheck"
    FIELDS = {
        "workspace": text,
        "address_ip": maybe(text),  # what the node's address resolves to there; None: it does not
        "address_local": flag,  # whether that is an address of the machine (not: NAT)
        "iface": maybe(text),  # the interface carrying it (NAT: the one the peers are reached by)
        "speed": maybe(integer),  # that interface's Mb/s, where it says
        "routes": mapping(Route.checked),  # by peer address
        "ephemeral": list_of(port),  # [lo, hi]: the kernel's range for outgoing connections
        "listen": list_of(Listened.checked), "reach": list_of(Reached.checked),
        "busy": maybe(list_of(port)),  # ports of the window asked that a socket holds; None: none asked
        "claimed": list_of(Claim.checked),
    }


class Bandwidth(Shape):
    """One rank's answer to the all-reduce; each rank's holds every rank's times (index: rank)."""
    OP = "bandwidth"
    FIELDS = {"rank": integer, "world_size": within(1, 1 << 20),  # at least one: every rank's times are read
              "backend": text, "bytes": integer, "iterations": integer,
              "allreduce_s": list_of(positive),  # one all-reduce, seconds
              "link_s": maybe(list_of(positive)),  # rank r receiving from rank r-1, seconds; None: one rank
              "iface": maybe(text)}  # the interface the backend was pinned to

    @classmethod
    def checked(cls, value):
        # The controller reads one time a rank: a list of another length is not this test's table.
        read = super().checked(value)
        for name in ("allreduce_s", "link_s"):
            times = getattr(read, name)
            if times is not None and len(times) != read.world_size:
                raise _Wrong("is %d long, not world_size (%d): one time a rank" % (len(times), read.world_size),
                             "." + name)
        return read


# The ops whose replies rpc reads through their type. Not here: `collect` (the collector reads it part by
# part, Collect.parts, dropping what is malformed) and the run history's `jobs` and `job` (merged with a
# cache of what nodes said before, leniently).
REPLIES = {shape.OP: shape for shape in (Probe, Provision, Start, Status, Logs, Kill, MarkKilled, Verify,
                                         Netcheck, Bandwidth)}
