"""Under CI=true a test whose part is missing fails instead of skipping (tests/conftest.py).

Runs pytest on a small generated test file with the suite's conftest as a plugin,
with and without CI=true, and reads each test's outcome from its JUnit XML.
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

TESTS = '''
import pytest
from tests.conftest import require, require_import

def test_missing_part():
    require(False, "chromium", "hidden for this test")

def test_missing_module():
    require_import("no_such_module_fabtrain", "paddlepaddle", "hidden for this test")

def test_missing_gpu():
    require(False, "gpu", "no GPU on this machine")

def test_a_plain_skip():
    pytest.skip("a skip that bypasses require()")

def test_importorskip():
    pytest.importorskip("no_such_module_fabtrain")

@pytest.mark.skipif(True, reason="a skipif mark")
def test_skipif():
    pass

def test_present_part():
    require(True, "sshd", "there")

@pytest.mark.xfail(reason="an expected failure is not a skip")
def test_xfail():
    assert False
'''


def outcomes(tmp_path, ci):
    (tmp_path / "test_parts.py").write_text(TESTS)
    xml = tmp_path / f"ci-{ci}.xml"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PYTHONPATH=str(REPO), **({"CI": ci} if ci else {}))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                    f"--junitxml={xml}", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_parts.py")],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        name = case.get("name")
        if "skipped" in kinds and "xfail" in (case.find("skipped").get("type") or "") + \
                (case.find("skipped").get("message") or ""):
            result[name] = "xfailed"
        else:
            result[name] = kinds[0] if kinds else "passed"
    return result


def test_a_missing_part_skips_here_and_fails_under_ci(tmp_path):
    local = outcomes(tmp_path, None)
    assert local == {"test_missing_part": "skipped", "test_missing_module": "skipped", "test_missing_gpu": "skipped",
                     "test_a_plain_skip": "skipped", "test_importorskip": "skipped", "test_skipif": "skipped",
                     "test_present_part": "passed", "test_xfail": "xfailed"}, local
    ci = outcomes(tmp_path, "true")
    # A skipif mark acts in the setup phase: a failure there is reported as an error.
    assert ci == {"test_missing_part": "failure", "test_missing_module": "failure", "test_missing_gpu": "skipped",
                  "test_a_plain_skip": "failure", "test_importorskip": "failure", "test_skipif": "error",
                  "test_present_part": "passed", "test_xfail": "xfailed"}, ci
    assert outcomes(tmp_path, "false") == local     # CI=false is not CI
