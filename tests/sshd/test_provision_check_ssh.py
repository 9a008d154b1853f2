"""fab provision and fab check on real sshd nodes."""
import base64
import hashlib
import re
import shlex
import sys
import zipfile

import pytest

from tests.support.sshd import write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(240)]


def make_wheel(directory, name="fabtrain_probe_pkg", version="1.0"):
    """A minimal pure-Python wheel, so the offline install needs no index at all."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def test_provision_builds_the_workspace_and_an_offline_venv(fab, tmp_path, sshd):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    make_wheel(wheelhouse)
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("fabtrain_probe_pkg==1.0  # from the wheelhouse\n")
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"])],
                         job={"mode": "collective", "trainer": {"command": "true"}})
    out = fab("provision", "--venv", "--wheelhouse", str(wheelhouse), "--requirements", str(reqs), cluster=path, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    for node in ("node1", "node2"):
        ws = tmp_path / f"ws-{node}"
        assert {p.name for p in ws.iterdir()} >= {"code", "data", "jobs", "runtime", "venv", "wheelhouse"}
        assert re.search(rf"^{node}: workspace {ws}, venv {ws}/venv/bin/python$", out.stdout, re.M), out.stdout
        site = list((ws / "venv" / "lib").glob("python3*/site-packages/fabtrain_probe_pkg/__init__.py"))
        assert site, "the wheel was installed into the node's venv"


def test_provision_with_a_missing_wheelhouse_is_a_clear_error(fab, tmp_path, sshd):
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"])],
                         job={"mode": "collective", "trainer": {"command": "true"}})
    out = fab("provision", "--venv", "--wheelhouse", str(tmp_path / "nope"), cluster=path)
    assert out.returncode == 2 and "--wheelhouse" in out.stderr and "not a directory" in out.stderr


def other_python(directory):
    """An interpreter that differs from the suite's wherever its venv came from (even from
    /usr/bin/python3): the venv's base interpreter without site-packages (-S: no torch, psutil or
    paddle, even where the system has them), reporting Python 3.9.99, as a node with an older Python
    and no packages would. node_ops runs `<python> -c <bootstrap> <args>`; the wrapper changes
    sys.version, then runs the bootstrap with the same arguments."""
    real = getattr(sys, "_base_executable", None) or sys.executable
    wrapper = directory / "python-3.9.99"
    prelude = 'import sys; sys.version = "3.9.99 " + sys.version.split(" ", 1)[1]; exec(sys.argv.pop(1))'
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = -c ] && shift\nexec {shlex.quote(real)} -S -c {shlex.quote(prelude)} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_check_reports_versions_and_flags_what_differs(fab, tmp_path, sshd):
    # node2's Python is another version without torch: check must flag both and fail.
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node2", ["trainer"])],
                         job={"mode": "collective", "trainer": {"command": "python -m workload.ddp"}},
                         extra_node_fields={"node2": {"python": str(other_python(tmp_path))}})
    out = fab("check", cluster=path)
    assert out.returncode == 1
    import torch
    assert re.search(r"^node2\s+PROBLEM\s+3\.9\.99 \(!\)\s+- \(!\)", out.stdout, re.M), out.stdout
    assert re.search(rf"^node1\s+ok\s+\S+ \(!\)\s+{re.escape(torch.__version__)} \(!\)", out.stdout, re.M), out.stdout
    assert re.search(r"^node2\s+PROBLEM\s", out.stdout, re.M)
    assert "node2: torch not installed (the reference workload needs it)" in out.stdout
    assert "(!) differs across nodes" in out.stdout
    # Both sshd nodes run on this machine's kernel: its clock, no offset (not the round trip's +-bound).
    assert re.search(r"^node1\s.*\s0 \(this machine\)$", out.stdout, re.M), out.stdout
    assert "±" not in out.stdout, out.stdout
