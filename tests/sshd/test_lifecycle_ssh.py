"""The whole lifecycle on real sshd nodes plus a local node: check, deploy,
start-pserver, start-trainers, status, logs, kill-all."""
import json
import re
import time
from pathlib import Path

import pytest

from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(240)]

TICKER = "python tests/programs/ticker.py --pservers={pservers} --id={trainer_id}"




@pytest.fixture
def four_nodes(tmp_path, sshd):
    pserver_port = free_port([n.address for n in sshd.nodes])
    job = {"name": "life", "mode": "pserver",
           "pserver": {"port": pserver_port, "command": TICKER.replace(" --id={trainer_id}", "")},
           "trainer": {"command": TICKER},
           "env": {"TRICKY": "a'b $(touch /tmp/fabtrain-pwned) `id`; x"},
           "watchdog": {"enabled": False}}
    path = write_cluster(tmp_path / "cluster.yaml", sshd, job=job,
                         local_nodes=[("local0", ["trainer"])],
                         ssh_nodes=[("node1", ["pserver"]), ("node2", ["trainer"]), ("node3", ["pserver", "trainer"])])
    workspaces = [tmp_path / f"ws-{n}" for n in ("local0", "node1", "node2", "node3")]
    yield path, workspaces
    # Never leave a process behind, whatever the test did.
    from tests.conftest import FAB, REPO
    import os
    import subprocess
    subprocess.run([FAB, "kill-all", "--grace", "1"], cwd=REPO, capture_output=True,
                   env={**os.environ, "FABTRAIN_CLUSTER": str(path)})


def test_whole_lifecycle_on_three_ssh_nodes_and_one_local(fab, four_nodes, sshd):
    cluster, workspaces = four_nodes
    out = fab("check", "deploy", "start-pserver", "start-trainers", cluster=cluster, check=True)
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)

    # Every process runs on its node, with its environment.
    expected = {("node1", "pserver", 0), ("node3", "pserver", 1),
                ("local0", "trainer", 0), ("node2", "trainer", 1), ("node3", "trainer", 2)}
    seen = set()
    addresses = {n.name: n.address for n in sshd.nodes}
    for ws in workspaces:
        for f in wait_for(lambda: sorted(ws.glob("env-*.json")) if len(list(ws.glob("env-*.json"))) else None) or []:
            rec = json.loads(f.read_text())
            env = rec["env"]
            node = env["FABTRAIN_NODE"]
            seen.add((node, env["FABTRAIN_ROLE"], int(env["FABTRAIN_RANK"])))
            assert ws.name == f"ws-{node}"
            assert env["FABTRAIN_JOB_ID"] == job_id
            assert env["FABTRAIN_WORKSPACE"] == str(ws)
            assert rec["cwd"] == str(ws / "jobs" / job_id / "code")  # the job's own snapshot of code/
            assert env["TRICKY"] == "a'b $(touch /tmp/fabtrain-pwned) `id`; x"
            if node == "local0":
                assert "SSH_CONNECTION" not in env
            else:  # started through that node's own sshd
                assert env["SSH_CONNECTION"].split()[2] == addresses[node]
            if env["FABTRAIN_ROLE"] == "trainer":
                assert env["PADDLE_INIT_TRAINER_ID"] == env["FABTRAIN_RANK"] == env["RANK"]
                assert env["PADDLE_INIT_PSERVERS"] == f"{addresses['node1']},{addresses['node3']}"
                assert rec["argv"][1:] == [f"--pservers={addresses['node1']},{addresses['node3']}", f"--id={env['RANK']}"]
            run = json.loads((ws / "jobs" / job_id / "run" / f"{env['FABTRAIN_ROLE']}-{env['FABTRAIN_RANK']}.json").read_text())
            assert run["pgid"] == run["pid"] and run["create_time"] > 0
    assert seen == expected
    assert not Path("/tmp/fabtrain-pwned").exists()
    for ws in workspaces:
        assert (ws / "current").resolve() == (ws / "jobs" / job_id).resolve()

    # A printed line reaches the log within a second (line-buffered, not 8 KiB blocks).
    log = workspaces[2] / "jobs" / job_id / "logs" / "trainer-1.log"
    lags = []
    for _ in range(5):
        size = log.stat().st_size
        wait_for(lambda: log.stat().st_size > size, timeout=2, interval=0.01)
        now = time.time()
        last = [line for line in log.read_text().splitlines() if line.startswith("tick ")][-1]
        lags.append(now - float(last.split()[1]))
    assert max(lags) < 1.0, lags

    out = fab("status", cluster=cluster, check=True)
    for node, name in (("node1", "pserver-0"), ("node3", "pserver-1"), ("local0", "trainer-0"),
                       ("node2", "trainer-1"), ("node3", "trainer-2")):
        assert re.search(rf"^{node}\s+{name}\s+running\s", out.stdout, re.M), out.stdout

    out = fab("logs", "--lines", "2", cluster=cluster, check=True)
    for prefix in ("[node1 pserver-0] ", "[node2 trainer-1] ", "[local0 trainer-0] ", "[node3 trainer-2] "):
        assert prefix + "tick " in out.stdout, out.stdout

    # A second job over a running one is refused.
    out = fab("start-pserver", cluster=cluster, check=False)
    assert out.returncode != 0 and f"nothing was started: job {job_id} is running" in out.stdout + out.stderr

    assert live_marked(workspaces)
    out = fab("kill-all", cluster=cluster, check=True)
    assert "node2: killed trainer-1" in out.stdout
    assert live_marked(workspaces) == []
    out = fab("kill-all", cluster=cluster, check=True)  # safe to run twice
    assert out.stdout.count("nothing running") == 4

    out = fab("status", cluster=cluster)
    assert "killed" in out.stdout and "was stopped by fab kill-all" in out.stdout


