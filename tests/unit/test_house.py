"""The house limits: no file over 600 lines, no class over 300, no function over 80.

Checked with `ast` on every .py file under fabtrain/ and workload/, and on prepare.py and fabfile.py.
A file that really needs more says why in a comment containing `house-limit:` followed by the
reason; such a file is not checked.
"""
import ast
import io
import tokenize
from pathlib import Path

import pytest

from tests.support import REPO
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 600, 300, 80

# Files let off the limits for now, each with why; the integrator removes an entry once its file
# is within them (test_exemptions_are_still_needed says when).
EXEMPT: dict[str, str] = {}


def checked_files():
    files = sorted(p for top in ("fabtrain", "workload") for p in (REPO / top).rglob("*.py"))
    return files + [REPO / "prepare.py", REPO / "fabfile.py"]


def says_why(text):
    """Whether a comment (not a string) holds `house-limit:` and a reason after it."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and "house-limit:" in tok.string:
            if tok.string.split("house-limit:", 1)[1].strip():
                return True
    return False


def oversize(path):
    """What in the file at `path` is over the limits, one line each ("file:line: ..."); [] when
    nothing is, or when the file says why it needs more."""
    text = Path(path).read_text()
    if says_why(text):
        return []
    problems = []
    lines = len(text.splitlines())
    if lines > MAX_FILE:
        problems.append(f"{path}: {lines} lines, more than {MAX_FILE}")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", MAX_FUNCTION
        else:
            continue
        size = node.end_lineno - node.lineno + 1
        if size > limit:
            problems.append(f"{path}:{node.lineno}: {kind} {node.name} is {size} lines, more than {limit}")
    return problems


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_files_classes_and_functions_are_within_the_house_limits(path):
    if str(path.relative_to(REPO)) in EXEMPT:
        pytest.skip(f"exempt: {EXEMPT[str(path.relative_to(REPO))]}")
    assert oversize(path) == []


def test_exemptions_are_still_needed():
    for name in sorted(EXEMPT):
        path = REPO / name
        assert path.exists(), f"{name} is gone: remove it from EXEMPT in tests/unit/test_house.py"
        assert oversize(path), f"{name} is within the limits now: remove it from EXEMPT in tests/unit/test_house.py"


def _function(name, body_lines):
    return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(body_lines - 1))


def test_the_check_finds_a_long_file_class_and_function(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text(_function("short", MAX_FUNCTION) + "\n" * (MAX_FILE - MAX_FUNCTION))
    assert oversize(ok) == []

    long_file = tmp_path / "long_file.py"
    long_file.write_text("x = 1\n" * (MAX_FILE + 1))
    assert oversize(long_file) == [f"{long_file}: {MAX_FILE + 1} lines, more than {MAX_FILE}"]

    long_function = tmp_path / "long_function.py"
    long_function.write_text(_function("long", MAX_FUNCTION + 1))
    assert oversize(long_function) == [f"{long_function}:1: function long is {MAX_FUNCTION + 1} lines, "
                                       f"more than {MAX_FUNCTION}"]

    methods = "".join("    " + line + "\n" for i in range(4) for line in _function(f"m{i}", 76).splitlines())
    long_class = tmp_path / "long_class.py"
    long_class.write_text("class Big:\n" + methods)
    assert oversize(long_class) == [f"{long_class}:1: class Big is {1 + 4 * 76} lines, more than {MAX_CLASS}"]


def test_a_reason_in_a_comment_exempts_a_file_and_one_in_a_string_does_not(tmp_path):
    body = _function("long", MAX_FUNCTION + 1)
    commented = tmp_path / "commented.py"
    commented.write_text("# house-limit: one table the reader wants in one piece\n" + body)
    assert oversize(commented) == []

    no_reason = tmp_path / "no_reason.py"
    no_reason.write_text("# house-limit:\n" + body)
    in_string = tmp_path / "in_string.py"
    in_string.write_text('NOTE = "# house-limit: not a comment"\n' + body)
    assert len(oversize(no_reason)) == len(oversize(in_string)) == 1
