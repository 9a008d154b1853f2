"""Fixtures shared by the tests, and what a missing part of the machine does to them.

A test that needs something this machine may lack (Chromium, paddlepaddle, sshd,
network namespaces, tmpfs mounts, a GPU) calls `require(available, part, why)`:
here it skips, naming the part; under CI=true it FAILS, because CI must run
everything (`make test` installs every part) -- only a GPU may be missing
there. As a safety net, every other skip (a plain pytest.skip, importorskip,
a skipif mark) is turned into a failure under CI=true too.
"""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster, slurm_missing
from tests.support.sshd import SshdCluster, ensure_openssh

from tests.support import REPO  # noqa: E402,F401 (re-exported: tests import REPO from here)
FAB = str(Path(sys.executable).parent / "fab")

CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
MAY_BE_MISSING_IN_CI = "gpu"
_MISSING = " is missing: "


def require(available, part: str, why: str) -> None:
    """Skip the calling test when `part` is not available; fail it under CI=true unless the part is a GPU."""
    if available:
        return
    message = f"{part}{_MISSING}{why}"
    if CI and part != MAY_BE_MISSING_IN_CI:
        pytest.fail(f"{message} (CI=true: every part but a GPU must be there; `make test` installs them)",
                    pytrace=False)
    pytest.skip(message)


def require_import(module: str, part: str, why: str):
    """The imported module, or require()'s skip / failure when it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        require(False, part, f"{why} ({e})")


def _allowed_skip(reason: str) -> bool:
    return reason.startswith(f"{MAY_BE_MISSING_IN_CI}{_MISSING}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr or "")
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped test is a failed one, whatever skipped it, unless it lacked only a GPU."""
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not _allowed_skip(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, where only a GPU may be missing: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped while it is collected (a module-level skip or importorskip)."""
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped:
        reason = _skip_reason(report)
        if not _allowed_skip(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, where only a GPU may be missing: {reason}"


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """Three real sshd nodes on 127.0.0.2-4, shared by the whole test session."""
    missing = ensure_openssh()
    require(not missing, "sshd", f"{', '.join(missing)} not installed and apt-get could not install "
                                 f"them (run `make test` as root, or install them)")
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


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real Slurm cluster (munged, slurmctld, three slurmd) for one test module, stopped by pid."""
    missing = slurm_missing()
    require(not missing, "slurm-wlm and munge", f"apt-get could not install {' '.join(missing)}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()
