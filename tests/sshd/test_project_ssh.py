"""fabtrain as a user meets it: `pip install` into a fresh virtualenv, a project of
one's own outside this checkout, real sshd nodes whose workspaces are elsewhere."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.procscan import wait_for
from tests.support.sshd import free_port, login_account

from tests.support import REPO
pytestmark = pytest.mark.ssh


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv with fabtrain pip-installed from a copy of this checkout (no torch)."""
    root = tmp_path_factory.mktemp("installed")
    src = root / "src"  # pip builds in the source tree: keep the checkout clean
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "fabtrain", src / "fabtrain", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    out = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import fabtrain; print(fabtrain.__file__)"],
                           cwd=root, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where  # the installed package, not this checkout
    return venv


def run_fab(venv: Path, project: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`fab` as a user runs it: the installed one, in the project, nothing of this checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FABTRAIN_CLUSTER")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", FABTRAIN_STATE_DIR=str(project.parent / "state"))
    return subprocess.run([str(venv / "bin" / "fab"), *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=timeout)


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, f"{out.args} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def project_cluster(sshd, workspaces: Path, command: str, *, code: str = ".", name: str = "myproject") -> dict:
    nodes = [{"name": n.name, "host": n.address, "roles": ["trainer"], "workspace": str(workspaces / f"ws-{n.name}")}
             for n in sshd.nodes]
    return {"cluster": {"name": name, "python": sys.executable, "ssh": sshd.ssh_settings("strict")},
            "nodes": nodes,
            "job": {"mode": "collective", "master_port": free_port(["0.0.0.0"]), "code": code,
                    "trainer": {"per_node": 1, "command": command},
                    # auto: a finished job's coordinator may still hold its port while the next test starts
                    "watchdog": {"interval": 0.5, "port": "auto"}}}


def job_ids(ws: Path) -> list[str]:
    return sorted(p.name for p in (ws / "jobs").iterdir()) if (ws / "jobs").is_dir() else []


def test_a_project_outside_the_checkout_deploys_and_runs_its_own_train_py(sshd, installed, tmp_path):
    # The torchrun example, copied as a user would, run with plain `python` (3 ranks, one per node).
    project = tmp_path / "myproject"
    project.mkdir()
    for name in ("train.py", "fabfile.py"):
        shutil.copy(REPO / "examples" / "torchrun-ddp" / name, project / name)
    (project / "data").mkdir()
    (project / "data" / "big.bin").write_bytes(b"x" * 1000)  # the data dir is never shipped as code
    (project / ".venv").mkdir()
    (project / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")  # nor a virtualenv
    (project / "notes.tmp").write_text("scratch")
    (project / ".fabtrainignore").write_text("*.tmp\n")
    doc = project_cluster(sshd, tmp_path / "elsewhere", "python train.py --epochs 1")
    doc["job"]["data"] = {"dir": "data"}
    (project / "cluster.yaml").write_text(yaml.safe_dump(doc))

    assert "deploy" in ok(run_fab(installed, project, "--list"))
    out = ok(run_fab(installed, project, "deploy", "start-trainers"))
    assert "code hash " in out  # not a git repository: a content hash says which code
    ok(run_fab(installed, project, "watch", "--timeout", "180"))  # exits 0 only when the job finished

    for rank, node in enumerate(sshd.nodes):
        ws = tmp_path / "elsewhere" / f"ws-{node.name}"
        shipped = {p.name for p in (ws / "code").iterdir()}
        assert {"train.py", "fabfile.py", "cluster.yaml"} <= shipped
        assert not shipped & {"data", ".venv", "notes.tmp"}, shipped
        (job_id,) = job_ids(ws)
        log = (ws / "jobs" / job_id / "logs" / f"trainer-{rank}.log").read_text()
        # 1 + 2 + 3: all three ranks were in one process group.
        assert f"rank {rank}: all_reduce sum 6 world 3" in log, log


def test_a_deploy_while_a_job_runs_leaves_that_jobs_code_as_it_was(sshd, installed, tmp_path):
    # The code lives in src/, beside the project's own fabtrain/ and orchestrator/
    # folders: fabtrain's agent runs from its own runtime and is not shadowed.
    project = tmp_path / "proj"
    src = project / "src"
    (src / "fabtrain").mkdir(parents=True)
    (src / "fabtrain" / "__init__.py").write_text("raise ImportError('the project shadows fabtrain')\n")
    (src / "orchestrator").mkdir()
    (src / "orchestrator" / "agent.py").write_text("raise SystemExit('the project shadows the old agent')\n")
    shutil.copy(REPO / "tests" / "programs" / "ticker.py", src / "ticker.py")
    shutil.copy(REPO / "examples" / "torchrun-ddp" / "fabfile.py", project / "fabfile.py")
    (project / "cluster.yaml").write_text(yaml.safe_dump(
        project_cluster(sshd, tmp_path / "elsewhere", "python ticker.py", code="src", name="snapshots")))
    ws = tmp_path / "elsewhere" / f"ws-{sshd.nodes[0].name}"
    try:
        ok(run_fab(installed, project, "deploy", "start-trainers"))
        (job_id,) = job_ids(ws)
        job = ws / "jobs" / job_id
        run = json.loads((job / "run" / "trainer-0.json").read_text())
        first = (src / "ticker.py").read_text()
        (src / "ticker.py").write_text(first + "# changed after the job started\n")
        ok(run_fab(installed, project, "deploy"))

        assert (ws / "code" / "ticker.py").read_text().endswith("# changed after the job started\n")
        assert (job / "code" / "ticker.py").read_text() == first  # the running job's code is unchanged
        assert wait_for(lambda: os.path.realpath(f"/proc/{run['pid']}/cwd") == str(job / "code"), 5)

        # The agent is alive, runs from fabtrain's runtime, and watches the job.
        agent = json.loads((job / "run" / "agent.json").read_text())
        assert os.path.realpath(f"/proc/{agent['pid']}/cwd").startswith(str(ws / "runtime"))
        assert wait_for(lambda: (job / "health.json").exists() and
                        json.loads((job / "health.json").read_text()).get("processes"), 15)
        status = ok(run_fab(installed, project, "status"))
        assert "code hash " in status
    finally:
        ok(run_fab(installed, project, "kill-all"))
    ok(run_fab(installed, project, "start-trainers"))  # the next job takes the new code
    try:
        second = [j for j in job_ids(ws) if j != job_id][0]
        assert (ws / "jobs" / second / "code" / "ticker.py").read_text().endswith("# changed after the job started\n")
    finally:
        ok(run_fab(installed, project, "kill-all"))


# -- two nodes, one machine, one user: their workspaces never mix ---------------------------

TEST_USER = "fabtrain-user"


@pytest.fixture(scope="module")
def plain_user(sshd):
    """A non-root account whose default workspace two sshd "nodes" on this machine share a home for."""
    return login_account(TEST_USER, sshd.user_key)


def user_cluster(sshd, project: Path, watchdog: dict | None = None, **workspace) -> Path:
    settings = {**sshd.ssh_settings("strict"), "user": TEST_USER}
    nodes = [{"name": n.name, "host": n.address, "roles": ["trainer"], **workspace} for n in sshd.nodes[:2]]
    # root's interpreter lives under /root (0700): the user's nodes run the system Python.
    doc = {"cluster": {"name": "homes", "python": "/usr/bin/python3", "ssh": settings}, "nodes": nodes,
           "job": {"mode": "collective", "trainer": {"command": "python3 ticker.py"},
                   "watchdog": {"port": "auto", **(watchdog or {})}}}
    path = project / ("cluster.yaml" if not workspace else "shared.yaml")
    path.write_text(yaml.safe_dump(doc))
    return path


def live_tickers(user) -> dict[str, int]:
    """Every ticker of that user, found in /proc (by uid and cmdline, not by fabtrain's marker)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != user.pw_uid:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"ticker.py" in cmd and cmd[0].endswith(b"python3") and state != "Z":
            found[Path(f"/proc/{pid}/cwd").resolve().parts[-4]] = int(pid)  # <home>/.fabtrain/homes/<node>/jobs/<id>/code
    return found


def test_two_nodes_with_one_home_keep_their_jobs_apart(sshd, installed, plain_user, tmp_path):
    project = tmp_path / "homes"
    project.mkdir()
    shutil.copy(REPO / "tests" / "programs" / "ticker.py", project / "ticker.py")
    shutil.copy(REPO / "examples" / "torchrun-ddp" / "fabfile.py", project / "fabfile.py")
    # on_failure keep: stopping n1 fails the job, and the job's agents would then stop n2's part too
    # (sooner or later, by load); kept, what could still stop n2's ticker is kill-all reaching into n2.
    user_cluster(sshd, project, watchdog={"on_failure": "keep"})
    n1, n2 = (n.name for n in sshd.nodes[:2])
    home = Path(plain_user.pw_dir)
    try:
        ok(run_fab(installed, project, "check", "deploy", "start-trainers"))
        assert wait_for(lambda: set(live_tickers(plain_user)) == {n1, n2}, 15), live_tickers(plain_user)
        status = ok(run_fab(installed, project, "status"))
        assert status.count("trainer-") == 2, status  # each node lists its own trainer, once
        before = live_tickers(plain_user)

        # kill-all through a cluster file that has only n1: n2's trainer lives on.
        only_n1 = yaml.safe_load((project / "cluster.yaml").read_text())
        only_n1["nodes"] = only_n1["nodes"][:1]
        (project / "n1.yaml").write_text(yaml.safe_dump(only_n1))
        out = subprocess.run([str(installed / "bin" / "fab"), "kill-all"], cwd=project, capture_output=True, text=True,
                             env={**os.environ, "FABTRAIN_CLUSTER": "n1.yaml",
                                  "FABTRAIN_STATE_DIR": str(tmp_path / "state")}, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert wait_for(lambda: live_tickers(plain_user) == {n2: before[n2]}, 10), (live_tickers(plain_user), before)
        assert (home / ".fabtrain" / "homes" / n1).is_dir() and (home / ".fabtrain" / "homes" / n2).is_dir()
    finally:
        ok(run_fab(installed, project, "kill-all"))
    assert not live_tickers(plain_user)


def test_a_workspace_two_nodes_share_is_refused_in_one_line(sshd, installed, plain_user, tmp_path):
    project = tmp_path / "shared"
    project.mkdir()
    shutil.copy(REPO / "examples" / "torchrun-ddp" / "fabfile.py", project / "fabfile.py")
    shared = f"~/.fabtrain/shared-{tmp_path.name}"  # one directory for both nodes: one home
    user_cluster(sshd, project, workspace=shared)
    env = {**os.environ, "FABTRAIN_CLUSTER": "shared.yaml", "FABTRAIN_STATE_DIR": str(tmp_path / "state")}
    out = subprocess.run([str(installed / "bin" / "fab"), "check"], cwd=project, capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    refusals = [line for line in out.stdout.splitlines() if "is already node" in line]
    assert len(refusals) == 1 and "give node" in refusals[0], out.stdout
    assert "Traceback" not in out.stdout + out.stderr
