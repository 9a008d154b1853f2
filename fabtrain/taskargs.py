"""What a task's options may be, checked when `fab` parses the command line.

Invoke casts a typed option with `int("abc")` (a traceback), shows a float
option in `fab --help TASK` like an on/off switch, and ends an unknown task, an
unknown flag or a missing value with exit code 1 and, for the last, the repr
of its Argument. Here every numeric option is read as text and checked
against its `Number` before any task of the invocation runs, and every parse
error is one line naming the task and the option, with exit code 2 (a user
error, as `fabtrain.errors.UserError` is everywhere else).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from invoke import Exit, Task
from invoke.exceptions import ParseError
from invoke.program import Program

from fabtrain.errors import UserError


@dataclass(frozen=True)
class Number:
    """A numeric option: whole (int) or not, between lo and hi inclusive."""
    whole: bool
    lo: float
    hi: float
    unit: str = ""

    def read(self, option: str, text: str) -> int | float:
        what = "a whole number" if self.whole else "a number"
        try:
            value = int(text) if self.whole else float(text)
        except (TypeError, ValueError):
            raise UserError(f"{option}: must be {what}{self._range()}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value) or not self.lo <= value <= self.hi:
            raise UserError(f"{option}: must be {what}{self._range()}, got {text!r}")
        return value

    def _range(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f" from {_plain(self.lo)} to {_plain(self.hi)}{unit}"

    def describe(self, default) -> str:
        kind = "whole number" if self.whole else "number"
        shown = f"; default {_plain(default)}" if default is not None else ""
        return f"a {kind}{self._range()}{shown}"


def _plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class CheckedTask(Task):
    """A Task whose numeric options (`numbers`) reach the parser as text, so that
    `fab --help TASK` shows them taking a value and `check_options` reads them."""

    def __init__(self, body, numbers: dict[str, Number] | None = None, **kwargs):
        super().__init__(body, **kwargs)
        self.numbers = numbers or {}
        self.option_help = dict(self.help)

    def get_arguments(self, ignore_unknown_help=None):
        self.help = dict(self.option_help)  # invoke pops each help text it uses: the second call would get none
        args = super().get_arguments(ignore_unknown_help=ignore_unknown_help)
        for arg in args:
            spec = self.numbers.get(arg.attr_name) or self.numbers.get(arg.name)
            if spec is not None:
                arg.kind = str  # the default keeps its type; a typed value is checked, then cast
                arg.help = f"{arg.help}: {spec.describe(arg.default)}" if arg.help else spec.describe(arg.default)
        return args


def check_options(collection, contexts) -> None:
    """Read every numeric option typed for every task of the invocation, before any runs."""
    for ctx in contexts:
        task = collection[ctx.name] if ctx.name in collection else None
        numbers = getattr(task, "numbers", {})
        for name, arg in ctx.args.items():
            spec = numbers.get(arg.attr_name) or numbers.get(name)
            if spec is None or arg.raw_value is None:
                continue
            try:
                arg.set_value(spec.read(f"--{arg.names[0]}", arg.raw_value), cast=False)
            except UserError as e:
                raise Exit(f"fab {ctx.name}: {e}", code=2) from None


_FLAG_NEEDS_VALUE = re.compile(r"Flag <Argument: ([\w-]+)")
_UNKNOWN = re.compile(r"No idea what '(.*)' is!")
_NO_VALUE_TAKEN = re.compile(r"Flag <Argument: ([\w-]+).*doesn't take any value")


def parse_error_line(e: ParseError, argv: list[str] = ()) -> str:
    """One line for what the parser refused, naming the task and the option."""
    task = getattr(getattr(e, "context", None), "name", None)
    where = f"fab {task}" if task else "fab"
    text = str(e)
    if m := _UNKNOWN.match(text):
        token = m.group(1)
        # `--force=x`: the parser splits an on/off switch from its "value" and reads x as a task.
        switch = next((a.split("=", 1)[0] for a in argv if a.startswith("--") and a.endswith("=" + token)), None)
        if switch:
            return f"fab: {switch} is an on/off switch and takes no value (got {switch}={token})"
        if token.startswith("-"):
            return f"{where}: unknown option {token} (`fab --help {task}` lists its options)" if task \
                else f"fab: unknown option {token} (`fab --help` lists them)"
        return f"fab: no task named {token!r} (`fab --list` shows them)"
    if m := _NO_VALUE_TAKEN.match(text):
        return f"{where}: --{_dashed(m.group(1))} is an on/off switch and takes no value"
    if m := _FLAG_NEEDS_VALUE.match(text):
        return f"{where}: --{_dashed(m.group(1))} needs a value (`fab --help {task}`)" if task else \
            f"fab: --{_dashed(m.group(1))} needs a value"
    return f"{where}: {' '.join(text.split())}"


def _dashed(name: str) -> str:
    return name.replace("_", "-")  # the Argument's attribute name, as it is typed


def install() -> None:
    """Make the running `fab` check options and end parse errors in one line, exit 2.

    Fabric owns the `fab` program; its fabfile (ours) is imported before the
    task part of the command line is parsed, which is where these checks belong.
    """
    if getattr(Program.parse_tasks, "checks_fabtrain_options", False):
        return
    parse_tasks = Program.parse_tasks

    def parse_tasks_checked(self) -> None:
        try:
            parse_tasks(self)
        except ParseError as e:
            raise Exit(parse_error_line(e, list(getattr(self, "argv", None) or ())), code=2) from None
        check_options(self.collection, self.tasks)

    parse_tasks_checked.checks_fabtrain_options = True
    Program.parse_tasks = parse_tasks_checked
