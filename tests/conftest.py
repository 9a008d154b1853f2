import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sshd import SshdCluster

REPO = Path(__file__).resolve().parent.parent
FAB = str(Path(sys.executable).parent / "fab")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """Three real sshd nodes on 127.0.0.2-4, shared by the whole test session."""
    cluster = SshdCluster(tmp_path_factory.mktemp("sshd"), count=3)
    yield cluster
    cluster.close()


@pytest.fixture
def fab(tmp_path):
    """Run `fab` as a user would: a subprocess in the repo, with a cluster file."""
    state = tmp_path / "controller-state"

    def run(*args, cluster, timeout=180, check=None, env=None):
        full_env = {**os.environ, "FABTRAIN_CLUSTER": str(cluster), "FABTRAIN_STATE_DIR": str(state), **(env or {})}
        out = subprocess.run([FAB, *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert (out.returncode == 0) == check, f"fab {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out
    return run
