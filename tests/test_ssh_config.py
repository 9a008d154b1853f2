"""~/.ssh/config is honoured as Fabric does: aliases, User, Port, IdentityFile, ProxyJump."""
import re

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.remote.hostkeys import AcceptNewPolicy, StrictPolicy
from fabtrain.remote.transport import SSHTransport

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]


def write_ssh_config(home, sshd, extra=""):
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    n1, n2 = sshd.nodes[0], sshd.nodes[1]
    (home / ".ssh" / "config").write_text(f"""\
Host bastion
    HostName {n1.address}
    Port {sshd.port}
    User root
    IdentityFile {sshd.user_key}
Host trainbox
    HostName {n2.address}
    Port {sshd.port}
    User root
    IdentityFile {sshd.user_key}
{extra}""")


def test_an_ssh_config_alias_supplies_host_port_user_and_key(fab, tmp_path, sshd):
    home = tmp_path / "home"
    write_ssh_config(home, sshd)
    path = tmp_path / "c.yaml"
    path.write_text(f"""
cluster:
  name: alias
  python: {__import__('sys').executable}
  ssh: {{known_hosts: {sshd.known_hosts}, host_key_policy: strict}}
nodes:
  - {{name: box, host: trainbox, roles: [trainer], workspace: {tmp_path}/ws-box}}
job: {{mode: collective, trainer: {{command: "true"}}, watchdog: {{enabled: false}}}}
""")
    out = fab("status", "deploy", cluster=path, env={"HOME": str(home)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^box\s+-\s+no job", out.stdout, re.M)
    assert "box: code synced" in out.stdout  # rsync's OpenSSH read the same config
    assert (tmp_path / "ws-box" / "code" / "fabfile.py").exists()


def test_every_proxyjump_hop_gets_the_host_key_policy(tmp_path, sshd, monkeypatch):
    home = tmp_path / "home"
    write_ssh_config(home, sshd, extra=f"Host inner\n    HostName {sshd.nodes[2].address}\n    Port {sshd.port}\n    User root\n    IdentityFile {sshd.user_key}\n    ProxyJump bastion\n")
    monkeypatch.setenv("HOME", str(home))
    for policy, cls in (("strict", StrictPolicy), ("accept-new", AcceptNewPolicy)):
        cluster = parse_cluster({"cluster": {"name": "pj", "ssh": {"known_hosts": str(sshd.known_hosts), "host_key_policy": policy}},
                                 "nodes": [{"name": "n", "host": "inner", "roles": ["trainer"]}],
                                 "job": {"mode": "collective"}}, "pj.yaml")
        t = SSHTransport(cluster.nodes[0])
        assert t.context.gateway is not None and t.context.gateway.host == sshd.nodes[0].address
        assert isinstance(t.context.client._policy, cls)
        assert isinstance(t.context.gateway.client._policy, cls)
        # And the hop works: a command on "inner" through "bastion".
        assert t.run("echo via-bastion").stdout.strip() == "via-bastion"
        assert t.context.gateway.is_connected
        t.close()
