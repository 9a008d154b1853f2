"""The checks of one value of cluster.yaml, each naming the dotted field it is on.

A check that refuses a value records the mistake and returns INVALID, so the
parser reads on and every mistake in the file is reported at once
(config/cluster.py), each with the line the loader found it on.
"""
from __future__ import annotations

import functools
import re
import shlex
import string
from typing import Any

from fabtrain.errors import UserError

# Placeholders a role's command may name; the plan fills them in.
PLACEHOLDERS = frozenset(
    "port ports_num ports_num_for_sparse num_gradient_servers trainer_id pservers "
    "rank world_size master_addr master_port nnodes node_rank nproc_per_node "
    "data_dir".split()
)

# What a name, host, user or path may contain. Anything else (spaces, quotes,
# $, ;, |, &, backticks, ...) is refused here rather than quoted later: these
# values also end up in rsync/ssh argument lists and file names.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.:%-]{0,252})$")
USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
PATH_RE = re.compile(r"^(~(?=/|$))?[A-Za-z0-9_./+@%,:=-]*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A network interface name as the kernel takes it (IFNAMSIZ: 15 characters).
IFACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}$")
AUTO = "auto"  # a port field's value: chosen at start among the ports free on the nodes concerned
ONE_LINE_RE = re.compile(r"^[^\n\r\0]+$")
IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./:@+-]{0,254}$")  # registry/repository:tag@digest


class _Invalid:
    """The value of a field already reported as wrong: checks of it pass it on without a
    word, so that one mistake is one line and the rest of the file is still read."""

    def __repr__(self) -> str:
        return "<invalid>"


INVALID = _Invalid()


class FieldError(UserError):
    """A mistake in one field; `line` is the line it is on in the file (0: not known)."""
    line = 0


def reported(check):
    """A check that records its refusal and returns INVALID, instead of stopping the parse."""
    @functools.wraps(check)
    def checked(self, value, where, *args, **kwargs):
        if value is INVALID:
            return INVALID
        try:
            return check(self, value, where, *args, **kwargs)
        except FieldError as e:
            self.errors.append(e)
            return INVALID
    return checked


def valid(*values: Any) -> bool:
    return all(v is not INVALID for v in values)


