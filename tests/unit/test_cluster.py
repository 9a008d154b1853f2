"""cluster.yaml: every mistake ends in one line naming file, field and problem; exit 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fabtrain.config.cluster import load_cluster, parse_cluster
from fabtrain.errors import UserError

from tests.support import REPO
FAB = str(Path(sys.executable).parent / "fab")

GOOD = {
    "cluster": {"name": "c1", "workspace": "~/.fabtrain/c1"},
    "nodes": [
        {"name": "n0", "host": "local", "roles": ["pserver", "trainer"]},
        {"name": "n1", "host": "10.1.9.8", "port": 2200, "roles": ["trainer"], "workspace": "/data/fabtrain"},
    ],
    "job": {"name": "w2v", "mode": "pserver"},
}


def doc(**changes):
    """GOOD with dotted-path changes; a value of ... deletes the key."""
    d = yaml.safe_load(yaml.safe_dump(GOOD))
    for path, value in changes.items():
        keys = path.split("__")
        target = d
        for k in keys[:-1]:
            target = target[int(k)] if isinstance(target, list) else target.setdefault(k, {})
        last = keys[-1]
        if isinstance(target, list):
            target[int(last)] = value
        elif value is ...:
            del target[last]
        else:
            target[last] = value
    return d


def test_good_file_parses_with_defaults():
    c = parse_cluster(doc(), "x.yaml")
    assert [n.name for n in c.nodes] == ["n0", "n1"]
    assert c.nodes[1].ssh.port == 2200 and c.nodes[0].ssh.port is None
    # A node's own workspace, else its own folder under the cluster's workspace.
    assert c.nodes[1].workspace == "/data/fabtrain" and c.nodes[0].workspace == "~/.fabtrain/c1/n0"
    assert c.trainer_count == 2 and c.pserver_count == 1
    assert c.nodes[0].python == sys.executable  # a local node runs fab's own interpreter
    assert c.nodes[1].python == "python3" and c.nodes[1].address == "10.1.9.8"
    assert c.job.pserver.port == 7164 and c.job.watchdog.hang_timeout == 120


def test_dist_ips_makes_one_trainer_node_per_ip_with_pserver_on_the_first():
    d = doc(nodes=...)
    d["dist_ips"] = "10.0.0.1, 10.0.0.2,10.0.0.3"
    c = parse_cluster(d, "x.yaml")
    assert [(n.name, n.host, n.roles) for n in c.nodes] == [
        ("node0", "10.0.0.1", ("pserver", "trainer")), ("node1", "10.0.0.2", ("trainer",)),
        ("node2", "10.0.0.3", ("trainer",))]
    d["job"]["mode"] = "collective"
    assert all(n.roles == ("trainer",) for n in parse_cluster(d, "x.yaml").nodes)


def test_fabtrain_cluster_selects_the_file(tmp_path, monkeypatch):
    p = tmp_path / "other.yaml"
    p.write_text(yaml.safe_dump(doc(cluster__name="other")))
    monkeypatch.setenv("FABTRAIN_CLUSTER", str(p))
    assert load_cluster().name == "other"


BAD = [
    # (changes, expected field in the message, expected words)
    ({"cluster": ...}, "cluster", "missing required field"),
    ({"job": ...}, "job", "missing required field"),
    ({"cluster__name": ...}, "cluster.name", "missing"),
    ({"cluster__colour": "red"}, "cluster.colour", "unknown field"),
    ({"nodes__0__name": "n1"}, "nodes[1].name", "duplicate node name"),
    ({"nodes__1__roles": ["trainer", "chef"]}, "nodes[1].roles", "unknown role 'chef'"),
    ({"nodes__1__roles": []}, "nodes[1].roles", "non-empty list"),
    ({"nodes__0__roles": ["trainer"]}, "nodes", "no node has the pserver role"),
    ({"nodes__1__port": 70000}, "nodes[1].port", "between 1 and 65535"),
    ({"nodes__1__port": "22"}, "nodes[1].port", "must be an integer"),
    ({"nodes__1__port": True}, "nodes[1].port", "must be an integer"),
    ({"nodes__1__host": "a.b;rm -rf /"}, "nodes[1].host", "not a valid host"),
    ({"nodes__1__host": "$(reboot)"}, "nodes[1].host", "not a valid host"),
    ({"nodes__1__user": "root`id`"}, "nodes[1].user", "not a valid user"),
    ({"nodes__1__workspace": "/data/my ws"}, "nodes[1].workspace", "not a valid path"),
    ({"nodes__1__workspace": "/data/$HOME"}, "nodes[1].workspace", "not a valid path"),
    ({"cluster__workspace": "/x/~/y"}, "cluster.workspace", "not a valid path"),
    ({"cluster__workspace": "~root/ws"}, "cluster.workspace", "not a valid path"),
    ({"nodes__1__key": "/nonexistent/id_ed25519"}, "nodes[1].key", "cannot read key file"),
    ({"cluster__ssh": {"host_key_policy": "yolo"}}, "cluster.ssh.host_key_policy", "strict, accept-new"),
    ({"cluster__ssh": {"password": "hunter2"}}, "cluster.ssh.password", "passwords are never kept"),
    ({"cluster__ssh": {"connect_timeout": -1}}, "cluster.ssh.connect_timeout", "between"),
    ({"cluster__ssh": {"parallel": 0}}, "cluster.ssh.parallel", "between 1 and 1024"),
    ({"job__mode": "mpi"}, "job.mode", "pserver, collective"),
    ({"job__sgd": "adam"}, "job.sgd", "sync, async"),
    ({"job__pserver": {"port": 0}}, "job.pserver.port", "between 1 and 65535"),
    ({"job__pserver": {"port": 65535, "ports_num": 2}}, "job.pserver.port", "runs past 65535"),
    ({"job__pserver": {"command": "paddle pserver --port={prot}"}}, "job.pserver.command", "unknown placeholder {prot}"),
    ({"job__trainer": {"command": "python 'unterminated"}}, "job.trainer.command", "cannot split"),
    ({"job__trainer": {"per_node": "two"}}, "job.trainer.per_node", "must be an integer"),
    ({"job__trainer": {"use_gpu": "yes"}}, "job.trainer.use_gpu", "true or false"),
    ({"job__watchdog": {"on_failure": "explode"}}, "job.watchdog.on_failure", "kill-job, keep"),
    ({"job__watchdog": {"interval": 0}}, "job.watchdog.interval", "between"),
    ({"job__env": {"BAD-NAME": "1"}}, "job.env.BAD-NAME", "not a valid environment variable"),
    ({"job__data": {"dir": "data; rm -rf ~"}}, "job.data.dir", "not a valid path"),
    ({"job__data": {"max_extract_mb": 0}}, "job.data.max_extract_mb", "between 1 and"),
    ({"job__data": {"max_expansion": 0.5}}, "job.data.max_expansion", "between 1 and"),
    ({"nodes": "n0,n1"}, "nodes", "must be a list"),
    ({"nodes": []}, "nodes", "at least one node"),
    ({"nodes__1": "n1"}, "nodes[1]", "must be a mapping"),
    ({"job__mode": "collective"}, "nodes[0].roles", "collective"),
    ({"nodes__1__host": "local", "nodes__1__workspace": "~/.fabtrain/c1/n0"}, "nodes.n1.workspace", "own workspace"),
]


@pytest.mark.parametrize("changes,field,words", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_bad_cluster_file_names_file_field_and_problem(changes, field, words):
    with pytest.raises(UserError) as e:
        parse_cluster(doc(**changes), "bad.yaml")
    message = str(e.value)
    assert message.startswith(f"bad.yaml: {field}: "), message
    assert words in message, message
    assert "\n" not in message


def test_both_nodes_and_dist_ips_is_refused():
    d = doc()
    d["dist_ips"] = "10.0.0.1"
    with pytest.raises(UserError, match=r"x.yaml: nodes: give exactly one of"):
        parse_cluster(d, "x.yaml")


def test_dist_ips_with_a_bad_address_is_refused():
    d = doc(nodes=...)
    d["dist_ips"] = "10.0.0.1,,10.0.0.2"
    with pytest.raises(UserError, match=r"x.yaml: dist_ips: .*none empty"):
        parse_cluster(d, "x.yaml")


@pytest.mark.parametrize("text,words", [
    ("cluster: {name: x\nnodes: [", "YAML syntax error"),
    ("", "the file is empty"),
    ("- just\n- a list\n", "must be a mapping"),
])
def test_unparseable_files(tmp_path, text, words):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(UserError, match=words):
        load_cluster(p)


def test_missing_file_says_how_to_choose_one(tmp_path):
    with pytest.raises(UserError, match=r"no such cluster file \(set FABTRAIN_CLUSTER"):
        load_cluster(tmp_path / "nope.yaml")


@pytest.mark.parametrize("content,words", [
    ("cluster: {name: x}\nnodes: [{name: a, host: local, roles: [trainer]}]\njob: {mode: pserver}\n",
     "no node has the pserver role"),
    ("cluster: {name: x\n", "YAML syntax error"),
    ("cluster: {name: x}\nnodes: [{name: a, host: 'h;h', roles: [trainer]}]\njob: {mode: collective}\n",
     "not a valid host"),
])
def test_fab_prints_one_line_and_exits_2_without_traceback(tmp_path, content, words):
    p = tmp_path / "c.yaml"
    p.write_text(content)
    out = subprocess.run([FAB, "plan"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "FABTRAIN_CLUSTER": str(p)})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert str(p) in lines[0] and words in lines[0]
    assert "Traceback" not in out.stderr + out.stdout


# -- hostile files: each ends in one line through the real `fab plan`, never a traceback ---------

GOOD_TEXT = "cluster: {name: x}\nnodes: [{name: a, host: local, roles: [pserver, trainer]}]\njob: {mode: pserver}\n"


def _laughs(levels=9):
    """A few hundred bytes that alias into 10**levels list items (the "billion laughs")."""
    v = "&a0 [1,1,1,1,1,1,1,1,1,1]"
    for i in range(1, levels):
        v = f"&a{i} [{v}" + f", *a{i - 1}" * 9 + "]"
    return v


HOSTILE = [
    ("cluster: " + "[" * 5000 + "]" * 5000 + "\n", "line 1, column 73: nested more than 64 levels deep"),
    ("cluster: {name: x}\nnodes: [{name: a, host: local, roles: [pserver, trainer]}]\n"
     "job:\n  pserver:\n    port: " + "9" * 5000 + "\n", "line 5, column 11: port: a number 5000 characters long"),
    (GOOD_TEXT.replace("job: {mode: pserver}", "job: {pserver: {port: 0x" + "f" * 99 + "}}"), "port: a number 101 characters long"),
    ("cluster: {name: x}\njob: {mode: pserver}\ndist_ips: " + _laughs() + "\n", "dist_ips: must be a string"),
    (GOOD_TEXT.replace("job: {mode: pserver}", "job: {mode: " + _laughs() + "}"), "job.mode: must be one of pserver, collective, got a list"),
    (GOOD_TEXT + "cluster: {name: y}\n", "line 4, column 1: duplicate key 'cluster' (first given on line 1)"),
]


@pytest.mark.parametrize("content,words", HOSTILE, ids=["deep", "long-port", "hex-port", "laughs-dist-ips", "laughs-choice",
                                                        "duplicate-top"])
def test_hostile_cluster_file_is_one_line_from_fab_plan(tmp_path, content, words):
    p = tmp_path / "c.yaml"
    p.write_text(content)
    out = subprocess.run([FAB, "plan"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FABTRAIN_CLUSTER": str(p)})
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-2000:]
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 400, out.stderr[-2000:]
    assert lines[0].startswith(f"fab plan: {p}: ") and words in lines[0], lines[0]


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(GOOD_TEXT.replace("cluster: {name: x}", "cluster:\n  name: x\n  ssh:\n"
                                   "    host_key_policy: strict\n    host_key_policy: accept-new"))
    with pytest.raises(UserError) as e:
        load_cluster(p)
    assert str(e.value) == f"{p}: line 5, column 5: duplicate key 'host_key_policy' (first given on line 4)"


def test_a_merge_key_may_be_overridden_and_equal_keys_in_other_mappings_are_fine(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("cluster: {name: x}\n"
                 "nodes:\n"
                 "  - &base {name: a, host: local, roles: [pserver, trainer], workspace: /w/a}\n"
                 "  - <<: *base\n"
                 "    name: b\n"
                 "    workspace: /w/b\n"
                 "job: {mode: pserver}\n")
    c = load_cluster(p)
    assert [(n.name, n.workspace) for n in c.nodes] == [("a", "/w/a"), ("b", "/w/b")]


# A value that starts with "-" would be an option to ssh, rsync or python (-oProxyCommand=...).
DASHED = [
    ("cluster:\n  name: x\n  workspace: -oProxyCommand=x", "cluster.workspace: '-oProxyCommand=x' must not start with '-'"),
    ("cluster:\n  name: x\n  python: -c", "cluster.python: '-c' must not start with '-'"),
    ("cluster:\n  name: x\n  ssh: {known_hosts: -oProxyCommand=x}", "cluster.ssh.known_hosts: '-oProxyCommand=x' must not start"),
    ("cluster:\n  name: x\n  ssh: {key: -oProxyCommand=x}", "cluster.ssh.key: '-oProxyCommand=x' must not start"),
    ("cluster:\n  name: x\n  ssh: {user: -oProxyCommand=x}", "cluster.ssh.user: '-oProxyCommand=x' is not a valid user name"),
    ("cluster: {name: -x}", "cluster.name: '-x' is not a valid name"),
    ("cluster: {name: x}\ndist_ips: '-oProxyCommand=x'", "dist_ips[0]: '-oProxyCommand=x' is not a valid host"),
]
NODE_DASHED = [
    ("workspace", "nodes[0].workspace: '-oProxyCommand=x' must not start with '-'"),
    ("python", "nodes[0].python: '-oProxyCommand=x' must not start with '-'"),
    ("host", "nodes[0].host: '-oProxyCommand=x' is not a valid host"),
    ("address", "nodes[0].address: '-oProxyCommand=x' is not a valid address"),
    ("user", "nodes[0].user: '-oProxyCommand=x' is not a valid user name"),
]


@pytest.mark.parametrize("text,words", DASHED + [
    ("cluster: {name: x}\nnodes: " + json.dumps([{"name": "a", "host": "local", "roles": ["pserver", "trainer"],
                                                   field: "-oProxyCommand=x"}]), words)
    for field, words in NODE_DASHED] + [
    ("cluster: {name: x}\nnodes: [{name: a, host: local, roles: [pserver, trainer]}]\njob: {data: {dir: -oProxyCommand=x}}",
     "job.data.dir: '-oProxyCommand=x' must not start with '-'")],
    ids=[w.split(":")[0] for _, w in DASHED] + [w.split(":")[0] for _, w in NODE_DASHED] + ["job.data.dir"])
def test_a_leading_dash_is_refused_wherever_a_value_reaches_a_command_line(tmp_path, text, words):
    p = tmp_path / "c.yaml"
    if "nodes" not in text and "dist_ips" not in text:
        text += "\nnodes: [{name: a, host: local, roles: [pserver, trainer]}]"
    p.write_text(text + ("\njob: {mode: pserver}\n" if "job:" not in text else "\n"))
    out = subprocess.run([FAB, "plan"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FABTRAIN_CLUSTER": str(p)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fab plan: {p}: {words}"), out.stderr


def test_a_dash_inside_a_path_is_fine():
    c = parse_cluster(doc(cluster__workspace="./-ws", nodes__1__workspace="/data/-x/ws"), "x.yaml")
    assert c.nodes[0].workspace == "./-ws/n0" and c.nodes[1].workspace == "/data/-x/ws"


def test_every_mistake_in_the_file_is_reported_at_once_each_with_its_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("cluster:\n"
                 "  name: demo\n"
                 "  ssh: {parallel: 0}\n"
                 "nodes:\n"
                 "  - {name: n0, host: local, roles: [trainr]}\n"
                 "  - {name: n1, host: local, roles: [trainer], colour: red}\n")
    out = subprocess.run([FAB, "plan", "--offline"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FABTRAIN_CLUSTER": str(p)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [
        f"fab plan: {p}: job: missing required field",
        f"fab plan: {p}: cluster.ssh.parallel: must be between 1 and 1024, got 0 (line 3)",
        f"fab plan: {p}: nodes[0].roles: unknown role 'trainr'; roles are: pserver, trainer (line 5)",
        f"fab plan: {p}: nodes[1].colour: unknown field; expected one of: address, connect_timeout, gpus, host, "
        "host_key_policy, iface, key, known_hosts, name, port, python, roles, spare, user, workspace (line 6)",
    ], out.stderr


@pytest.mark.parametrize("key", ["on", "yes", "no", "off", "y", "n", "true", "False"])
def test_a_key_that_yaml_reads_as_a_boolean_stays_a_name(tmp_path, key):
    from fabtrain.config.yamlfile import load_yaml
    assert load_yaml(f"{key}: [failed]\nvalue: yes\n") == {key: ["failed"], "value": True}
    p = tmp_path / "c.yaml"
    p.write_text(GOOD_TEXT.replace("job: {mode: pserver}", "job:\n  watchdog:\n    notify:\n"
                                   "      webhook: https://hooks.example.com/x\n      on: [failed, hang]\n"))
    assert load_cluster(p).job.watchdog.notify.on == ("failed", "hang")


def test_an_ssh_key_need_not_exist_for_local_nodes_but_must_for_ssh_nodes():
    local = doc(nodes=[{"name": "n0", "host": "local", "roles": ["pserver", "trainer"]}],
                cluster__ssh={"key": "/nonexistent/id_ed25519"})
    assert parse_cluster(local, "x.yaml").nodes[0].ssh.key == "/nonexistent/id_ed25519"
    with pytest.raises(UserError, match=r"x.yaml: cluster.ssh.key: cannot read key file /nonexistent/id_ed25519 "
                                        r"\(node n1 connects with it\)"):
        parse_cluster(doc(cluster__ssh={"key": "/nonexistent/id_ed25519"}), "x.yaml")


def test_dist_ips_may_name_this_machine_twice_as_nodes_may():
    d = doc(nodes=...)
    d["dist_ips"] = "local,local"
    c = parse_cluster(d, "x.yaml")
    assert [(n.name, n.host, n.workspace) for n in c.nodes] == [
        ("node0", "local", "~/.fabtrain/c1/node0"), ("node1", "local", "~/.fabtrain/c1/node1")]
    d["dist_ips"] = "10.0.0.1,10.0.0.1"
    with pytest.raises(UserError, match="the same address twice"):
        parse_cluster(d, "x.yaml")
