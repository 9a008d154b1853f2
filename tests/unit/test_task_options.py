"""Every option of every task, typed wrong, is one line naming the task and the option, exit code 2."""
import os
import subprocess

import pytest

from fabtrain import tasks
from tests.conftest import FAB, REPO

UNKNOWN_JOB = "20000101-000000-beef"

# A wrong value for each option that takes text, checked by the task itself (the parser takes any text).
WRONG_TEXT = {
    ("provision", "wheelhouse"): ("/nonexistent/wheels", "not a directory"),
    ("provision", "requirements"): ("/nonexistent/req.txt", "--requirements"),
    ("split-data", "input"): ("/nonexistent/corpus.txt", "no such file"),
    ("start-pserver", "resume-from"): ("a/b", "bad job id"),
    ("status", "job"): (UNKNOWN_JOB, f"no job {UNKNOWN_JOB} on any node"),
    ("logs", "job"): (UNKNOWN_JOB, f"no job {UNKNOWN_JOB} on any node"),
    ("watch", "job"): (UNKNOWN_JOB, f"no job {UNKNOWN_JOB} on any node"),
    ("dashboard", "job"): (UNKNOWN_JOB, f"no job {UNKNOWN_JOB} on any node"),
    ("dashboard", "host"): ("bad host!", "--host"),
    ("export", "job"): (UNKNOWN_JOB, f"no job {UNKNOWN_JOB} on any node"),
    ("export", "tensorboard"): ("{a_file}", "not a directory"),
    ("export", "k8s"): ("{a_file}", "not a directory"),
    ("export", "k8s-kind"): ("deployment", "--k8s-kind"),
    ("export", "slurm"): ("{a_file}", "--slurm"),
}


def options():
    """(task, option, kind) for every option of every task a project's fabfile gets."""
    for attr in tasks.__all__:
        task = getattr(tasks, attr)
        name = attr.replace("_", "-")
        numbers = getattr(task, "numbers", {})
        for arg in task.get_arguments():
            kind = "number" if arg.name in numbers else "switch" if arg.kind is bool else "text"
            yield name, arg.names[0], kind


OPTIONS = sorted(options())


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    (root / "cluster.yaml").write_text(f"cluster: {{name: options, workspace: {root}/ws}}\n"
                                       "nodes: [{name: n0, host: local, roles: [pserver, trainer]}]\n"
                                       "job: {mode: pserver}\n")
    (root / "a_file").write_text("not a directory\n")
    return root


def run(project, *argv):
    env = {**os.environ, "FABTRAIN_CLUSTER": str(project / "cluster.yaml"), "FABTRAIN_STATE_DIR": str(project / "st")}
    return subprocess.run([FAB, "-r", str(REPO), *argv], cwd=project, capture_output=True, text=True, timeout=120,
                          env=env)


def one_line_exit_2(out, *words):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_every_task_has_its_options_listed():
    names = {t for t, _, _ in OPTIONS}
    assert {"logs", "kill-all", "watch", "dashboard", "copy-data", "status"} <= names
    assert {(t, o) for t, o, k in OPTIONS if k == "text"} == set(WRONG_TEXT), "give each text option a wrong value"


@pytest.mark.parametrize("task,option,kind", OPTIONS, ids=[f"{t} --{o}" for t, o, _ in OPTIONS])
def test_an_option_typed_wrong_is_one_line_and_exit_2(project, task, option, kind):
    if kind == "switch":
        one_line_exit_2(run(project, task, f"--{option}=x"), f"--{option}", "takes no value")
        return
    one_line_exit_2(run(project, task, f"--{option}"), f"fab {task}:", f"--{option} needs a value")
    if kind == "number":
        for bad in ("abc", "-3"):
            one_line_exit_2(run(project, task, f"--{option}", bad), f"fab {task}: --{option}: must be")
    else:
        value, words = WRONG_TEXT[(task, option)]
        extra = ["--interval", "0.1"] if task == "watch" else ["--tensorboard", str(project / "tb")] \
            if task == "export" and option == "job" else []
        one_line_exit_2(run(project, task, f"--{option}", value.format(a_file=project / "a_file"), *extra),
                        f"fab {task}:", words)


def test_numeric_options_show_a_value_in_fab_help(project):
    for task, option, kind in OPTIONS:
        if kind == "number":
            text = run(project, "--help", task).stdout
            assert f"--{option}=" in text, text


@pytest.mark.parametrize("argv,words", [
    (["stauts"], "no task named 'stauts'"),
    (["plan", "--bogus"], "fab plan: unknown option --bogus"),
    (["logs", "--lines", "0"], "fab logs: --lines 0 shows nothing"),
    (["logs", "--lines", "-3"], "fab logs: --lines: must be a whole number from 0"),
    (["status"], "fab status: no job has started here yet"),
    (["logs"], "fab logs: no job has started here yet"),
])
def test_what_cannot_run_is_one_line_and_exit_2(project, argv, words):
    one_line_exit_2(run(project, *argv), words)


def test_every_option_of_every_task_has_a_line_of_help():
    """`fab --help TASK` says what each option does, and `fab --list` shows each task's first line whole."""
    for attr in tasks.__all__:
        task = getattr(tasks, attr)
        for arg in task.get_arguments():
            assert arg.help and len(arg.help.split()) >= 3, f"fab --help {attr.replace('_', '-')}: --{arg.name} says nothing"
        first = task.__doc__.strip().splitlines()[0]
        assert first.endswith((".", ")")), f"{attr}: fab --list cuts its docstring mid-phrase: {first!r}"


def test_watch_says_every_exit_code_it_ends_with():
    from fabtrain.controller import watch
    codes = (watch.EXIT_FINISHED, watch.EXIT_FAILED, watch.EXIT_KILLED, watch.EXIT_TIMEOUT)
    line = tasks.watch.__doc__.strip().splitlines()[0]
    for code, what in zip(codes, ("finished", "failed", "killed", "--timeout")):
        assert f"{code} {what}" in line, (code, what, line)
