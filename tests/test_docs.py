"""The README documents every task and every cluster.yaml field."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fabtrain.config.cluster import FIELDS

REPO = Path(__file__).resolve().parent.parent
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


def env_table(text):
    """The environment table: {column title: {variable: cell}} (a cell starting with — means not set)."""
    start = text.index("| variables | pserver mode: pservers |")
    lines = text[start:].split("\n\n")[0].splitlines()
    titles = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    table = {t: {} for t in titles}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"[A-Z][A-Z0-9_]+", cells[0].split("(")[0]):
            for title, cell in zip(titles, cells[1:]):
                table[title][name] = cell
    return table


def test_environment_table_says_what_the_plan_sets_in_every_mode():
    from fabtrain.config.cluster import parse_cluster
    from fabtrain.plan.plan import make_plan
    architecture = (REPO / "docs" / "architecture.md").read_text()
    assert env_table(README) == env_table(architecture), "README's environment table differs from architecture.md's"
    nodes = [{"name": n, "host": f"10.0.0.{i}", "roles": ["pserver", "trainer"], "gpus": 2} for i, n in enumerate("ab", 1)]
    collective = [dict(n, roles=["trainer"]) for n in nodes]
    jobs = {"pserver mode: pservers": ("pserver", {"mode": "pserver"}, nodes),
            "pserver mode: trainers": ("trainer", {"mode": "pserver"}, nodes),
            "collective: trainers": ("trainer", {"mode": "collective"}, collective),
            "collective, a `torchrun` command (one a node)": ("trainer", {"mode": "collective"}, collective)}
    table = env_table(architecture)
    assert set(table) == set(jobs)
    for title, (role, job, job_nodes) in jobs.items():
        env = set()
        for use_gpu in (True, False):  # a cell may hold for one of them only ("without GPUs")
            trainer = {"use_gpu": use_gpu, **({"command": "torchrun t.py"} if "torchrun" in title else {})}
            plan = make_plan(parse_cluster({"cluster": {"name": "t", "python": "/opt/py/bin/python3"},
                                            "nodes": job_nodes, "job": {**job, "trainer": trainer}}, "t.yaml"), "J")
            env |= {k for n in plan.nodes for p in n.processes if p.role == role for k in p.env}
        documented = {k for k, cell in table[title].items() if not cell.startswith("—")}
        # The restart counts are added when a process is spawned (fabtrain/node/spawn.py), not in the plan.
        assert env | {"FABTRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"} == documented, title
