"""Host keys, unreachable nodes and authentication, against real sshd."""
import re
import shutil

import pytest

from tests.sshd import write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]

JOB = {"mode": "collective", "trainer": {"command": "true"}, "watchdog": {"enabled": False}}


def known_hosts_without(sshd, tmp_path, node):
    kh = tmp_path / "known_hosts"
    lines = [l for l in sshd.known_hosts.read_text().splitlines(True) if f"[{node.address}]" not in l]
    kh.write_text("".join(lines))
    return kh


def cluster_with_known_hosts(tmp_path, sshd, kh, policy, nodes=("node1", "node2")):
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[(n, ["trainer"]) for n in nodes], job=JOB, policy=policy)
    text = path.read_text().replace(str(sshd.known_hosts), str(kh))
    path.write_text(text)
    return path


def test_strict_refuses_an_unknown_host_and_still_reports_the_others(fab, tmp_path, sshd):
    kh = known_hosts_without(sshd, tmp_path, sshd.nodes[1])
    path = cluster_with_known_hosts(tmp_path, sshd, kh, "strict")
    out = fab("status", cluster=path)
    assert out.returncode == 1
    assert re.search(r"node2 .*unknown host key for \[127\.0\.0\.3\]:\d+ .*host_key_policy is strict", out.stdout)
    assert re.search(r"^node1\s+-\s+no job", out.stdout, re.M), out.stdout
    assert "127.0.0.3" not in kh.read_text()  # nothing was learned


def test_strict_refuses_unknown_host_for_rsync_too(fab, tmp_path, sshd):
    kh = known_hosts_without(sshd, tmp_path, sshd.nodes[1])
    path = cluster_with_known_hosts(tmp_path, sshd, kh, "strict")
    out = fab("deploy", cluster=path)
    assert out.returncode == 1
    assert "node1: code synced" in out.stdout
    assert re.search(r"node2: FAILED: node2: rsync failed: No ED25519 host key is known for .*strict checking", out.stdout), out.stdout


def test_accept_new_records_an_unknown_host_once(fab, tmp_path, sshd):
    kh = known_hosts_without(sshd, tmp_path, sshd.nodes[1])
    path = cluster_with_known_hosts(tmp_path, sshd, kh, "accept-new")
    fab("status", cluster=path, check=True)
    recorded = [l for l in kh.read_text().splitlines() if "[127.0.0.3]" in l]
    assert len(recorded) == 1
    pub = open(f"{sshd.nodes[1].host_key}.pub").read().split()[1]
    assert recorded[0].split()[2] == pub
    fab("status", cluster=path, check=True)
    assert len([l for l in kh.read_text().splitlines() if "[127.0.0.3]" in l]) == 1


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_a_changed_host_key_is_refused_under_both_policies(fab, tmp_path, sshd, policy):
    kh = tmp_path / "known_hosts"
    shutil.copy(sshd.known_hosts, kh)
    # Record node2's address with node1's key: to us, node2's key has "changed".
    node1_pub = open(f"{sshd.nodes[0].host_key}.pub").read().split()
    text = "".join(l for l in kh.read_text().splitlines(True) if "[127.0.0.3]" not in l)
    text += f"[127.0.0.3]:{sshd.port} {node1_pub[0]} {node1_pub[1]}\n"
    kh.write_text(text)
    before = kh.read_text()
    path = cluster_with_known_hosts(tmp_path, sshd, kh, policy)
    out = fab("status", cluster=path)
    assert out.returncode == 1
    line = next(l for l in out.stdout.splitlines() if "HOST KEY CHANGED" in l)
    assert line.startswith("node2 (root@127.0.0.3:") and "ssh-keygen -R" in line
    out = fab("deploy", cluster=path)
    assert out.returncode == 1 and re.search(r"node2: FAILED: node2: rsync failed: HOST KEY CHANGED", out.stdout), out.stdout
    assert kh.read_text() == before  # the recorded key was not replaced


def test_an_unreachable_node_gets_one_line_and_the_others_are_reported(fab, tmp_path, sshd):
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"]), ("node3", ["trainer"])],
                         local_nodes=[("local0", ["trainer"])], job=JOB)
    node3 = sshd.nodes[2]
    sshd.stop(node3)
    try:
        out = fab("status", cluster=path)
        assert out.returncode == 1
        assert re.search(r"^node3 \(root@127\.0\.0\.4:\d+\): unreachable: connection refused$", out.stdout, re.M), out.stdout
        assert re.search(r"^node1\s+-\s+no job", out.stdout, re.M) and re.search(r"^local0\s+-\s+no job", out.stdout, re.M)
        out = fab("check", cluster=path)
        assert out.returncode == 1 and "node3" in out.stdout and "UNREACHABLE" in out.stdout
        assert "Traceback" not in out.stdout + out.stderr
    finally:
        sshd.start(node3)


def test_connect_timeout_is_honoured_for_a_host_that_does_not_answer(fab, tmp_path, sshd):
    # 127.0.0.5 has no sshd: the port is closed, so this is "refused" quickly; a
    # blackholed address is tested with a network namespace in the watchdog tests.
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"])], job=JOB)
    text = path.read_text().replace("connect_timeout: 5", "connect_timeout: 1")
    text = text.replace("host: 127.0.0.2", "host: 127.0.0.9")
    path.write_text(text)
    out = fab("status", cluster=path, timeout=30)
    assert out.returncode == 1 and "node1 (root@127.0.0.9" in out.stdout and "unreachable" in out.stdout


def test_a_wrong_user_key_fails_authentication_clearly(fab, tmp_path, sshd):
    import subprocess
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"])], job=JOB)
    path.write_text(path.read_text().replace(str(sshd.user_key), str(other)))
    out = fab("status", cluster=path)
    assert out.returncode == 1 and "authentication failed" in out.stdout


def test_ssh_agent_authenticates_fabric_and_rsync_without_a_key_in_the_cluster_file(fab, tmp_path, sshd):
    import os
    import subprocess
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            import time
            time.sleep(0.05)
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
        subprocess.run(["ssh-add", "-q", str(sshd.user_key)], env=env, check=True, capture_output=True)
        path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"])], job=JOB)
        path.write_text("\n".join(l for l in path.read_text().splitlines() if "key:" not in l) + "\n")
        assert str(sshd.user_key) not in path.read_text()
        home = tmp_path / "home"  # no ~/.ssh/id_* to fall back on: only the agent can log us in
        home.mkdir()
        out = fab("status", "deploy", cluster=path, env={"SSH_AUTH_SOCK": str(sock), "HOME": str(home)})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "node1: code synced" in out.stdout
        out = fab("status", cluster=path, env={"SSH_AUTH_SOCK": "", "HOME": str(home)})
        assert out.returncode == 1 and "authentication failed: no key, ssh-agent or password" in out.stdout
    finally:
        agent.terminate()
        agent.wait(5)
