"""fabtrain.remote.rpc, the node-ops call protocol, over local nodes (real processes)."""
from __future__ import annotations

import io
import shutil
import sys
import textwrap

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.remote import rpc
from fabtrain.remote.transport import FAILED, NodeError, make_transport
from fabtrain.contract.opreplies import Logs, Status
from fabtrain.contract.replies import SENTINEL

pytestmark = pytest.mark.timeout(60)
NO_JOB = Status(processes=[])  # a status where no job ever ran


def local_node(tmp_path, python=sys.executable):
    cluster = parse_cluster({"cluster": {"name": "rpc", "python": python},
                             "nodes": [{"name": "n0", "host": "local", "roles": ["trainer"],
                                        "workspace": str(tmp_path / "ws")}],
                             "job": {"mode": "collective"}}, str(tmp_path / "c.yaml"))
    return make_transport(cluster.nodes[0])


def test_the_command_line_is_the_fixed_launcher_and_the_code_goes_over_stdin():
    argv = rpc.launcher_argv("python3")
    assert argv[:3] == ["python3", "-c", rpc.LAUNCHER] and len(argv) == 4
    assert argv == rpc.launcher_argv("python3")  # nothing per call: no op, no payload
    size = sum(len(a) + 1 for a in argv)
    assert size < 8192, size  # far under MAX_ARG_STRLEN (128 KiB), however the node code grows
    frame = rpc.code_frame(rpc.IDLE_EXIT)
    length, _, blob = frame.partition(b"\n")
    assert int(length) == len(blob)
    names = set(rpc.node_modules())
    assert {"fabtrain", "fabtrain.node", "fabtrain.node.ops", "fabtrain.node.serve", "fabtrain.contract",
            "fabtrain.contract.states"} <= names
    # Every module of the node package and of the contract, and nothing of the controller's.
    on_disk = {".".join(p.relative_to(rpc.PACKAGE_ROOT.parent).with_suffix("").parts)
               for package in ("node", "contract") for p in (rpc.PACKAGE_ROOT / package).rglob("*.py")}
    assert {n.removesuffix(".__init__") for n in on_disk} <= names
    assert not any(n.startswith(("fabtrain.remote", "fabtrain.controller", "fabtrain.config")) for n in names)


def test_the_reply_parser_keeps_printed_lines_and_finds_the_reply_in_any_pieces():
    parser = rpc.ReplyParser()
    text = f"bashrc says hi\n[n0 trainer-0] tick 1\n\n{SENTINEL}\n" + '{"ok": true, "result": {"a": "x\\ny"}}\n'
    data = text.encode()
    for i in range(0, len(data), 3):  # three bytes at a time
        parser.feed(data[i:i + 3])
    assert list(parser.events) == [("line", "bashrc says hi"), ("line", "[n0 trainer-0] tick 1"), ("line", ""),
                                   ("reply", {"ok": True, "result": {"a": "x\ny"}})]
    parser = rpc.ReplyParser()
    parser.feed(f"{SENTINEL}\nnot json\n".encode())
    assert list(parser.events) == [("garbled", "not json")]


def test_a_call_and_a_channel_on_a_local_node(tmp_path):
    t = local_node(tmp_path)
    assert rpc.call(t, "status", {}) == NO_JOB
    channel = rpc.Channel(t, timeout=10)
    try:
        pid = None
        for _ in range(3):  # one node-side process answers them all
            assert channel.request("status", {}, timeout=10).job_id is None
            pid = pid or channel.stream.proc.pid
            assert channel.stream.proc.pid == pid and channel.stream.proc.poll() is None
        with pytest.raises(NodeError, match=r"^n0: unknown op 'nope'") as e:
            channel.request("nope", {}, timeout=10)
        assert e.value.kind == FAILED
        assert channel.request("status", {}, timeout=10).job_id is None  # an error reply leaves it usable
    finally:
        channel.close()
    assert channel.stream.proc.returncode == 0


def test_an_op_that_raises_is_one_line_naming_the_node(tmp_path):
    t = local_node(tmp_path)
    with pytest.raises(NodeError) as e:
        rpc.call(t, "verify", {"files": {}})
    assert str(e.value) == ("n0: verify: the request has no 'dir' (the controller's fabtrain differs "
                            "from this node code?)")  # in words: no exception class name


def test_a_missing_interpreter_says_so(tmp_path):
    t = local_node(tmp_path, python=str(tmp_path / "no-python"))
    with pytest.raises(NodeError, match=r"^n0: cannot run .*no-python: No such file or directory$"):
        rpc.call(t, "status", {})


def test_a_node_side_process_that_dies_gives_its_last_word(tmp_path):
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/sh\necho 'python3.2: too old for this' >&2\nexit 3\n")
    wrapper.chmod(0o755)
    with pytest.raises(NodeError, match=r"^n0: node-side command failed: python3.2: too old for this$"):
        rpc.call(local_node(tmp_path, python=str(wrapper)), "status", {})
    crashed = tmp_path / "crashed"
    crashed.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                       "echo 'SyntaxError: future feature annotations is not defined' >&2\nexit 1\n")
    crashed.chmod(0o755)
    with pytest.raises(NodeError, match=r"^n0: node-side command failed: future feature annotations is not defined$"):
        rpc.call(local_node(tmp_path, python=str(crashed)), "status", {})  # what it says, not its class name
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    with pytest.raises(rpc.ChannelClosed, match=r"^n0: the node-side process ended \(exit code 0\)$"):
        rpc.call(local_node(tmp_path, python=str(silent)), "status", {})


