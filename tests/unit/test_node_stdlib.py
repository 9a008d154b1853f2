"""The node side runs on a bare Python: every fabtrain.node module imports with site-packages blocked,
and node ops as the controller sends them (fabtrain.remote.rpc) run with nothing but the standard library."""
from __future__ import annotations

import json
import pkgutil
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import fabtrain.node
from fabtrain.contract.opreplies import Status
from fabtrain.remote import rpc
from tests.conftest import REPO, require


def node_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(fabtrain.node.__path__, "fabtrain.node."))


def test_every_node_module_imports_with_site_packages_blocked():
    names = node_modules()
    assert {"fabtrain.node.procfs", "fabtrain.node.agent.policy", "fabtrain.node.agent.__main__"} <= set(names)
    # -S -I: no site-packages, no user site, no cwd; the repository and the standard library only.
    code = ("import sys, importlib; sys.path[:] = [%r] + [p for p in sys.path if 'packages' not in p]\n"
            "for name in %r:\n"
            "    importlib.import_module(name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('yaml', 'fabric', 'invoke', 'paramiko', 'psutil',"
            " 'flask', 'torch', 'numpy'))\n"
            "print('third-party:', bad)\n" % (str(REPO), names))
    out = subprocess.run([sys.executable, "-S", "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "third-party: []"


def test_node_ops_as_sent_run_on_a_bare_interpreter(tmp_path):
    # The very command line and stdin a node gets, on an interpreter with -S -I (no site-packages).
    argv = rpc.launcher_argv(sys.executable)
    request = json.dumps({"op": "status", "payload": {"workspace": str(tmp_path / "ws")}}).encode() + b"\n"
    out = subprocess.run([argv[0], "-S", "-I", *argv[1:]], input=rpc.code_frame(None) + request,
                         capture_output=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    parser = rpc.ReplyParser()
    parser.feed(out.stdout)
    replies = [value for kind, value in parser.events if kind == "reply"]
    assert replies == [{"ok": True, "result": Status(processes=[]).wire()}], (out.stdout, out.stderr)


def old_interpreters() -> list[str]:
    """Every Python older than the node side supports on this machine: pyenv's and /usr/bin's."""
    import glob
    found = []
    for path in sorted(glob.glob(str(Path.home() / ".pyenv/versions/*/bin/python")) + glob.glob("/usr/bin/python[23]*")):
        out = subprocess.run([path, "-c", "import sys; print('%d %d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and tuple(map(int, out.stdout.split())) < rpc.NODE_PYTHON_MIN:
            found.append(path)
    return found


# No registry this project installs from has a Python older than 3.8 (Debian 12 ships 3.11 only; PyPI has
# no interpreters), so a fresh machine has none: there the tests run this Python as one that says it is
# 3.6.15, which exercises the bootstrap's version check, and the grammar check below covers the rest.
STAND_IN_VERSION = (3, 6, 15)
STAND_IN = """import sys
code, sys.argv = sys.argv[1], ["-c"] + sys.argv[2:]
sys.version_info, sys.executable = %r + ("final", 0), %r
exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
"""


@pytest.fixture(scope="module")
def olds(tmp_path_factory) -> list[str]:
    """The old interpreters the tests run against: this machine's, else a stand-in; said in the test output."""
    found = old_interpreters()
    if found:
        warnings.warn(UserWarning(f"the old-Python tests ran against {', '.join(found)}"))
        return found
    path = tmp_path_factory.mktemp("old-python") / "python3.6"
    path.write_text("#!/bin/sh\n[ \"$1\" = -c ] || exit 2\nshift\n"
                    f"exec {sys.executable} -c {shlex.quote(STAND_IN % (STAND_IN_VERSION, str(path)))} \"$@\"\n")
    path.chmod(0o755)
    warnings.warn(UserWarning(f"no Python older than 3.8 on this machine (~/.pyenv/versions, /usr/bin): the old-Python "
                              f"tests ran against {path}, Python {sys.version.split()[0]} saying it is "
                              f"{'.'.join(map(str, STAND_IN_VERSION))}"))
    return [str(path)]


def test_the_bootstrap_down_to_its_version_check_parses_as_old_python():
    """What an old interpreter compiles before it can answer: Python 3.4's grammar (the oldest ast knows), and
    nothing 2.7 lacks that this code could use (f-strings, keyword-only arguments, annotations)."""
    import ast
    head = rpc.BOOTSTRAP[:rpc.BOOTSTRAP.index("import importlib.machinery")]
    tree = ast.parse(head, feature_version=(3, 4))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.JoinedStr, ast.AnnAssign, ast.AsyncFunctionDef))]
    assert all(not f.args.kwonlyargs and not f.returns for f in ast.walk(tree) if isinstance(f, ast.FunctionDef))


def test_a_node_python_older_than_3_8_is_named_in_one_line(tmp_path, olds):
    """The bootstrap checks the version before it compiles any node code, so a 3.6 (or 2.7) answers the
    first request with the one line, not a SyntaxError; every op goes through it."""
    for python in olds:
        version = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                                 capture_output=True, text=True).stdout.strip()
        for op in ("probe", "status", "start"):
            request = json.dumps({"op": op, "payload": {"workspace": str(tmp_path / "ws")}}).encode() + b"\n"
            out = subprocess.run(rpc.launcher_argv(python), input=rpc.code_frame(None) + request,
                                 capture_output=True, timeout=60)
            parser = rpc.ReplyParser()
            parser.feed(out.stdout)
            replies = [value for kind, value in parser.events if kind == "reply"]
            assert replies == [{"ok": False, "error": f"{python} is {version}; fabtrain's node side needs Python 3.8 "
                                                      "or newer: set nodes[].python or cluster.python"}], out
            assert out.stderr == b""
        assert not (tmp_path / "ws").exists()


def test_fab_check_on_an_old_python_says_it_in_one_line(fab, tmp_path, olds):
    olds = [p for p in olds if "/3." in p or "python3" in p]
    require(olds, "a Python 3 older than 3.8", "none under ~/.pyenv/versions or /usr/bin")
    path = tmp_path / "cluster.yaml"
    path.write_text(f"cluster: {{name: old, python: {olds[0]}}}\n"
                    f"nodes: [{{name: a, host: local, roles: [trainer], workspace: {tmp_path}/ws}}]\n"
                    "job: {mode: collective, trainer: {command: 'true'}}\n")
    for args in (["check"], ["start-trainers"], ["status"]):
        out = fab(*args, cluster=path, timeout=120)
        said = out.stdout + out.stderr
        assert out.returncode != 0 and f"{olds[0]} is 3." in said and "needs Python 3.8 or newer" in said, said
        assert "SyntaxError" not in said and "Traceback" not in said, said


def test_the_runtime_a_start_writes_is_the_version_the_controller_names(tmp_path, monkeypatch):
    """Node ops write the runtime from the modules they were sent; the folder's version (a hash of its
    files) is then the one the controller put in the agent's cwd, and a second start writes nothing."""
    import hashlib

    import fabtrain
    from fabtrain.node import runtime
    from fabtrain.plan.runtime import runtime_files, runtime_version

    monkeypatch.setattr(fabtrain, "__sent__", json.loads(json.dumps(rpc.node_modules())), raising=False)
    target = tmp_path / "runtime" / runtime_version()
    assert runtime.install(str(target)) == len(runtime_files())
    digest = hashlib.sha256()
    for rel in runtime_files():
        digest.update(str(rel).encode() + b"\0" + (target / rel).read_bytes() + b"\0")
    assert digest.hexdigest()[:16] == runtime_version()
    assert runtime.install(str(target)) == 0

    class Unread:  # a runtime a start made whole is not compared again: nothing sent is unpacked
        def items(self):
            raise AssertionError("the sent sources were read")
    monkeypatch.setattr(fabtrain, "__sent__", Unread())
    assert runtime.install(str(target)) == 0
    # A folder without the mark (`fab deploy`'s rsync stopped half way) has every file compared.
    monkeypatch.setattr(fabtrain, "__sent__", json.loads(json.dumps(rpc.node_modules())))
    (target / runtime.INSTALLED).unlink()
    (target / "fabtrain" / "node" / "ops.py").write_text("# half a deploy\n")
    assert runtime.install(str(target)) == 1
    assert (target / runtime.INSTALLED).exists()


def test_an_agent_that_does_not_host_the_coordinator_loads_only_what_it_runs():
    """Every node's agent imports itself at once at a start: an alert sender (urllib brings http.client,
    email and ssl), the coordinator's board and server, typing, traceback, secrets, shutil cost each agent
    their import for what most never use. The agent's whole start path, its alerts module included."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import fabtrain.node.agent.__main__, fabtrain.node.agent.loop, fabtrain.node.agent.notify\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('urllib', 'http', 'email', 'ssl', 'typing',"
            " 'traceback', 'secrets', 'shutil') or m in ('fabtrain.node.coordination.board',"
            " 'fabtrain.node.coordination.server')))\n" % str(REPO))
    out = subprocess.run([sys.executable, "-S", "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
