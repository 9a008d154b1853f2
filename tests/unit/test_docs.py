"""The docs document every task and every cluster.yaml field, and their examples run as printed."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fabtrain.config.cluster import FIELDS

from tests.support import REPO
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
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
    reference = (DOCS / "tasks.md").read_text()
    for task in fab_tasks():
        assert re.search(rf"^## `{re.escape(task)}`$", reference, re.M), f"docs/tasks.md lacks {task}"


@pytest.mark.parametrize("section", sorted(FIELDS))
def test_every_cluster_field_is_in_the_reference(section):
    reference = (DOCS / "configuration.md").read_text()
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
    text = next(t for f, _, t in EXAMPLES if str(f) == "docs/configuration.md" and t.startswith("cluster:"))
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
    programs = (DOCS / "programs.md").read_text()
    assert env_table(programs) == env_table(architecture), "docs/programs.md's environment table differs from architecture.md's"
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


def doc_files():
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_docs_index_lists_every_doc_and_every_link_between_docs_resolves():
    index = (DOCS / "README.md").read_text()
    for doc in sorted(DOCS.glob("*.md")):
        if doc.name != "README.md":
            assert f"]({doc.name})" in index, f"docs/README.md does not list {doc.name}"
    for doc in doc_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)}: link to {target}, which does not exist"


def fab_commands():
    """(file, line, argv after `fab`) of every `fab ...` command in a ```sh block of the docs."""
    import shlex
    for doc in doc_files():
        text = doc.read_text()
        for m in re.finditer(r"^```sh\n(.*?)^```", text, re.M | re.S):
            first = text[:m.start()].count("\n") + 2
            for i, line in enumerate(m.group(1).replace("\\\n", " ").splitlines()):
                code = line.split(" #")[0]
                if "…" in code or "..." in code:
                    continue
                words = shlex.split(code)
                for at, w in enumerate(words):
                    if w == "fab" or w.endswith("/fab"):
                        yield f"{doc.relative_to(REPO)}:{first + i}", words[at + 1:]
                        break


def test_every_fab_command_in_the_docs_names_real_tasks_and_options():
    from fabtrain import tasks
    known = {name.replace("_", "-"): getattr(tasks, name) for name in tasks.__all__}
    core = {"-r", "-i", "--list", "--help", "--prompt-for-login-password", "--prompt-for-passphrase"}
    commands = list(fab_commands())
    assert len(commands) >= 20
    for where, argv in commands:
        task, i = None, 0
        while i < len(argv):
            word = argv[i]
            if word in ("|", "&&", ";") or word.startswith(("$", ">")):
                break
            if word.startswith("-"):
                name = word.split("=")[0]
                if task is None or name in core:
                    assert name in core, f"{where}: fab {' '.join(argv)}: {name} is not an option of fab"
                    i += 2 if name in ("-r", "-i") else 1
                    if name == "--help" and i < len(argv):
                        assert argv[i] in known, f"{where}: no task {argv[i]}"
                        i += 1
                    continue
                args = {f"--{a.name}": a for a in known[task].get_arguments()}
                args.update({f"-{a.names[1]}": a for a in known[task].get_arguments() if len(a.names) > 1})
                assert name in args, f"{where}: fab {' '.join(argv)}: {task} has no option {name}"
                i += 1 if args[name].kind is bool or "=" in word else 2
                continue
            assert word in known, f"{where}: fab {' '.join(argv)}: no task named {word}"
            task, i = word, i + 1


def test_slurm_md_says_how_long_a_lost_and_a_frozen_node_take_as_the_code_does():
    """docs/slurm.md's timings of a node that stops answering, against the coordinator's own rule and words."""
    from fabtrain.config.cluster import parse_cluster
    from fabtrain.node.coordination.board import Board
    interval = parse_cluster({"cluster": {"name": "t"}, "nodes": [{"name": "a", "host": "local", "roles": ["trainer"]}],
                              "job": {"mode": "collective"}}, "t.yaml").job.watchdog.interval
    peer = max(5 * interval, 5.0)  # fabtrain/node/coordination/client.py and agent/policy.py: one rule
    board = Board("20261127-000000-0001", ["node0", "node2"], peer)
    text = " ".join((DOCS / "slurm.md").read_text().split())
    assert f"`peer_timeout`, max(5 × `interval`, 5 s): {peer:g} s by default" in text
    assert f"`hung_timeout`, {board.hung_timeout / peer:g} × `peer_timeout`: {board.hung_timeout:g} s by default" in text
    # The lines quoted are the coordinator's (fabtrain/node/coordination/board.py), at those timeouts.
    from fabtrain.node.coordination.board import Peer, _silence
    lost = _silence("node2", Peer(seen=0.0, beat_seen=0.0), False, peer, peer)
    assert f"lost: {lost}`" in text, lost
    frozen = _silence("node2", Peer(seen=0.0, beat_seen=0.0), True, board.hung_timeout, peer)
    assert frozen.endswith(f"stayed open (hung_timeout {board.hung_timeout:g} s)")
    assert f"stayed open (hung_timeout {board.hung_timeout:g} s)" in text


