"""Records from the nodes are untrusted input: each is checked here before the controller keeps it.

A node's files are written by programs the controller does not control (a
user's training script writes its metrics file), and one bad line must not
take down a view: one `NaN` once left the dashboard's page unable to parse
/api/job, and a list-valued `kind` made /api/job and /metrics fail and
`fab watch` crash. So every metrics record and event is checked on ingest
(JSON with no NaN/Infinity, an object, each known field of its type, finite
numbers, bounded text) and a malformed one is dropped with a one-line reason
(`Malformed`) that the collector counts per node. health.json and the
process records of node ops' replies are cleaned field by field instead: a
snapshot with one bad field still says much that is right.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from fabtrain.contract import records as fields
from fabtrain.contract.identity import Process
from fabtrain.contract.states import ProcessState

MAX_LINE = 64 * 1024  # characters in one metrics or events line
MAX_REASON = 4096
MAX_TEXT = 1024  # an unknown field's text
MAX_NAME = 128
MAX_LIST = 4096
KIND_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # a process or node name
STATES = {s.value: s for s in ProcessState}


class Malformed(ValueError):
    """A record the controller does not keep; str() says why in a few words."""


class _Bad(Exception):
    pass


# -- checkers: each returns the value to keep or raises _Bad(why) -------------------------------------


def finite(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return -(1 << 63) <= v < (1 << 64)  # a 400-digit "step" would overflow every float after it
    return isinstance(v, float) and math.isfinite(v)


def _what(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "text", bool: "true/false", type(None): "null"}.get(
        type(v), "a number")


def number(v: Any) -> float | int | None:
    if v is None or (type(v) is float and v - v == 0) or finite(v):  # the common case first: a finite float
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        raise _Bad("is not a finite number")
    raise _Bad(f"is {_what(v)}, not a number")


def integer(v: Any) -> int | None:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise _Bad(f"is {_what(v)}, not an integer")


def flag(v: Any) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise _Bad(f"is {_what(v)}, not true/false")


def text(limit: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if v is None:
            return None
        if not isinstance(v, str):
            raise _Bad(f"is {_what(v)}, not text")
        if len(v) > limit:
            raise _Bad(f"is {len(v)} characters long (limit {limit})")
        return v
    return check


def rank(v: Any) -> int | str | None:
    return integer(v) if not isinstance(v, str) else text(64)(v)


def kind(v: Any) -> str:
    if not isinstance(v, str) or not KIND_RE.match(v):
        raise _Bad(f"is {_what(v) if not isinstance(v, str) else repr(v[:40])}, not a kind such as 'job_failed'")
    return v


def state(v: Any) -> str:
    if not isinstance(v, str) or v not in STATES:
        raise _Bad(f"is {repr(v)[:40]}, not a process state")
    return v


def scalar(v: Any) -> Any:
    """An unknown field: kept if it is a plain value."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        return text(MAX_TEXT)(v)
    return number(v)  # a list, an object, or a number out of range


def list_of(check: Callable, limit: int = MAX_LIST, lenient: bool = False) -> Callable[[Any], list]:
    """A list; lenient: an item that fails is left out rather than failing the list."""
    def run(v: Any) -> list:
        if not isinstance(v, list):
            raise _Bad(f"is {_what(v)}, not a list")
        if len(v) > limit:
            raise _Bad(f"has {len(v)} items (limit {limit})")
        out = []
        for item in v:
            try:
                out.append(check(item))
            except _Bad:
                if not lenient:
                    raise
        return out
    return run


def obj(schema: dict[str, Callable], required: tuple = (), extra: Callable | None = None,
        lenient: bool = False) -> Callable[[Any], dict]:
    """An object: each known field checked; unknown ones by `extra` (None: left out).
    lenient: a bad field is left out instead of failing the object (required ones never)."""
    def run(v: Any) -> dict:
        if not isinstance(v, dict):
            raise _Bad(f"is {_what(v)}, not an object")
        out = {}
        for key, value in v.items():
            check = schema.get(key)
            if check is number and type(value) is float and value - value == 0:
                out[key] = value  # the hot path (a metrics record's numbers): no call
                continue
            try:
                if check is None:
                    if extra is None:
                        continue
                    if len(key) > 64:
                        raise _Bad("is a field name over 64 characters")
                    check = extra
                out[key] = check(value)
            except _Bad as e:
                if lenient and key not in required:
                    continue
                raise _Bad(f"field {key[:64]!r} {e}") from None
        for key in required:
            if out.get(key) is None:
                raise _Bad(f"has no {key!r}")
        return out
    return run


# -- the records ------------------------------------------------------------------------------------

NAME = text(MAX_NAME)
# The checker of each type the contract's record tables name (fabtrain/contract/records.py).
CHECKS = {fields.NUMBER: number, fields.INTEGER: integer, fields.FLAG: flag, fields.NAME: NAME, fields.RANK: rank,
          fields.STATE: state, fields.SIGNAL: text(32), fields.REASON: text(MAX_REASON), fields.TEXT: text(MAX_TEXT)}


# The checker of a table within a record where it is checked more closely than field by field (its required
# fields, its own special fields), by the table's identity; any other table is an object checked leniently.
TABLES: dict[int, Callable] = {}


