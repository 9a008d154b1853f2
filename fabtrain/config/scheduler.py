"""cluster.yaml's `scheduler:` section: a Slurm allocation instead of a node list.

A Slurm cluster's nodes are not known until the allocation is granted, so the
cluster gets `nodes` stand-ins, node0..nodeN-1: each is a workspace on the
filesystem the login and compute nodes share (``<cluster.workspace>/nodeK``),
reached from `fab` on the login node itself (``local``) or over SSH
(`login:`), and an address the allocation fills in (`address_placeholder`).
The plan, deploy, status, logs and the collector then work on them unchanged;
fabtrain/slurm/ renders and submits the job and reads Slurm's state back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fabtrain.config.checks import INVALID, valid

KINDS = ("slurm",)
FIELDS = {"kind", "nodes", "partition", "time", "gpus_per_node", "account", "sbatch", "login", "term_before"}
# Slurm's time formats: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
TIME_RE = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
SBATCH_OPTION_RE = re.compile(r"^--[a-z][a-z0-9-]*(=[^\n\r\0]*)?$")
# What the script sets itself, from the fields above or because the job needs it so.
OWN_OPTIONS = {"--nodes": "use scheduler.nodes", "--partition": "use scheduler.partition",
               "--time": "use scheduler.time", "--account": "use scheduler.account",
               "--gpus-per-node": "use scheduler.gpus_per_node", "--signal": "use scheduler.term_before",
               "--job-name": "from cluster.name", "--output": "into the workspace",
               "--ntasks-per-node": "one agent a node", "--ntasks": "one agent a node"}


@dataclass(frozen=True)
class SlurmSpec:
    nodes: int
    partition: str | None = None  # None: the cluster's default partition
    time: str | None = None  # None: the partition's default time limit
    gpus_per_node: int | None = None
    account: str | None = None
    sbatch: tuple[str, ...] = ()  # extra `#SBATCH` options, each one --name[=value]
    login: str | None = None  # None: fab runs on the login node itself
    term_before: int = 120  # seconds before the time limit at which every program gets SIGTERM (0: never)
    kind: str = "slurm"


def address_placeholder(index: int) -> str:
    """Node `index`'s address in the plan, until the allocation says which host it is."""
    return f"@slurm-node-{index}@"


def parse_scheduler(checks, value: Any, name_re: re.Pattern, host_re: re.Pattern) -> SlurmSpec:
    """scheduler: {...} -> SlurmSpec; every mistake one UserError naming the field (checks: config's _Checks)."""
    where = "scheduler"
    d = checks.mapping(value, where, FIELDS, {"kind", "nodes"})
    if not valid(d):
        return INVALID
    checks.choice(d["kind"], f"{where}.kind", KINDS)
    nodes = checks.integer(d["nodes"], f"{where}.nodes", 1, 100000)
    partition = checks.string(d["partition"], f"{where}.partition", name_re, "partition name") if "partition" in d else None
    account = checks.string(d["account"], f"{where}.account", name_re, "account name") if "account" in d else None
    time = None
    if "time" in d:
        if not isinstance(d["time"], str):
            raise checks.fail(f"{where}.time", 'must be a string in quotes, e.g. "12:00:00" (minutes, H:MM:SS or '
                                               'D-HH:MM:SS; YAML reads an unquoted 12:00:00 as a number)')
        time = d["time"].strip()
        if not TIME_RE.match(time):
            raise checks.fail(f"{where}.time", f"{time[:40]!r} is not a Slurm time limit (minutes, H:MM:SS, "
                                               "D-HH:MM:SS or UNLIMITED)")
    gpus = checks.integer(d["gpus_per_node"], f"{where}.gpus_per_node", 0, 1024) if "gpus_per_node" in d else None
    login = checks.string(d["login"], f"{where}.login", host_re, "host") if "login" in d else None
    term_before = checks.integer(d.get("term_before", SlurmSpec.term_before), f"{where}.term_before", 0, 86400)
    extra = d.get("sbatch") or []
    if not isinstance(extra, list):
        raise checks.fail(f"{where}.sbatch", "must be a list of sbatch options, e.g. [\"--qos=normal\"]")
    options = []
    for i, option in enumerate(extra):
        at = f"{where}.sbatch[{i}]"
        if not isinstance(option, str) or not SBATCH_OPTION_RE.match(option):
            raise checks.fail(at, "must be one long sbatch option on one line, e.g. \"--qos=normal\"")
        own = OWN_OPTIONS.get(option.split("=", 1)[0])
        if own:
            raise checks.fail(at, f"{option.split('=', 1)[0]} is set by fabtrain ({own})")
        options.append(option)
    if not valid(nodes, partition, account, gpus, login, term_before):
        return INVALID  # each already reported
    return SlurmSpec(nodes=nodes, partition=partition, time=time, gpus_per_node=gpus, account=account,
                     sbatch=tuple(options), login=login, term_before=term_before)


def node_roles(mode: str, index: int) -> tuple[str, ...]:
    """In pserver mode the first node of the allocation also holds the pservers (as with dist_ips)."""
    return ("pserver", "trainer") if mode == "pserver" and index == 0 else ("trainer",)
