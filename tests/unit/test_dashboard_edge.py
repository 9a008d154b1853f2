"""The dashboard's HTTP edge under waitress, started by the real `fab dashboard`.

Big bodies are refused from their headers: a 200 MB POST gets its 413 after
a few MB at most have left the client (what the socket buffers hold), at
once, and the server never opens a temporary file for it. A small body
without the token gets its 401.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.procscan import wait_for
from tests.support.sshd import free_port

from tests.support import REPO
TOKEN = "edge-test-token-0123456789abcdef"
BIG = 200 << 20

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """`fab dashboard` on a free port, with its own TMPDIR so any spooled body would show."""
    root = tmp_path_factory.mktemp("edge")
    (root / "tmp").mkdir()
    cluster = root / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({
        "cluster": {"name": "edge", "workspace": str(root / "ws"), "python": sys.executable},
        "nodes": [{"name": "n0", "host": "local", "roles": ["pserver", "trainer"]}], "job": {"mode": "pserver"}}))
    port = free_port(["127.0.0.1"])
    env = {**os.environ, "FABTRAIN_CLUSTER": str(cluster), "FABTRAIN_DASHBOARD_TOKEN": TOKEN, "TMPDIR": str(root / "tmp")}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "fab"), "dashboard", "--port", str(port)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            line = proc.stdout.readline()
            if "?token=" in line or not line:
                break
        assert "?token=" in line, line
        # Let the collector open its node channel (it holds an unlinked temp file for the node
        # side's stderr) before a test takes its "before" picture of the open files.
        wait_for(lambda: any("(deleted)" in f for f in open_files(proc.pid)), 10)
        yield {"port": port, "pid": proc.pid, "tmp": root / "tmp"}
    finally:
        proc.terminate()
        proc.wait(10)


def open_files(pid: int) -> list[str]:
    """What the server holds open that is not a socket, pipe or device: a spooled body would be here."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and not target.startswith("/dev/"):
            out.append(target)
    return out


def send_big(port: int, pid: int, headers: dict, chunked: bool = False) -> tuple[bytes, int, float, list[str]]:
    """POST a 200 MB body (or an endless chunked one) as fast as the socket takes it, until a reply comes.

    Returns (reply head, bytes sent, seconds, files the server opened meanwhile)."""
    head = f"POST /api/kill HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {BIG}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    block = b"\0" * 65536
    if chunked:
        block = b"%x\r\n" % len(block) + block + b"\r\n"
    # What the server holds open anyway (a local node's collect channel keeps an unlinked
    # temp file for its stderr): only what appears while the body is sent is the body's.
    before = set(open_files(pid))
    seen: set[str] = set()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode())
        s.setblocking(False)
        sent, reply, start = 0, b"", time.monotonic()
        while sent < BIG and time.monotonic() - start < 30:
            readable, writable, _ = select.select([s], [s], [], 1)
            seen.update(open_files(pid))
            if readable:
                data = s.recv(65536)
                reply += data
                if not data or b"\r\n\r\n" in reply:
                    break
            if writable:
                try:
                    sent += s.send(block)
                except BlockingIOError:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    break
        if b"\r\n\r\n" not in reply:  # refused while we were still sending: the reply is waiting
            s.setblocking(True)
            try:
                reply += s.recv(65536)
            except ConnectionResetError:
                pass
        return reply, sent, time.monotonic() - start, sorted(seen - before)


@pytest.mark.parametrize("auth,chunked", [({}, False), ({"Authorization": f"Bearer {TOKEN}"}, False), ({}, True)],
                         ids=["no-token", "token", "chunked-no-token"])
def test_a_200_mb_post_is_refused_from_its_headers_without_a_temp_file(dashboard, auth, chunked):
    reply, sent, seconds, files = send_big(dashboard["port"], dashboard["pid"], auth, chunked)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert sent < 32 << 20, f"{sent} bytes went out before the 413"  # the socket buffers, not the body
    assert seconds < 5
    assert not [f for f in files if f.startswith(str(dashboard["tmp"])) or "(deleted)" in f], files
    assert os.listdir(dashboard["tmp"]) == []


def test_a_small_post_without_the_token_gets_its_401(dashboard):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", dashboard["port"], timeout=10)
    conn.request("POST", "/api/kill", body=b'{"grace": 1}', headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 401 and b"token required" in r.read()
    conn.close()
