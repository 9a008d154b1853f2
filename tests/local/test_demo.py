"""The README's first command, as a new user runs it, in a fresh clone."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.procscan import live_marked

from tests.support import REPO
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
    # The suite's venv, already installed: the clone's requirements no newer than its .installed, make takes it as
    # it is (else every run of this test would reinstall them into it, beside the other tests).
    venv = Path(sys.executable).parent.parent
    installed = (venv / ".installed").stat().st_mtime
    for name in ("requirements-test.txt", "pyproject.toml"):
        os.utime(clone / name, (installed, installed))
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
    workspaces = [home / ".fabtrain" / "demo" / node for node in ("node0", "node1", "node2")]  # one per node
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


# -- how `make demo` waits for its dashboard ------------------------------------------------------

FAKE_DASHBOARD = '''
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
delay, port, token, mode = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
print("fake dashboard starting", flush=True)
time.sleep(delay)
if mode == "crash":
    print(f"error: cannot listen on 127.0.0.1:{port}: Address already in use (pick another with --port)", flush=True)
    sys.exit(1)

class Api(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.headers.get("Authorization") == "Bearer " + token else 401)
        self.end_headers()
        self.wfile.write(b"{}")

server = HTTPServer(("127.0.0.1", port), Api)
print(f"    http://127.0.0.1:{port}/?token={token}", flush=True)
if mode == "mute":
    time.sleep(3600)      # listening, its URL printed, but it never answers
server.serve_forever()
'''


def wait_for_fake_dashboard(tmp_path, delay, mode, wait=120):
    """`make wait-dashboard` (what `make demo` runs after starting the dashboard) over a stand-in
    dashboard; returns (make's result, seconds it took, the stand-in's Popen)."""
    demo = tmp_path / "demo"
    demo.mkdir(parents=True)
    port, token = free_port(), "0123456789abcdef0123456789abcdef"
    (demo / "token").write_text(token + "\n")
    script = tmp_path / "fake_dashboard.py"
    script.write_text(FAKE_DASHBOARD)
    log = open(demo / "dashboard.log", "w")
    proc = subprocess.Popen([sys.executable, str(script), str(delay), str(port), token, mode], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (demo / "dashboard.pid").write_text(f"{proc.pid}\n")
    venv = Path(sys.executable).parent.parent
    t0 = time.monotonic()
    out = subprocess.run(["make", "-s", "-C", str(REPO), "wait-dashboard", f"VENV={venv}", f"DEMO={demo}",
                          f"DASHBOARD_PORT={port}", f"DASHBOARD_WAIT={wait}"], capture_output=True, text=True, timeout=200)
    return out, time.monotonic() - t0, proc


@pytest.mark.timeout(120)
def test_make_demo_waits_for_a_slow_dashboard_until_it_answers(tmp_path):
    # Slower than the fixed 10 s the Makefile used to allow, as on a busy machine.
    out, took, proc = wait_for_fake_dashboard(tmp_path, delay=12, mode="serve")
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert took >= 12
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(120)
def test_make_demo_says_why_when_the_dashboard_dies_or_never_answers(tmp_path):
    out, took, proc = wait_for_fake_dashboard(tmp_path / "crash", delay=1, mode="crash")
    assert out.returncode != 0 and took < 30
    assert "exited before it answered" in out.stderr and "Address already in use" in out.stderr, out.stderr
    proc.wait()

    out, took, proc = wait_for_fake_dashboard(tmp_path / "mute", delay=0, mode="mute", wait=3)
    try:
        assert out.returncode != 0
        assert "did not answer" in out.stderr and "within 3 s; stopping it" in out.stderr, out.stderr
        assert "http://127.0.0.1:" in out.stderr          # its log is shown
        assert proc.wait(10) is not None                  # and it was stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- what `make test` installs ----------------------------------------------------------------------

def test_make_passes_torch_index_to_pip_only_when_set(tmp_path):
    def pip_lines(*extra):
        out = subprocess.run(["make", "-n", "-B", "-C", str(REPO), "venv", f"VENV={tmp_path / 'v'}", *extra],
                             capture_output=True, text=True, check=True)
        return [l for l in out.stdout.splitlines() if "-r requirements-test.txt" in l]
    (line,) = pip_lines("TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in line
    (line,) = pip_lines()
    assert "index-url" not in line


def test_system_deps_asks_apt_for_what_is_missing(tmp_path):
    """With a PATH that has none of the tools, system-deps asks apt-get for their packages, and for
    chromium exactly when /usr/bin/chromium (the browser test's path) is missing: a `chromium` found
    on PATH is not enough."""
    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "apt-calls"
    (stub / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (stub / "chromium").write_text("#!/bin/sh\n")
    for f in stub.iterdir():
        f.chmod(0o755)
    make = shutil.which("make")
    out = subprocess.run([make, "-s", "-C", str(REPO), "system-deps"], env={"PATH": str(stub)},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    install = next(l.split() for l in calls.read_text().splitlines() if l.split()[:1] == ["install"])
    expected = {"rsync", "openssh-client", "procps"}
    expected |= {"openssh-server"} if not os.path.exists("/usr/sbin/sshd") else set()
    expected |= {"chromium"} if not os.path.exists("/usr/bin/chromium") else set()
    expected |= {"iproute2"} if not any(os.path.exists(p) for p in ("/usr/sbin/ip", "/sbin/ip")) else set()
    for package, path in (("openmpi-bin", "/usr/bin/mpirun"), ("libopenmpi-dev", "/usr/bin/mpicc"),
                          ("slurm-wlm", "/usr/sbin/slurmctld"), ("munge", "/usr/sbin/munged"), ("gcc", "/usr/bin/cc"),
                          ("nftables", "/usr/sbin/nft"), ("kubernetes-client", "/usr/bin/kubectl")):
        expected |= {package} if not os.path.exists(path) else set()
    assert {p for p in install[1:] if not p.startswith("-")} == expected
