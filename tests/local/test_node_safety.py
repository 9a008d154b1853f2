"""What node ops refuse to trust, and what they keep private, with `fab` on a local node.

- kill-all signals a run record's pid (and its group) only if that pid is alive,
  started when the record says, leads its own group and carries the
  workspace's job marker: a planted record cannot make it kill another group.
  Between signals it polls through procfs.Sweep, which still sees a new marked
  process at once and a watched one's end.
- Workspaces and job directories are 0700, the records in them 0600, and a
  workspace another user could tamper with is refused in one line.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from fabtrain.node import procfs
from tests.conftest import FAB, REPO
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import write_cluster

pytestmark = pytest.mark.timeout(90)

TICKER = "python tests/programs/ticker.py"


def fab(cluster, state, *args):
    env = {**os.environ, "FABTRAIN_CLUSTER": str(cluster), "FABTRAIN_STATE_DIR": str(state)}
    return subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def local(tmp_path):
    cluster = write_cluster(tmp_path / "cluster.yaml", None, local_nodes=[("n0", ["trainer"])],
                            job={"mode": "collective", "trainer": {"command": TICKER}, "watchdog": {"enabled": False}})
    ws = tmp_path / "ws-n0"
    yield cluster, ws, tmp_path / "state"
    if live_marked([ws]):
        fab(cluster, tmp_path / "state", "kill-all", "--grace", "1")


def test_kill_all_ignores_a_planted_run_record_naming_another_process_group(local):
    cluster, ws, state = local
    # The victim: a process group of another program (a leader and its child), no job marker.
    victim = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '120']); "
                               "time.sleep(120)"], start_new_session=True)
    try:
        group = wait_for(lambda: len(procfs.group(victim.pid, procfs.scan())) == 2 and procfs.group(victim.pid, procfs.scan()))
        assert group, "the victim's group did not form"
        planted = ws / "jobs" / "20200101-000000-beef" / "run"
        planted.mkdir(parents=True)
        p = procfs.stat(victim.pid)
        (planted / "trainer-0.json").write_text(json.dumps({
            "name": "trainer-0", "role": "trainer", "rank": 0, "pid": victim.pid, "pgid": victim.pid,
            "create_time": p.create_time, "argv": ["x"], "started_at": time.time()}))
        out = fab(cluster, state, "kill-all", "--grace", "1")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"ignored run record jobs/20200101-000000-beef/run/trainer-0.json (pid {victim.pid})" in out.stdout
        time.sleep(0.3)
        assert all(procfs.alive(pid) for pid in group)  # neither the leader nor its group was signalled
    finally:
        for pid in procfs.group(victim.pid, procfs.scan()):
            os.kill(pid, 9)
        victim.wait()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_workspaces_job_dirs_and_records_are_private(local):
    cluster, ws, state = local
    out = fab(cluster, state, "deploy", "start-trainers")
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
    jd = ws / "jobs" / job_id
    assert wait_for(lambda: (jd / "metrics" / "trainer-0.jsonl").exists(), timeout=10)
    for d in (ws, ws / "jobs", jd, jd / "logs", jd / "run", jd / "metrics"):
        assert mode(d) == 0o700, (d, oct(mode(d)))
    for f in (jd / "job.json", jd / "launch.py", jd / "logs" / "trainer-0.log", jd / "run" / "trainer-0.json",
              jd / "metrics" / "trainer-0.jsonl"):
        assert mode(f) == 0o600, (f, oct(mode(f)))
    assert fab(cluster, state, "kill-all", "--grace", "1").returncode == 0
    assert mode(jd / "run" / "trainer-0.exit") == 0o600 and mode(jd / "events.jsonl") == 0o600


def test_a_workspace_others_can_write_is_refused_in_one_line(local, tmp_path):
    cluster, ws, state = local
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    write_cluster(cluster, None, local_nodes=[("n0", ["trainer"])],
                  job={"mode": "collective", "trainer": {"command": TICKER}, "watchdog": {"enabled": False}},
                  extra_node_fields={"n0": {"workspace": str(open_dir / "ws")}})
    out = fab(cluster, state, "start-trainers")
    assert out.returncode != 0
    assert f"workspace {open_dir / 'ws'}: {open_dir} is writable by group or others (chmod go-w {open_dir})" \
        in out.stdout, out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    assert not (open_dir / "ws" / "jobs").exists()


def test_a_kills_cheap_poll_finds_a_marked_process_started_after_it_began_and_sees_it_end(tmp_path):
    """procfs.Sweep, what kill-all polls with between signals: a new pid is read at once (its
    marker too), a watched (hot) one is re-read each time, an unmarked one is never its."""
    ws = str(tmp_path / "ws")
    sweep = procfs.Sweep(ws, full_every=1000, list_period=0)  # listed each poll, no full re-read: what is new or hot
    sweep.marked(sweep.scan())  # every process there now is known, none of them carries the marker
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABTRAIN_")}
    ours = subprocess.Popen(["sleep", "30"], env={**env, "FABTRAIN_WORKSPACE": ws}, start_new_session=True)
    other = subprocess.Popen(["sleep", "30"], env={**env, "FABTRAIN_WORKSPACE": ws + "-other"}, start_new_session=True)
    try:
        # Popen returns once the exec closed its pipe, a moment before the kernel sets up the new environment:
        # a process read then is read again at the next poll (once remembered as not ours, it never was found).
        assert wait_for(lambda: ours.pid in sweep.marked(sweep.scan()), timeout=5)
        assert other.pid not in sweep.marked(sweep.scan())
        sweep.hot = {ours.pid}
        ours.kill()  # a zombie until reaped below: re-read as hot, it is dead, so no longer found
        assert wait_for(lambda: procfs.stat(ours.pid).dead, timeout=5)
        assert ours.pid not in sweep.marked(sweep.scan())
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()