class Checks:
    """The errors and the primitive checks of one value; each knows the dotted field it is on."""

    def __init__(self, path: str, lines: dict[str, int]):
        self.path, self.lines = path, lines
        self.errors: list[FieldError] = []
        self.key_fields: dict[str, str] = {}  # node name -> the field that gave it its own ssh key

    def fail(self, where: str, problem: str) -> FieldError:
        line = self.line_of(where)
        e = FieldError(f"{self.path}: {where}: {problem}" + (f" (line {line})" if line else ""))
        e.line = line or 0
        return e

    def report(self, where: str, problem: str) -> None:
        self.errors.append(self.fail(where, problem))

    def line_of(self, where: str) -> int | None:
        """The line of `where`, else of the nearest field around it that has one."""
        while where:
            if where in self.lines:
                return self.lines[where]
            cut = max(where.rfind("."), where.rfind("["))
            where = where[:cut] if cut > 0 else ""
        return None

    def mapping(self, value: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
        """The mapping's known fields; an unknown or missing one is reported, a missing one is INVALID."""
        if value is INVALID:
            return {key: INVALID for key in required}
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.report(where, f"must be a mapping, got {kind_of(value)}")
            return {key: INVALID for key in required}
        known = {}
        for key, item in value.items():
            if not isinstance(key, str) or key not in allowed:
                hint = " (passwords are never kept in cluster.yaml: use ssh-agent, a key, or fab --prompt-for-login-password)" if key in ("password", "passphrase") else ""
                self.report(f"{where}.{key}" if where else str(key), f"unknown field{hint}; expected one of: {', '.join(sorted(allowed))}")
            else:
                known[key] = item
        for key in sorted(required):
            if key not in known:
                self.report(f"{where}.{key}" if where else key, "missing required field")
                known[key] = INVALID
        return known

    @reported
    def string(self, value: Any, where: str, pattern: re.Pattern | None = None, what: str = "") -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self.fail(where, f"must be a string, got {kind_of(value)}")
        value = str(value)
        if not value:
            raise self.fail(where, "must not be empty")
        if pattern is ONE_LINE_RE and not pattern.match(value):
            raise self.fail(where, "must be a single line")
        if pattern is not None and not pattern.match(value):
            raise self.fail(where, f"{shown(value)} is not a valid {what} (letters, digits and {_allowed_punct(pattern)} only; no spaces or shell metacharacters)")
        return value

    @reported
    def integer(self, value: Any, where: str, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"must be an integer, got {kind_of(value)}")
        if not lo <= value <= hi:
            raise self.fail(where, f"must be between {lo} and {hi}, got {shown(value)}")
        return value

    @reported
    def number(self, value: Any, where: str, lo: float, hi: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(where, f"must be a number, got {kind_of(value)}")
        if not lo <= value <= hi:
            raise self.fail(where, f"must be between {lo:g} and {hi:g}, got {value:g}")
        return float(value)

    @reported
    def port(self, value: Any, where: str) -> int | None:
        """A TCP port, or `auto` (None): chosen at start among the ports free on the nodes concerned."""
        if value == AUTO:
            return None
        if isinstance(value, str):
            raise self.fail(where, f"must be a port (1-65535) or auto, got {shown(value)}")
        return self.integer(value, where, 1, 65535)

    @reported
    def boolean(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"must be true or false, got {kind_of(value)}")
        return value

    @reported
    def exit_codes(self, value: Any, where: str) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            raise self.fail(where, f"must be a non-empty list of exit codes (1-255), got {kind_of(value)}")
        return tuple(self.integer(v, f"{where}[{i}]", 1, 255) for i, v in enumerate(value))

    @reported
    def choice(self, value: Any, where: str, choices: tuple[str, ...]) -> str:
        if value not in choices:
            raise self.fail(where, f"must be one of {', '.join(choices)}, got {shown(value)}")
        return value

    @reported
    def path_value(self, value: Any, where: str) -> str:
        p = self.string(value, where, PATH_RE, "path")
        if p is INVALID:
            return p
        if p.startswith("-"):
            # ssh, rsync and python would read it as an option (-oProxyCommand=...).
            raise self.fail(where, f"{shown(p)} must not start with '-' (ssh, rsync or python would read it as an option; "
                                   f"put ./ before a relative path)")
        if "~" in p[1:]:
            raise self.fail(where, f"{p!r}: '~' is only allowed at the start of a path")
        return p

    @reported
    def command(self, value: Any, where: str) -> str:
        cmd = self.string(value, where)
        if cmd is INVALID:
            return cmd
        try:
            argv = shlex.split(cmd)
        except ValueError as e:
            raise self.fail(where, f"cannot split into arguments: {e}") from None
        if not argv:
            raise self.fail(where, "must not be empty")
        for token in argv:
            try:
                parsed = list(string.Formatter().parse(token))
            except ValueError as e:
                raise self.fail(where, f"bad placeholder in {token!r}: {e} (write {{{{ and }}}} for literal braces)") from None
            for _, name, spec, conv in parsed:
                if name is None:
                    continue
                if name not in PLACEHOLDERS or spec or conv:
                    raise self.fail(where, f"unknown placeholder {{{name}}}; known: {', '.join('{%s}' % p for p in sorted(PLACEHOLDERS))}")
        return cmd


def kind_of(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(type(value), type(value).__name__)


def shown(value: Any, limit: int = 60) -> str:
    """A value for a message: short, and never the repr of a nested structure
    (YAML aliases can make a small file describe an enormous one)."""
    if value is not None and not isinstance(value, (str, int, float)):
        return kind_of(value)
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _allowed_punct(pattern: re.Pattern) -> str:
    return {NAME_RE: "_ . -", HOST_RE: "_ . : % -", USER_RE: "_ . -", IFACE_RE: "_ . -",
            PATH_RE: "/ _ . + @ % , : = - and a leading ~"}.get(pattern, "punctuation")
