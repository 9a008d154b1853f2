"""A key's passphrase is asked for at the prompt (Fabric's flag), never kept or printed."""
import os
import pty
import select
import subprocess
import time

import pytest

from tests.conftest import FAB, REPO
from tests.support.sshd import write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(60)]

PASSPHRASE = "correct horse battery staple"


def test_passphrase_is_prompted_for_and_never_echoed_or_logged(tmp_path, sshd):
    key = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", PASSPHRASE, "-f", str(key)], check=True)
    with open(sshd.authorized_keys, "a") as f:
        f.write(open(f"{key}.pub").read())
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"])],
                         job={"mode": "collective", "trainer": {"command": "true"}, "watchdog": {"enabled": False}})
    path.write_text(path.read_text().replace(str(sshd.user_key), str(key)))
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(tmp_path / "st"),
           "SSH_AUTH_SOCK": ""}  # no agent: the passphrase is the only way in
    master, slave = pty.openpty()
    proc = subprocess.Popen([FAB, "--prompt-for-passphrase", "status"], cwd=REPO, env=env,
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen = b""
    deadline = time.time() + 30
    answered = False
    while time.time() < deadline:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
            if not answered and b"passphrase" in seen.lower():
                os.write(master, PASSPHRASE.encode() + b"\n")
                answered = True
        elif proc.poll() is not None:
            break
    proc.wait(10)
    os.close(master)
    text = seen.decode(errors="replace")
    assert answered, text
    assert proc.returncode == 2, text  # it got in: every node answered, none has a job
    assert "fab status: no job has started here yet" in text
    assert PASSPHRASE not in text  # not echoed, not printed
    assert PASSPHRASE not in path.read_text()
    state = tmp_path / "st"
    assert not state.exists() or all(PASSPHRASE not in p.read_text() for p in state.rglob("*") if p.is_file())
