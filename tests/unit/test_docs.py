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
        assert re.search(rf"^\s*(# )?(- )?{field}:", reference, re.M), f"{section}.{field} is not documented"


def yaml_examples():
    """Every ```yaml block of README.md and docs/*.md, as printed: (file, first line, text)."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in re.finditer(r"^```yaml\n(.*?)^```", text, re.M | re.S):
            yield doc.relative_to(REPO), text[:m.start()].count("\n") + 2, m.group(1)


EXAMPLES = list(yaml_examples())
# A fragment of cluster.yaml is loaded inside the smallest cluster file around it.
AROUND = "cluster: {name: docs}\nnodes: [{name: n0, host: local, roles: [pserver, trainer]}]\n"


def test_the_docs_have_yaml_examples():
    assert any(str(f) == "README.md" for f, _, _ in EXAMPLES) and len(EXAMPLES) >= 4


@pytest.mark.parametrize("where,line,text", EXAMPLES, ids=[f"{f}:{n}" for f, n, _ in EXAMPLES])
def test_every_yaml_example_in_the_docs_loads_as_printed(tmp_path, where, line, text):
    from fabtrain.config.cluster import load_cluster
    from fabtrain.config.yamlfile import load_yaml
    doc = load_yaml(text)  # fabtrain's strict reader, whatever the file is for
    assert isinstance(doc, dict), f"{where}:{line}"
    if "scrape_configs" in doc:  # Prometheus's file, not fabtrain's
        return
    p = tmp_path / "cluster.yaml"
    p.write_text(text if "cluster" in doc else AROUND + ("" if "job" in doc else "job: {mode: pserver}\n") + text)
    cluster = load_cluster(p)
    assert cluster.nodes, f"{where}:{line}"


def test_the_cluster_reference_loads_as_printed_in_fab_plan_offline(tmp_path):
    text = next(t for f, _, t in EXAMPLES if str(f) == "README.md" and t.startswith("cluster:"))
    (tmp_path / "cluster.yaml").write_text(text)
    out = subprocess.run([str(Path(sys.executable).parent / "fab"), "-r", str(REPO), "plan", "--offline"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "FABTRAIN_CLUSTER": str(tmp_path / "cluster.yaml")})
    assert out.returncode == 0, out.stderr
    assert "# agent" in out.stdout and "launch.py --exit" in out.stdout


def test_fabtrain_init_writes_the_train_py_its_cluster_file_runs_and_keeps_one_that_exists(tmp_path):
    from fabtrain.cli import main
    assert main(["init", str(tmp_path / "a")]) == 0
    train = tmp_path / "a" / "train.py"
    assert "command: python train.py" in (tmp_path / "a" / "cluster.yaml").read_text()
    metrics = tmp_path / "m.jsonl"
    run = subprocess.run([sys.executable, "-c", "import time; time.sleep = lambda s: None; "
                          f"exec(open({str(train)!r}).read())"], capture_output=True, text=True, timeout=60,
                         env={"FABTRAIN_METRICS": str(metrics), "RANK": "1", "WORLD_SIZE": "2"})
    assert run.returncode == 0, run.stderr
    import json
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 60 and records[0]["rank"] == 1 and "loss" in records[-1]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train.py").write_text("mine\n")
    assert main(["init", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "train.py").read_text() == "mine\n"


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
