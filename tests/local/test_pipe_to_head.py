"""Every task piped into a reader that stops early (`fab status | head -3`) stops quietly: no traceback."""
import os
import subprocess

import pytest

from tests.conftest import FAB, REPO

CLUSTER = """cluster: {name: piped, workspace: %s}
nodes:
%s
job: {mode: collective, master_port: auto, trainer: {command: "seq 100"}, watchdog: {enabled: false}}
"""


@pytest.fixture
def env(tmp_path):
    nodes = "\n".join(f"  - {{name: n{i}, host: local, roles: [trainer]}}" for i in range(2))
    (tmp_path / "cluster.yaml").write_text(CLUSTER % (tmp_path / "ws", nodes))
    return {**os.environ, "FABTRAIN_CLUSTER": str(tmp_path / "cluster.yaml"),
            "FABTRAIN_STATE_DIR": str(tmp_path / "state")}


@pytest.mark.parametrize("task", [["status"], ["plan", "--offline"], ["check"], ["logs"]])
def test_a_task_whose_reader_is_gone_stops_quietly(task, env):
    if task in (["logs"], ["status"]):  # a job to report on, whose log has lines: `seq 100`, over at once
        for step in ("deploy", "start-trainers"):
            subprocess.run([FAB, step], cwd=REPO, env=env, capture_output=True, timeout=120, check=True)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write to stdout fails with EPIPE
    try:
        p = subprocess.run([FAB, *task], cwd=REPO, env=env, stdout=write, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr and "Errno" not in p.stderr, p.stderr
    assert p.returncode == 141, (p.returncode, p.stderr)


def test_status_into_head_prints_its_first_lines_and_no_traceback(env):
    shell = f"set -o pipefail; {FAB} plan --offline | head -3"
    p = subprocess.run(["bash", "-c", shell], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith("# job ") and len(p.stdout.splitlines()) == 3, p.stdout
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
    assert p.returncode in (0, 141), p.returncode  # 0 when the output fitted the pipe before head left