def test_kill_all_finds_processes_whose_pid_files_are_gone(fab, four_nodes):
    cluster, workspaces = four_nodes
    out = fab("deploy", "start-pserver", "start-trainers", cluster=cluster, check=True)
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    wait_for(lambda: (workspaces[2] / "env-trainer-1.json").exists())
    for ws in workspaces:  # lose every pid file
        for f in (ws / "jobs" / job_id / "run").glob("*.json"):
            f.unlink()
    assert live_marked(workspaces)
    out = fab("kill-all", "--grace", "2", cluster=cluster, check=True)
    assert "orphan" in out.stdout
    assert live_marked(workspaces) == []


def test_a_command_that_cannot_start_is_reported_at_once(fab, tmp_path, sshd):
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"])],
                         job={"mode": "collective", "trainer": {"command": "no-such-program --x"},
                              "watchdog": {"enabled": False}})
    out = fab("deploy", "start-trainers", cluster=path)
    assert out.returncode == 1
    assert re.search(r"node1: trainer-0 exited at once with code 127", out.stdout), out.stdout
    fab("kill-all", cluster=path, check=True)


def test_logs_follow_streams_new_lines_until_the_job_ends(fab, four_nodes, tmp_path):
    import os
    import subprocess
    from tests.conftest import FAB, REPO
    cluster, workspaces = four_nodes
    fab("deploy", "start-pserver", "start-trainers", cluster=cluster, check=True)
    env = {**os.environ, "FABTRAIN_CLUSTER": str(cluster), "FABTRAIN_STATE_DIR": str(tmp_path / "controller-state")}
    follow = subprocess.Popen([FAB, "logs", "--follow", "--lines", "0"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    fab("kill-all", cluster=cluster, check=True)
    out, err = follow.communicate(timeout=30)  # ends by itself once nothing runs
    assert follow.returncode == 0, err
    ticks = [line for line in out.splitlines() if line.startswith("[node2 trainer-1] tick ")]
    assert len(ticks) >= 5, out[-2000:]  # new lines arrived while following
    assert "[local0 trainer-0] tick " in out and "[node1 pserver-0] tick " in out
