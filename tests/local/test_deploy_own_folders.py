"""fab deploy never ships what fabtrain itself writes (workspaces, the controller's state, the data dir) as code,
even where it lies inside job.code: deployed twice, a workspace inside the code is not shipped into itself."""
import os
import subprocess
from pathlib import Path

from fabtrain.config.cluster import parse_cluster
from tests.conftest import FAB, REPO


def test_a_workspace_state_and_data_inside_the_code_are_never_shipped(tmp_path):
    project = tmp_path / "proj"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "train.py").write_text("print('training')\n")
    (project / "cluster.yaml").write_text(
        "cluster: {name: inside, workspace: %s}\n"
        "nodes: [{name: n1, host: local, roles: [trainer]}, {name: n2, host: local, roles: [trainer]}]\n"
        "job: {mode: collective, code: ., data: {dir: ./shards},\n"
        "      trainer: {command: python pkg/train.py}, watchdog: {enabled: false}}\n" % (project / "runs"))
    (project / "shards").mkdir()
    (project / "shards" / "part-0").write_text("data\n")
    env = {**os.environ, "FABTRAIN_CLUSTER": str(project / "cluster.yaml"),
           "FABTRAIN_STATE_DIR": str(project / "state")}
    (project / "state").mkdir()
    (project / "state" / "inside.json").write_text("{}")
    outs = [subprocess.run([FAB, "deploy"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
            for _ in range(3)]
    for out in outs:
        assert out.returncode == 0, out.stdout + out.stderr
    for node in ("n1", "n2"):
        code = project / "runs" / node / "code"
        assert (code / "pkg" / "train.py").read_text() == "print('training')\n"
        shipped = sorted(p.relative_to(code).as_posix() for p in code.rglob("*"))
        # (the empty folder that holds the node workspaces may be made; nothing of theirs is shipped)
        assert not [p for p in shipped if p.startswith(("runs/", "state", "shards"))], shipped
    # The code is the same each time: the workspaces that changed meanwhile are not part of its identity.
    assert len({o.stdout.split("code ")[1].split()[0] for o in outs}) == 1, [o.stdout for o in outs]


def test_a_relative_workspace_is_under_the_home_directory(tmp_path, monkeypatch):
    from fabtrain.controller.lifecycle import fabtrain_folders
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FABTRAIN_STATE_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "code").mkdir()
    cluster = parse_cluster({"cluster": {"name": "rel", "workspace": "./code/runs"},
                             "nodes": [{"name": "a", "host": "h1", "roles": ["trainer"]},
                                       {"name": "b", "host": "h2", "roles": ["trainer"], "workspace": "~/other"}],
                             "job": {"mode": "collective", "code": str(tmp_path / "code")}},
                            str(tmp_path / "cluster.yaml"))
    assert fabtrain_folders(Path(tmp_path / "code").resolve(), cluster) == ["runs/a"]