def token_headers() -> set[str]:
    """The request headers the dashboard's guard reads a token from, as its code names them."""
    import ast
    from fabtrain.dashboard import guard
    tree = ast.parse((REPO / "fabtrain" / "dashboard" / "guard.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "header_token")
    found = set()
    for call in ast.walk(fn):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "get" \
                and ast.unparse(call.func.value) == "request.headers":
            arg = call.args[0]
            found.add(arg.value if isinstance(arg, ast.Constant) else getattr(guard, arg.id))
    return found


def test_the_docs_name_every_header_the_dashboard_takes_its_token_from():
    from fabtrain.dashboard import create_app
    headers = token_headers()
    assert headers == {"Authorization", "X-Fabtrain-Token"}, headers
    app = create_app({"COLLECTOR": object(), "DASHBOARD_TOKEN": "t" * 48, "ALLOWED_HOSTS": ["127.0.0.1:8265"],
                      "KILL": lambda grace: [], "TESTING": True})
    client = app.test_client()
    forms = {"Authorization": "Bearer " + "t" * 48, "X-Fabtrain-Token": "t" * 48}
    for name in headers:  # each is taken: a wrong token there is refused as wrong (403), not as missing (401)
        wrong = forms[name][:-1] + "x"
        assert client.get("/api/events", headers={"Host": "127.0.0.1:8265", name: wrong}).status_code == 403, name
    for doc in ("security.md", "dashboard.md"):
        text = " ".join((DOCS / doc).read_text().split())
        for name in headers:
            shown = "Authorization: Bearer <token>" if name == "Authorization" else f"{name}: <token>"
            assert f"`{shown}`" in text, f"docs/{doc} does not name {shown}"
        assert "header only" not in text


def test_the_docs_list_every_package_make_test_installs():
    makefile = (REPO / "Makefile").read_text()
    rule = makefile[makefile.index("\nsystem-deps:"):]
    rule = rule[:rule.index("\n\n")]
    packages = set(re.findall(r'missing="\$\$missing ([\w.+-]+)"', rule))
    assert {"openssh-server", "chromium", "openmpi-bin", "gcc", "slurm-wlm", "munge"} <= packages, packages
    readme = README[README.index("## Two commands"):README.index("## A first cluster")]
    started = (DOCS / "getting-started.md").read_text()
    for package in packages:
        assert re.search(rf"(?<![\w-]){re.escape(package)}(?![\w-])", readme), f"README: make test installs {package}"
        assert re.search(rf"(?<![\w-]){re.escape(package)}(?![\w-])", started), \
            f"docs/getting-started.md: make test installs {package}"


def test_the_install_line_names_a_folder_pip_can_install():
    """`pip install /path/to/fabtrain` is a checkout: the folder with pyproject.toml; `./fabtrain` inside it
    is the package, which pip refuses ("is not installable")."""
    text = README + (DOCS / "getting-started.md").read_text()
    lines = re.findall(r"^pip install (\S+)", text, re.M)
    assert lines and "./fabtrain" not in lines, lines
    assert not (REPO / "fabtrain" / "pyproject.toml").exists() and not (REPO / "fabtrain" / "setup.py").exists()
    assert (REPO / "pyproject.toml").exists()
    assert "pip install ." in text  # from the checkout


def test_the_task_reference_names_every_state_a_node_that_did_not_answer_is_shown_in():
    from fabtrain.remote import transport
    text = (DOCS / "tasks.md").read_text()
    status = text[text.index("## `status`"):text.index("## `logs`")]
    check = text[text.index("## `check`"):text.index("## `deploy`")]
    for kind in (transport.UNREACHABLE, transport.NO_REPLY, transport.FAILED):
        label = transport.down_label(kind)
        assert label in status and label in check, f"docs/tasks.md: fab status and fab check show {label}"


def test_the_layout_in_architecture_md_names_every_folder_of_the_package():
    """The README points to docs/architecture.md for the layout: that one copy names every part."""
    text = (DOCS / "architecture.md").read_text()
    layout = text[text.index("## The parts"):text.index("## Data flow")]
    folders = sorted(p.name for p in (REPO / "fabtrain").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert "slurm" in folders
    for name in folders:
        assert re.search(rf"^  {name}/ ", layout, re.M), f"docs/architecture.md's layout lacks fabtrain/{name}/"
    assert "docs/architecture.md" in README[README.index("## Layout"):]
