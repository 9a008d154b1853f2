"""~/.ssh/config is honoured as Fabric does: aliases, User, Port, IdentityFile, ProxyJump."""
import re
import subprocess
from pathlib import Path

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.remote.hostkeys import AcceptNewPolicy, StrictPolicy
from fabtrain.remote.transport import SSHTransport

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]



def project_code(tmp_path: Path) -> Path:
    """A small project of its own for deploy to ship (job.code)."""
    code = tmp_path / "project"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("print('hello')\n")
    return code


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
job: {{mode: collective, code: {project_code(tmp_path)}, trainer: {{command: "true"}}, watchdog: {{enabled: false}}}}
""")
    out = fab("status", cluster=path, env={"HOME": str(home)})  # paramiko got in through the same config
    assert out.returncode == 2 and "fab status: no job has started here yet" in out.stderr, out.stdout + out.stderr
    out = fab("deploy", cluster=path, env={"HOME": str(home)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"box: code \S+( \S+)? synced", out.stdout)  # rsync's OpenSSH read the same config
    assert (tmp_path / "ws-box" / "code" / "train.py").exists()  # the project's code arrived


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


def bastion_world(tmp_path, sshd, policy):
    """A node reached only through a bastion (node1) whose host key is NOT in the cluster's
    known_hosts; the user's ssh config even says not to check the bastion's key."""
    home = tmp_path / "home"
    bastion = sshd.nodes[0]
    write_ssh_config(home, sshd, extra=f"""\
Host inner
    HostName {sshd.nodes[2].address}
    Port {sshd.port}
    User root
    IdentityFile {sshd.user_key}
    ProxyJump bastion
""")
    config = home / ".ssh" / "config"
    config.write_text(config.read_text().replace(
        "Host bastion\n", "Host bastion\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n"))
    kh = tmp_path / "known_hosts"
    kh.write_text("".join(l for l in sshd.known_hosts.read_text().splitlines(True) if f"[{bastion.address}]" not in l))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"w{i % 50} w{i % 7} w{i % 11}\n" for i in range(400)))
    path = tmp_path / "c.yaml"
    path.write_text(f"""
cluster:
  name: bastion
  python: {__import__('sys').executable}
  ssh: {{known_hosts: {kh}, host_key_policy: {policy}, connect_timeout: 5}}
nodes:
  - {{name: inner, host: inner, roles: [trainer], workspace: {tmp_path}/ws-inner}}
job:
  mode: collective
  code: {project_code(tmp_path)}
  trainer: {{command: "true"}}
  watchdog: {{enabled: false}}
  data: {{dir: {tmp_path}/prepared, input: {corpus}}}
""")
    return path, home, kh, f"[{bastion.address}]:{sshd.port}"


def recorded(kh, host):
    """The key lines known_hosts holds for host (hashed or not), as ssh-keygen finds them."""
    out = subprocess.run(["ssh-keygen", "-F", host, "-f", str(kh)], capture_output=True, text=True)
    return [l for l in out.stdout.splitlines() if l and not l.startswith("#")]


def test_rsync_refuses_a_bastion_whose_key_is_unknown_under_strict(fab, tmp_path, sshd):
    path, home, kh, bastion = bastion_world(tmp_path, sshd, "strict")
    before = kh.read_text()
    out = fab("deploy", cluster=path, env={"HOME": str(home)})
    assert out.returncode == 1
    line, = [l for l in out.stdout.splitlines() if l.startswith("inner:")]
    assert line == (f"inner: FAILED: rsync failed: No ED25519 host key is known for {bastion} "
                    "and you have requested strict checking."), out.stdout
    out = fab("status", cluster=path, env={"HOME": str(home)})  # and Fabric's connection, the same
    assert out.returncode == 1 and f"unknown host key for {bastion}" in out.stdout, out.stdout
    assert kh.read_text() == before  # nothing was learned
    assert not (tmp_path / "ws-inner" / "code").exists()


def test_rsync_records_an_unknown_bastion_key_in_the_clusters_known_hosts_under_accept_new(fab, tmp_path, sshd):
    path, home, kh, bastion = bastion_world(tmp_path, sshd, "accept-new")
    pub = (sshd.nodes[0].host_key.parent / f"{sshd.nodes[0].host_key.name}.pub").read_text().split()[1]
    out = fab("deploy", cluster=path, env={"HOME": str(home)})  # rsync first: no Fabric connection yet
    assert out.returncode == 0 and re.search(r"inner: code \S+( \S+)? synced", out.stdout), out.stdout + out.stderr
    assert [l.split()[-1] for l in recorded(kh, bastion)] == [pub]
    assert (tmp_path / "ws-inner" / "code" / "train.py").exists()  # the project's code arrived
    # Fabric reads what rsync's ssh recorded, and copy-data's rsync goes the same way.
    out = fab("split-data", "copy-data", cluster=path, env={"HOME": str(home)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^inner: \d+ files verified, \d+ sent", out.stdout, re.M), out.stdout
    assert [l.split()[-1] for l in recorded(kh, bastion)] == [pub]  # recorded once


def test_fab_dash_S_reaches_rsync(fab, tmp_path, sshd):
    """`fab -S FILE` (Fabric's ssh config path): no ~/.ssh/config at all, the alias only in FILE."""
    home = tmp_path / "home"
    write_ssh_config(home, sshd)
    config = tmp_path / "elsewhere.conf"
    (home / ".ssh" / "config").rename(config)
    path = tmp_path / "c.yaml"
    path.write_text(f"""
cluster:
  name: dash-s
  python: {__import__('sys').executable}
  ssh: {{known_hosts: {sshd.known_hosts}, host_key_policy: strict}}
nodes:
  - {{name: box, host: trainbox, roles: [trainer], workspace: {tmp_path}/ws-box}}
job: {{mode: collective, code: {project_code(tmp_path)}, trainer: {{command: "true"}}, watchdog: {{enabled: false}}}}
""")
    out = fab("-S", str(config), "plan", "deploy", cluster=path, env={"HOME": str(home)})  # plan asks the node
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"box: code \S+( \S+)? synced", out.stdout), out.stdout
    assert (tmp_path / "ws-box" / "code" / "train.py").exists()  # the project's code arrived


