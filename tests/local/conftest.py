"""The local tests' fixture: jobs on local nodes, each killed at the end of its test."""
import pytest

from tests.support.local_job import LocalJob


@pytest.fixture
def local_job(tmp_path):
    made = []

    def make(nodes, folder=None, **job):
        """A job of its own cluster file, state and workspaces (under `folder`: several jobs in one test)."""
        root = tmp_path / folder if folder else tmp_path
        root.mkdir(exist_ok=True)
        j = LocalJob(root, nodes, {"name": "local", **job})
        made.append(j)
        return j
    yield make
    for j in made:
        j.cleanup()
