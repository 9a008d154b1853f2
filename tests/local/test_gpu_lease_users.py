"""GPU leases between two Unix users on one machine: root holds two GPUs; `nobody` (a real other user, through
setpriv, as the Slurm fixture runs munged) takes the free ones, and can neither take nor free root's by
writing, removing or replacing the lease files."""
from __future__ import annotations

import ast
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fabtrain.node import gpulease
from tests.support import REPO

HOLD = ("import sys, time; from fabtrain.node import gpulease\n"
        "held = gpulease.take(range(4), 2)\n"
        "print(sorted(held) if held else None, flush=True)\n"
        "time.sleep(60)\n")

# What the other user tries: take 3 (too few free), take 2 (the free ones), then every write it could attempt
# on root's lease files; prints what happened.
OTHER = r"""
import os, sys
from fabtrain.node import gpulease
out = {"three": gpulease.take(range(4), 3) is not None}
held = gpulease.take(range(4), 2)
out["two"] = sorted(held) if held else None
d = gpulease.lease_dir()
mine = os.path.join(d, "mine")
os.close(os.open(mine, os.O_CREAT | os.O_WRONLY, 0o644))


def attempt(act):
    try:
        act()
        return "done"
    except OSError as e:
        return os.strerror(e.errno)


for i in map(int, sys.argv[1].split(",")):
    path = os.path.join(d, "gpu%d.lease" % i)
    out[i] = [attempt(lambda: os.unlink(path)), attempt(lambda: os.close(os.open(path, os.O_WRONLY))),
              attempt(lambda: os.rename(mine, path))]
print(repr(out), flush=True)
"""

def test_another_user_takes_only_free_gpus_and_cannot_free_or_take_a_held_lease():
    if os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or not shutil.which("setpriv"):
        pytest.fail("needs root, /usr/bin/python3 and setpriv (util-linux) to run a process as another user")
    nobody = pwd.getpwnam("nobody")
    top = Path(tempfile.mkdtemp(prefix="fabtrain-lease-users-"))
    try:
        top.chmod(0o755)  # the other user must reach the lease directory and the node code
        code = top / "code" / "fabtrain"
        shutil.copytree(REPO / "fabtrain" / "node", code / "node", ignore=shutil.ignore_patterns("__pycache__"))
        (code / "__init__.py").write_text("")
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(top / "code"), "PYTHONDONTWRITEBYTECODE": "1",
               gpulease.LEASE_DIR_ENV: str(top / "leases")}
        root = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True)
        try:
            mine = ast.literal_eval(root.stdout.readline())
            assert len(mine) == 2, mine
            other = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                                    "--clear-groups", "/usr/bin/python3", "-I", "-c",
                                    f"import sys; sys.path.insert(0, {str(top / 'code')!r}); " + OTHER,
                                    ",".join(map(str, mine))],
                                   env=env, capture_output=True, text=True, timeout=60)
            assert other.returncode == 0, other.stderr
            seen = ast.literal_eval(other.stdout.strip())
            assert seen["three"] is False  # only two are free
            assert seen["two"] == sorted(set(range(4)) - set(mine))  # the free ones, none of root's
            for i in mine:
                # remove it, open it for writing, put another file in its place
                assert seen[i] == ["Operation not permitted", "Permission denied", "Operation not permitted"], seen[i]
                assert gpulease.leased(i, env)  # still root's
            assert gpulease.holders(env) == {i: root.pid for i in mine}
        finally:
            root.kill()
            root.wait()
    finally:
        shutil.rmtree(top, ignore_errors=True)