PARALLEL_RSYNCS = 8


def test_a_bastion_key_learned_by_many_parallel_rsyncs_and_fabric_is_recorded_once(tmp_path, sshd, monkeypatch):
    """accept-new: eight rsyncs through the bastion, all started before any has learned its key, and a
    Fabric connection through it too: each ssh learns the new key at once, known_hosts holds it once."""
    from fabtrain.config.cluster import load_cluster
    from fabtrain.remote.rsync import Rsync

    path, home, kh, bastion = bastion_world(tmp_path, sshd, "accept-new")
    pub = (sshd.nodes[0].host_key.parent / f"{sshd.nodes[0].host_key.name}.pub").read_text().split()[1]
    monkeypatch.setenv("HOME", str(home))
    node = load_cluster(path).nodes[0]
    source = project_code(tmp_path) / "train.py"
    runs = [Rsync(SSHTransport(node), [str(source)], f"{tmp_path}/ws-inner/copy-{i}") for i in range(PARALLEL_RSYNCS)]
    fabric = SSHTransport(node)
    try:
        assert fabric.run("echo via-bastion").stdout.strip() == "via-bastion"
        for run in runs:
            run.finish(60)
    finally:
        for run in runs:
            run.cancel()
        fabric.close()
    for i in range(PARALLEL_RSYNCS):
        assert (tmp_path / "ws-inner" / f"copy-{i}" / "train.py").exists()
    assert [l.split()[-1] for l in recorded(kh, bastion)] == [pub]
    assert len([l for l in kh.read_text().splitlines() if pub in l]) == 1


def test_rsyncs_ssh_learns_keys_into_its_own_file_never_into_known_hosts(tmp_path):
    """OpenSSH appends what it learns to the first UserKnownHostsFile without a lock: under accept-new
    that is a file of the one rsync's own, merged through fabtrain's locked writer; strict learns nothing."""
    from fabtrain.remote.hostkeys import openssh_config

    kh, learned = tmp_path / "known_hosts", tmp_path / "learned"
    assert f'UserKnownHostsFile "{learned}" "{kh}"' in openssh_config(str(kh), "accept-new", str(learned))
    assert "HashKnownHosts no" in openssh_config(str(kh), "accept-new", str(learned))  # merged by name
    assert f'UserKnownHostsFile "{kh}"' in openssh_config(str(kh), "strict", str(learned))


def _merge(args):
    from fabtrain.remote.hostkeys import merge_learned
    barrier, learned, kh = args
    barrier.wait()
    merge_learned(learned, kh)


def test_one_key_learned_by_many_processes_at_once_is_recorded_once(tmp_path):
    import multiprocessing

    import paramiko
    key = paramiko.Ed25519Key.from_private_key_file(str(_a_key(tmp_path)))
    kh = tmp_path / "known_hosts"
    kh.write_text("[127.0.0.9]:22 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOunrher+qseY8sv8RaYeJsuR54HodGqcyhvGeofJOhI\n")
    files = []
    for i in range(12):
        f = tmp_path / f"learned-{i}"
        f.write_text(f"[127.0.0.8]:22 {key.get_name()} {key.get_base64()}\n")
        files.append(str(f))
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Manager().Barrier(len(files))
    with ctx.Pool(len(files)) as pool:
        pool.map(_merge, [(barrier, f, str(kh)) for f in files])
    lines = kh.read_text().splitlines()
    assert lines.count(f"[127.0.0.8]:22 {key.get_name()} {key.get_base64()}") == 1, lines
    assert len(lines) == 2


def _a_key(tmp_path):
    path = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path
