"""A program's terminal escape sequences reach the user's terminal only as visible text (fab logs, fab status)."""
import os
import subprocess
import sys

import pytest

from fabtrain.controller.terminal import visible
from tests.conftest import FAB, REPO

# A C1 CSI (cursor up), a title change, an OSC 52 clipboard write, a screen clear, a bell.
NASTY = "\u009b1A \x1b]0;owned\x07 \x1b]52;c;cm0gLXJmIH4K\x07 \x1b[2J\x1b[H \x07 done"
PROGRAM = f"import sys; sys.stdout.write({NASTY!r} + chr(10))"
CONTROL_BYTES = [b"\x1b", b"\x07", "\u009b".encode()]


def test_visible_writes_every_control_character_as_an_escape():
    shown = visible(NASTY + "\r\ttab")
    assert shown == ("\\x9b1A \\x1b]0;owned\\x07 \\x1b]52;c;cm0gLXJmIH4K\\x07 \\x1b[2J\\x1b[H \\x07 done\\x0d\ttab")
    assert visible("plain text, ünïcode ✓") == "plain text, ünïcode ✓"


@pytest.fixture
def env(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    (tmp_path / "cluster.yaml").write_text(
        f"cluster: {{name: escapes, workspace: {tmp_path / 'ws'}}}\n"
        "nodes: [{name: n0, host: local, roles: [trainer]}]\n"
        f"job: {{mode: collective, master_port: auto, trainer: {{command: {sys.executable} {tmp_path / 'prog.py'}}},"
        " watchdog: {enabled: false}}\n")
    env = {**os.environ, "FABTRAIN_CLUSTER": str(tmp_path / "cluster.yaml"), "FABTRAIN_STATE_DIR": str(tmp_path / "st")}
    for step in ("deploy", "start-trainers"):
        subprocess.run([FAB, step], cwd=REPO, env=env, capture_output=True, timeout=120, check=True)
    return env


@pytest.mark.parametrize("task", ["logs", "status"])
def test_a_programs_escape_sequences_are_shown_not_sent(task, env):
    out = b""
    for _ in range(50):  # the program writes its line at once and exits
        out = subprocess.run([FAB, task], cwd=REPO, env=env, capture_output=True, timeout=120).stdout
        if b"owned" in out:
            break
    assert b"\\x1b]0;owned\\x07" in out and b"\\x1b]52;c;" in out and b"\\x9b1A" in out, out
    for byte in CONTROL_BYTES:
        assert byte not in out, (byte, out)
