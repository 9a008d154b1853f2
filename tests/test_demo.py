"""The README's first command, as a new user runs it, in a fresh clone."""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.procscan import live_marked

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_demo_trains_and_make_stop_leaves_nothing(tmp_path):
    clone = tmp_path / "fabtrain"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    # Uncommitted work is not in the clone: the test runs what a user would get.
    cluster = clone / "cluster.yaml"
    cluster.write_text(cluster.read_text().replace("--num_passes 5", "--num_passes 1 --steps 150"))
    venv = Path(sys.executable).parent.parent  # the suite's venv, already installed
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    env = {**os.environ, "HOME": str(home), "FABTRAIN_STATE_DIR": str(home / "state")}
    env.pop("FABTRAIN_CLUSTER", None)
    make = ["make", "-C", str(clone), f"VENV={venv}", f"DASHBOARD_PORT={port}"]
    out = subprocess.run([*make, "demo"], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    url = re.search(r"dashboard:\s+(http://127\.0\.0\.1:\d+/\?token=\w+)", out.stdout).group(1)
    for word in ("fab status", "fab logs --follow", "fab watch", "fab kill-all"):
        assert word in out.stdout
    workspaces = [home / ".fabtrain" / d for d in ("demo", "demo-node1", "demo-node2")]
    try:
        # The dashboard answers with the token.
        token = url.split("token=")[1]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/job", headers={"Authorization": f"Bearer {token}"})
        state, deadline = None, time.time() + 30
        while time.time() < deadline and state not in ("starting", "running", "finished"):
            state = json.loads(urllib.request.urlopen(req, timeout=10).read())["state"]
            time.sleep(0.5)
        assert state in ("starting", "running", "finished")
        # Training makes visible progress: the loss falls on both trainers.
        deadline = time.time() + 240
        losses = {}
        while time.time() < deadline:
            for ws, name in ((workspaces[1], "trainer-0"), (workspaces[2], "trainer-1")):
                for m in (ws / "current" / "metrics").glob(f"{name}.jsonl"):
                    recs = [json.loads(l) for l in m.read_text().splitlines() if l.strip()]
                    recs = [r for r in recs if isinstance(r.get("loss"), (int, float))]
                    if len(recs) >= 5:
                        losses[name] = (recs[0]["loss"], recs[-1]["loss"])
            exits = [ws / "current" / "run" / f"{n}.exit" for ws, n in
                     ((workspaces[0], "pserver-0"), (workspaces[1], "trainer-0"), (workspaces[2], "trainer-1"))]
            if all(e.exists() for e in exits):
                break
            time.sleep(1)
        assert [e.read_text().strip() for e in exits] == ["0", "0", "0"]  # trained to the end, cleanly
        assert set(losses) == {"trainer-0", "trainer-1"}
        assert all(last < first for first, last in losses.values()), losses
    finally:
        stop = subprocess.run([*make, "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert live_marked(workspaces) == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)

    # Running the demo twice works: the second stops what the first left.
    out = subprocess.run([*make, "demo"], env=env, capture_output=True, text=True, timeout=400)
    try:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        subprocess.run([*make, "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert live_marked(workspaces) == []