def check_of(kind: Any) -> Callable:
    """The checker of a contract type: a type's name, a table (a record within the record) or a list_of."""
    if isinstance(kind, dict):
        return TABLES.get(id(kind)) or obj(checks(kind), extra=check_of(kind[fields.OTHERS])
                                           if fields.OTHERS in kind else None, lenient=True)
    if isinstance(kind, tuple):
        _, item, most = kind
        return list_of(check_of(item), most, lenient=True)
    return CHECKS[kind]


def checks(table: dict[str, Any], **special: Callable) -> dict[str, Callable]:
    """The checker of every field of a contract table; `special` for the fields checked more closely."""
    return {field: check_of(kind) for field, kind in table.items() if field != fields.OTHERS} | special


def table(contract: dict, check: Callable) -> Callable:
    """`check` is how a contract table is checked wherever another record holds it."""
    TABLES[id(contract)] = check
    return check


# An event's `pids` whole or not at all; its `stacks` (contract/records.py EVENT_STACK) field by field.
EVENT = table(fields.EVENT, obj(checks(fields.EVENT, kind=kind) | checks(fields.EVENT_LISTS, pids=list_of(integer)),
                                required=("kind",), extra=scalar))
METRIC = obj(checks(fields.METRIC), extra=scalar)


def process_name(v: Any) -> Process | None:
    """A process's name, as its typed identity (contract/identity.py): its role and index read once, here."""
    v = NAME(v)
    return None if v is None else Process(v)


PROCESS = obj(checks(fields.STATUS_PROCESS, name=process_name), required=("name", "state"), lenient=True)
AGENT_PROCESS = table(fields.HEALTH_PROCESS, obj(checks(fields.HEALTH_PROCESS, name=process_name), required=("name",),
                                                 lenient=True))
table(fields.HEALTH_BLAME, obj(checks(fields.HEALTH_BLAME), required=("text",), lenient=True))
table(fields.HEALTH_STRAGGLER, obj(checks(fields.HEALTH_STRAGGLER), required=("node", "name")))  # whole, or not
# health.json: every field of contract/records.py's HEALTH, each part cleaned field by field.
HEALTH = obj(checks(fields.HEALTH), required=("ts",), lenient=True)
GPU_HOLDERS = obj({"source": NAME, "total": integer, "free": integer,
                   "busy": list_of(obj({"index": integer, "by": text(MAX_TEXT)}, required=("index",), lenient=True),
                                   1024, lenient=True)}, lenient=True)


def _no_constants(name: str):
    raise Malformed(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)  # one decoder: json.loads(..., kw) builds one a call


def parse_line(line: str) -> dict:
    """One JSON-lines record as an object, or Malformed."""
    if len(line) > MAX_LINE:
        raise Malformed(f"a line of {len(line)} characters (limit {MAX_LINE})")
    if "\ufffd" in line:  # node ops decodes with errors="replace": the file is not UTF-8 here
        raise Malformed("not valid UTF-8")
    try:
        rec = _DECODER.decode(line)
    except RecursionError:
        raise Malformed("nested too deeply") from None
    except ValueError as e:
        if isinstance(e, Malformed):
            raise
        raise Malformed(f"not JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(rec, dict):
        raise Malformed(f"{_what(rec)}, not a JSON object")
    return rec


def _checked(check: Callable, value: Any) -> dict:
    try:
        return check(value)
    except _Bad as e:
        raise Malformed(str(e) if str(e).startswith(("field", "has")) else f"record {e}") from None


def event(line: str) -> dict:
    return _checked(EVENT, parse_line(line))


def metric(line: str) -> dict:
    return _checked(METRIC, parse_line(line))


def event_record(rec: Any) -> dict:
    """An event that came already parsed (node ops' `last_event`)."""
    return _checked(EVENT, rec)


def process(rec: Any) -> dict:
    """One process of node ops' `status`/`collect` reply."""
    return _checked(PROCESS, rec)


def kept_processes(recs: list) -> list[dict]:
    """The process records of a status reply that pass `process`; the others are left out (fab status shows
    the rest; the dashboard's collector counts each it drops)."""
    kept = []
    for rec in recs:
        try:
            kept.append(process(rec))
        except Malformed:
            continue
    return kept


def health(doc: Any) -> dict:
    """health.json, cleaned field by field; Malformed if it is not an object with a finite `ts`."""
    return _checked(HEALTH, doc)


def gpu_holders(doc: Any) -> dict:
    """Node ops' `gpus` (fabtrain.contract.gpus.summary): total, free, who holds each busy GPU; cleaned field by field."""
    return _checked(GPU_HOLDERS, doc)


def stop_reason(v: Any) -> str | None:
    """Node ops' `stop_reason` (why a job was stopped, other than by kill-all): text, or None."""
    return v[:MAX_REASON] if isinstance(v, str) and v.strip() else None


SLURM_JOB_RE = re.compile(r"^\d{1,12}(_\d{1,12})?$")


def slurm_job(v: Any) -> str | None:
    """Node ops' `slurm` (a job in a Slurm allocation): its Slurm job id, or None."""
    job = v.get("job_id") if isinstance(v, dict) else None
    return job if isinstance(job, str) and SLURM_JOB_RE.match(job) else None
