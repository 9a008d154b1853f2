"""A node that cannot run its python: every task says so in one line that names the node once."""
import os
import re
import subprocess

import pytest

from tests.conftest import FAB, REPO


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("badpython")
    (root / "cluster.yaml").write_text(f"cluster: {{name: badpy, workspace: {root}/ws, python: {root}/no/python3}}\n"
                                       "nodes: [{name: n0, host: local, roles: [pserver, trainer]}]\n"
                                       "job: {mode: pserver}\n")
    return root


def run(project, *argv):
    env = {**os.environ, "FABTRAIN_CLUSTER": str(project / "cluster.yaml"), "FABTRAIN_STATE_DIR": str(project / "st")}
    return subprocess.run([FAB, "-r", str(REPO), *argv], cwd=project, capture_output=True, text=True, timeout=120,
                          env=env)


def test_a_start_names_the_node_once(project):
    out = run(project, "start-pserver")
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert re.search(rf"^n0: FAILED: cannot run {project}/no/python3: No such file or directory$", out.stdout, re.M), \
        out.stdout


def test_status_shows_the_node_in_state_error_with_the_reason(project):
    out = run(project, "status")
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"^n0 +- +ERROR", out.stdout, re.M), out.stdout
    assert re.search(rf"^n0: cannot run {project}/no/python3: No such file or directory$", out.stdout, re.M), out.stdout
