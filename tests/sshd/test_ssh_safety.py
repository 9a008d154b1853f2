"""Host keys, unreachable nodes and authentication, against real sshd."""
import errno
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import paramiko
import pytest
import yaml

from fabtrain.config.cluster import Node, SSHSettings
from fabtrain.remote.transport import describe_connect_error
from tests.conftest import FAB, REPO, require
from tests.support.sshd import SilentListener, free_port, write_cluster

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
    assert re.search(r"node1: code \S+ synced", out.stdout), out.stdout
    assert re.search(r"node2: FAILED: rsync failed: No ED25519 host key is known for .*strict checking", out.stdout), out.stdout


def test_accept_new_records_an_unknown_host_once(fab, tmp_path, sshd):
    kh = known_hosts_without(sshd, tmp_path, sshd.nodes[1])
    path = cluster_with_known_hosts(tmp_path, sshd, kh, "accept-new")
    fab("plan", cluster=path, check=True)  # asks every node (one probe each)
    recorded = [l for l in kh.read_text().splitlines() if "[127.0.0.3]" in l]
    assert len(recorded) == 1
    pub = open(f"{sshd.nodes[1].host_key}.pub").read().split()[1]
    assert recorded[0].split()[2] == pub
    fab("plan", cluster=path, check=True)
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
    assert out.returncode == 1 and re.search(r"node2: FAILED: rsync failed: HOST KEY CHANGED", out.stdout), out.stdout
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
    # 127.0.0.9 has a listener on the nodes' port whose accept queue is full: the kernel drops every
    # further SYN, as a firewall that drops packets or a machine that is off would. Nothing refuses.
    path = write_cluster(tmp_path / "c.yaml", sshd, ssh_nodes=[("node1", ["trainer"])], job=JOB)
    text = path.read_text().replace("connect_timeout: 5", "connect_timeout: 1")
    path.write_text(text.replace("host: 127.0.0.2", "host: 127.0.0.9"))
    with SilentListener("127.0.0.9", sshd.port):
        t0 = time.monotonic()
        out = fab("status", cluster=path, timeout=60)
        took = time.monotonic() - t0
    assert out.returncode == 1
    assert re.search(r"^node1 \(root@127\.0\.0\.9:\d+\): unreachable: no answer within connect_timeout 1 s$",
                     out.stdout, re.M), out.stdout
    assert "refused" not in out.stdout
    assert took < 20, f"fab status took {took:.1f} s against a 1 s connect_timeout"


