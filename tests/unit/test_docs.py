"""The README documents every task and every cluster.yaml field."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fabtrain.config.cluster import FIELDS

from tests.support import REPO
README = (REPO / "README.md").read_text()
EXPECTED_TASKS = {"plan", "provision", "check", "deploy", "split-data", "copy-data", "start-pserver",
                  "start-trainers", "status", "logs", "watch", "dashboard", "kill-all"}


def fab_tasks():
    out = subprocess.run([str(Path(sys.executable).parent / "fab"), "--list"], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ") and line.split()
            and not line.startswith("   ")}


def test_fab_list_shows_every_task_of_the_mission():
    assert fab_tasks() >= EXPECTED_TASKS


def test_every_task_is_in_the_task_reference():
    for task in fab_tasks():
        assert re.search(rf"^\| `{re.escape(task)}` \|", README, re.M), f"README task reference lacks {task}"


@pytest.mark.parametrize("section", sorted(FIELDS))
def test_every_cluster_field_is_in_the_reference(section):
    reference = README[README.index("## cluster.yaml reference"):README.index("## Running your own job")]
    for field in FIELDS[section]:
        assert re.search(rf"^\s*(- )?{field}:", reference, re.M), f"{section}.{field} is not documented"
