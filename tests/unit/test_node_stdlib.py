"""The node side runs on a bare Python: every fabtrain.node module imports with site-packages blocked,
and node ops as the controller sends them (fabtrain.remote.rpc) run with nothing but the standard library."""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import fabtrain.node
from fabtrain.remote import rpc
from tests.conftest import REPO


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
    assert replies == [{"ok": True, "result": {"job_id": None, "processes": []}}], (out.stdout, out.stderr)
