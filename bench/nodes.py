"""Nodes for the benchmarks: real sshd on 127.0.0.x, logged into as a cluster's nodes would be.

Two accounts, because the login shell decides what every remote command costs:

  plain   fabtrain-bench, shell /bin/sh, nothing in its dotfiles, the system
          /usr/bin/python3 (a node as a cluster's admin sets it up)
  slow    root on this machine, whose ~/.bashrc runs `pyenv init` for every
          SSH command, non-interactive ones included (bash does that under sshd)

Every node's shell runs on the same 2 CPUs here; on a cluster each node pays
its own shell on its own CPU, so the plain account is what a user feels.
"""
from __future__ import annotations

import pwd
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.sshd import login_account

BENCH_USER = "fabtrain-bench"
# The stand-in every job process runs: needs no torch, no project code, no CPU.
STANDIN = "sleep 600"


@dataclass(frozen=True)
class Account:
    key: str  # "plain" | "slow": what --accounts takes
    label: str
    user: str
    python: str  # the nodes' interpreter: /root is 0700, so the bench user gets the system one


ACCOUNTS = {
    "plain": Account("plain", f"{BENCH_USER} (/bin/sh, /usr/bin/python3)", BENCH_USER, "/usr/bin/python3"),
    "slow": Account("slow", "root (.bashrc runs pyenv init)", "root", sys.executable),
}


def ensure_bench_user(user_key: Path) -> pwd.struct_passwd:
    """The plain account, made if missing, that logs in with the sshd cluster's user key."""
    return login_account(BENCH_USER, user_key)


def home(account: Account) -> Path:
    return Path(pwd.getpwnam(account.user).pw_dir)


def free_port(host: str = "127.0.0.2") -> int:
    """A port free on host now (the agents' coordinator must not meet another run's)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def standin_project(root: Path) -> Path:
    """A project folder to deploy: two small files, as a user's project has."""
    project = root / "project"
    project.mkdir(parents=True, exist_ok=True)
    (project / "train.py").write_text("import time\n\ntime.sleep(600)\n")
    (project / "README").write_text("stand-in project for bench/\n")
    return project


def write_cluster(path: Path, sshd, account: Account, *, name: str, roles: list[tuple[str, list[str]]],
                  job: dict, code: Path) -> Path:
    """A cluster file over sshd nodes as `account`; each node's workspace is the default
    ~/.fabtrain/<name>/<node> in that account's home."""
    by_name = {n.name: n for n in sshd.nodes}
    # parallel 64: every node at once, up to the 64 of bench/scale.py (the default is 32).
    settings = {**sshd.ssh_settings("strict"), "user": account.user, "parallel": 64}
    doc = {"cluster": {"name": name, "python": account.python, "ssh": settings},
           "nodes": [{"name": node, "host": by_name[node].address, "roles": r} for node, r in roles],
           "job": {"code": str(code), **job}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def openssh_argv(t, config_dir: Path) -> list[str]:
    """`ssh node` with OpenSSH, set up exactly as fabtrain's rsync runs it (its -F file, port, user, key)."""
    from fabtrain.remote.rsync import ssh_config_text
    config = config_dir / f"ssh-{t.node.name}.conf"
    config.write_text(ssh_config_text(t))
    ssh = t.node.ssh
    return ["ssh", "-F", str(config), "-p", str(ssh.port), "-l", ssh.user, "-i", str(ssh.key), t.node.host]


def remove_workspaces(account: Account, name: str) -> None:
    shutil.rmtree(home(account) / ".fabtrain" / name, ignore_errors=True)