def test_a_host_without_route_and_one_that_drops_packets_in_a_network_namespace(tmp_path):
    """In a network namespace of its own (nothing changes on this machine's network): a veth pair
    with 10.254.0.1/29 on our end. 10.254.0.2: nobody answers ARP, so the kernel gives up after ~3 s
    with "No route to host". 10.254.0.3: a permanent neighbour entry at a MAC nobody has, so the
    SYNs leave and vanish: no answer at all."""
    ip = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)
    require(ip, "iproute2", "`ip` builds the network namespace's links (`make test` installs iproute2)")
    probe = subprocess.run(["unshare", "--net", ip, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                           capture_output=True, text=True)
    require(probe.returncode == 0, "network namespaces",
            f"unshare --net and a veth pair need root (CAP_SYS_ADMIN, CAP_NET_ADMIN): {probe.stderr.strip()}")
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    ssh = {"user": "root", "port": 22, "known_hosts": str(kh), "host_key_policy": "strict", "connect_timeout": 8}
    nodes = [{"name": n, "host": h, "roles": ["trainer"], "workspace": str(tmp_path / f"ws-{n}")}
             for n, h in (("noroute", "10.254.0.2"), ("dropped", "10.254.0.3"))]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"name": "netns", "python": sys.executable, "ssh": ssh},
                                    "nodes": nodes, "job": JOB}, sort_keys=False))
    setup = (f"{ip} link set lo up && {ip} link add fab0 type veth peer name fab1 && "
             f"{ip} addr add 10.254.0.1/29 dev fab0 && {ip} link set fab0 up && {ip} link set fab1 up && "
             f"{ip} neigh replace 10.254.0.3 lladdr 02:00:00:00:00:01 dev fab0 nud permanent && exec \"$@\"")
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(tmp_path / "state")}
    out = subprocess.run(["unshare", "--net", "sh", "-c", setup, "sh", FAB, "status"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"^noroute \(root@10\.254\.0\.2:22\): unreachable: no route to host$", out.stdout, re.M), \
        out.stdout + out.stderr
    assert re.search(r"^dropped \(root@10\.254\.0\.3:22\): unreachable: no answer within connect_timeout 8 s$",
                     out.stdout, re.M), out.stdout + out.stderr
    assert "refused" not in out.stdout


def _node(connect_timeout=5.0):
    return Node("n1", "10.1.2.3", ("trainer",), "~/ws", "python3", "10.1.2.3",
                SSHSettings(user="root", port=22, connect_timeout=connect_timeout))


def test_each_connect_failure_says_what_it_really_is():
    """Real failures where this machine can make them, built ones for the rest."""
    describe = lambda e: describe_connect_error(_node(), e)       # noqa: E731
    where = "n1 (root@10.1.2.3:22): unreachable: "
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    # refused: a port nobody listens on
    port = free_port(["127.0.0.1"])
    with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError) as refused:
        client.connect("127.0.0.1", port, timeout=2, look_for_keys=False, allow_agent=False)
    assert describe(refused.value) == where + "connection refused"
    # no answer: a listener whose accept queue is full drops the SYN
    with SilentListener("127.0.0.1", free_port(["127.0.0.1"])) as silent:
        with pytest.raises((socket.timeout, TimeoutError)) as timed_out:
            client.connect("127.0.0.1", silent.port, timeout=1, look_for_keys=False, allow_agent=False)
    assert describe(timed_out.value) == where + "no answer within connect_timeout 5 s"
    # accepted, but it never speaks SSH (paramiko stops waiting after `timeout`, as Fabric calls it)
    with SilentListener("127.0.0.1", free_port(["127.0.0.1"]), full=False) as mute:
        for banner_timeout in (None, 0.5):
            with pytest.raises(paramiko.SSHException) as mute_error:
                client.connect("127.0.0.1", mute.port, timeout=1, banner_timeout=banner_timeout, password="x",
                               look_for_keys=False, allow_agent=False)
            assert describe(mute_error.value) == where + ("the connection was accepted but the SSH handshake did "
                                                          "not finish within connect_timeout 5 s (a hung or "
                                                          "overloaded sshd, or no SSH server on that port)")
    # no route to host (the kernel's answer when nobody answers ARP): paramiko gathers it with refusals
    no_route = paramiko.ssh_exception.NoValidConnectionsError(
        {("10.1.2.3", 22): OSError(errno.EHOSTUNREACH, "No route to host")})
    assert describe(no_route) == where + "no route to host"
    both = paramiko.ssh_exception.NoValidConnectionsError(
        {("10.1.2.3", 22): OSError(errno.EHOSTUNREACH, "No route to host"),
         ("fe80::1", 22, 0, 0): ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")})
    assert describe(both) == where + "no route to host; connection refused"
    assert describe(OSError(errno.ENETUNREACH, "Network is unreachable")) == where + "network is unreachable"
    assert describe(OSError(errno.ETIMEDOUT, "Connection timed out")) == where + "no answer within connect_timeout 5 s"
    assert describe(socket.gaierror(socket.EAI_NONAME, "Name or service not known")) == \
        where + "cannot resolve host name '10.1.2.3' (name not known)"
    assert "refused" not in describe(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))


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
        out = fab("plan", "deploy", cluster=path, env={"SSH_AUTH_SOCK": str(sock), "HOME": str(home)})
        assert out.returncode == 0, out.stdout + out.stderr
        assert re.search(r"node1: code \S+ synced", out.stdout), out.stdout
        out = fab("status", cluster=path, env={"SSH_AUTH_SOCK": "", "HOME": str(home)})
        assert out.returncode == 1 and "authentication failed: no key, ssh-agent or password" in out.stdout
    finally:
        agent.terminate()
        agent.wait(5)
