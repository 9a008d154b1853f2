"""The local tests' fixture: jobs on local nodes, each killed at the end of its test."""
import pytest

from tests.support.local_job import LocalJob


@pytest.fixture
def local_job(tmp_path):
    made = []

    def make(nodes, **job):
        j = LocalJob(tmp_path, nodes, {"name": "local", **job})
        made.append(j)
        return j
    yield make
    for j in made:
        j.cleanup()