def test_streamed_lines_come_before_the_reply(tmp_path):
    job_id = "20261124-045501-5d89"
    ws = tmp_path / "ws" / "jobs" / job_id / "logs"
    ws.mkdir(parents=True)
    (ws / "trainer-0.log").write_text("".join(f"line {i}\n" for i in range(30)))
    (tmp_path / "ws" / "current").symlink_to(f"jobs/{job_id}")
    out = io.StringIO()
    assert rpc.call(local_node(tmp_path), "logs", {"lines": 5}, stream=out) == Logs(job_id=job_id)
    assert out.getvalue().splitlines() == [f"[n0 trainer-0] line {i}" for i in range(25, 30)]


def test_node_code_in_subpackages_is_imported_from_what_was_sent(tmp_path, monkeypatch):
    """The node package as it may be split: modules, a subpackage, one without __init__.py."""
    root = tmp_path / "src" / "fabtrain" / "node"
    (root / "agent").mkdir(parents=True)
    (root / "plain").mkdir()
    shutil.copy(rpc.PACKAGE_ROOT / "node" / "serve.py", root / "serve.py")
    shutil.copytree(rpc.PACKAGE_ROOT / "contract", root.parent / "contract")  # what serve.py speaks
    (root / "__init__.py").write_text("")
    (root / "agent" / "__init__.py").write_text("NAME = 'agent package'\n")
    (root / "agent" / "policy.py").write_text("from fabtrain.node.agent import NAME\nRULE = NAME + ' policy'\n")
    (root / "plain" / "helper.py").write_text("def twice(x):\n    return 2 * x\n")
    (root / "ops.py").write_text(textwrap.dedent("""\
        from fabtrain.node.agent.policy import RULE
        from fabtrain.node.plain import helper


        class UserFacing(Exception):
            pass


        def op_echo(payload):
            import fabtrain.node.ops as me
            return {"rule": RULE, "twice": helper.twice(payload["n"]), "file": me.__file__,
                    "source": me.__loader__.get_source(me.__name__) == open(payload["path"]).read()}


        OPS = {"echo": op_echo}
        """))
    monkeypatch.setattr(rpc, "PACKAGE_ROOT", root.parent)
    rpc.node_modules.cache_clear()
    rpc.code_frame.cache_clear()
    try:
        assert rpc.call(local_node(tmp_path), "echo", {"n": 21, "path": str(root / "ops.py")}) == {
            "rule": "agent package policy", "twice": 42, "file": "<sent>/fabtrain/node/ops.py", "source": True}
    finally:
        rpc.node_modules.cache_clear()
        rpc.code_frame.cache_clear()


def test_compiled_node_code_is_kept_for_this_user_alone_and_a_spoiled_copy_is_compiled_again(tmp_path, monkeypatch):
    """The node keeps what it compiles (the cost of a call after the interpreter's start), in a
    folder only its user can write; a copy that is not whole, or a folder others could have
    written, is never run."""
    import marshal
    import os
    import stat

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    t = local_node(tmp_path)
    assert rpc.call(t, "status", {}) == NO_JOB
    (folder,) = (tmp_path / "cache" / "fabtrain" / "code").iterdir()
    assert folder.name == sys.implementation.cache_tag
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    kept = {p.name.rsplit("-", 1)[0]: p for p in folder.iterdir()}
    assert {"fabtrain.node.ops", "fabtrain.node.serve"} <= set(kept)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in kept.values())
    assert not [p for p in folder.iterdir() if p.name.endswith(".part")]

    # What is kept is what runs: a planted ops module answers instead of the sent one ...
    planted_status = Status(processes=[], killed_by="planted")
    ops = kept["fabtrain.node.ops"]
    planted = ("from fabtrain.contract.opreplies import Status\n"
               "OPS = {'status': lambda payload: Status(processes=[], killed_by='planted').wire()}\n"
               "class UserFacing(Exception): pass\n")
    ops.write_bytes(marshal.dumps(compile(planted, "planted", "exec")))
    assert rpc.call(t, "status", {}) == planted_status
    # ... but not once others can write the folder, or the folder is a link to one.
    folder.chmod(0o777)
    assert rpc.call(t, "status", {}) == NO_JOB
    folder.chmod(0o700)
    moved = tmp_path / "elsewhere"
    folder.rename(moved)
    folder.symlink_to(moved)
    assert rpc.call(t, "status", {}) == NO_JOB
    folder.unlink()
    moved.rename(folder)
    assert rpc.call(t, "status", {}) == planted_status

    # A copy cut short (a full disk, a crash mid-write) is compiled again and replaced whole.
    ops.write_bytes(ops.read_bytes()[:7])
    assert rpc.call(t, "status", {}) == NO_JOB
    assert "OPS" in marshal.loads(ops.read_bytes()).co_names

    # No cache to be had (the cache path is a file): every call compiles, and works.
    monkeypatch.setenv("XDG_CACHE_HOME", str(ops))
    assert rpc.call(t, "status", {}) == NO_JOB
    assert os.path.isfile(ops)
