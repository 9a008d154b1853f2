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
FIELDS = {"kind", "nodes", "partition", "time", "gpus_per_node", "account", "sbatch", "login", "term_before",
          "requeue", "continue_after_time_limit", "cpus_per_rank", "mem_per_node", "exclusive"}
# Slurm's time formats: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
TIME_RE = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
SBATCH_OPTION_RE = re.compile(r"^--[a-z][a-z0-9-]*(=[^\n\r\0]*)?$")
GPUS_RE = re.compile(r"^(?:([A-Za-z0-9_.-]+):)?(\d+)$")  # "8" or "a100:8"
MEM_RE = re.compile(r"^\d+[KMGT]?$")  # Slurm's --mem: megabytes, or with a unit
# What the script sets itself, from the fields above or because the job needs it so.
OWN_OPTIONS = {"--nodes": "use scheduler.nodes", "--partition": "use scheduler.partition",
               "--time": "use scheduler.time", "--account": "use scheduler.account",
               "--gpus-per-node": "use scheduler.gpus_per_node", "--signal": "use scheduler.term_before",
               "--job-name": "from cluster.name", "--output": "into the workspace",
               "--ntasks-per-node": "one agent a node", "--ntasks": "one agent a node",
               "--requeue": "use scheduler.requeue", "--no-requeue": "use scheduler.requeue",
               "--open-mode": "every attempt appends to the job's output",
               "--cpus-per-task": "use scheduler.cpus_per_rank", "--mem": "use scheduler.mem_per_node",
               "--exclusive": "use scheduler.exclusive", "--error": "into the workspace with --output"}
# What would make the script something other than one job of one allocation, or fab unable to follow it.
REFUSED_OPTIONS = {"--array": "every array task would share one fabtrain job id, folder and secret",
                   "--het-job": "fabtrain runs one allocation of like nodes", "--hetjob": "fabtrain runs one "
                   "allocation of like nodes", "--wrap": "the batch script is fabtrain's",
                   "--parsable": "fab reads sbatch's answer itself", "--wait": "fab waits itself (fab watch)",
                   "--test-only": "use fab plan", "--gres": "use scheduler.gpus_per_node (with its type: a100:8)",
                   "--gpus": "use scheduler.gpus_per_node", "--gpus-per-task": "use scheduler.gpus_per_node",
                   "--mem-per-cpu": "use scheduler.mem_per_node", "--mem-per-gpu": "use scheduler.mem_per_node"}


@dataclass(frozen=True)
class SlurmSpec:
    nodes: int
    partition: str | None = None  # None: the cluster's default partition
    time: str | None = None  # None: the partition's default time limit
    gpus_per_node: int | None = None
    gpu_type: str | None = None  # `a100` of gpus_per_node: "a100:8" (GRES type); None: any
    account: str | None = None
    sbatch: tuple[str, ...] = ()  # extra `#SBATCH` options, each one --name[=value]
    login: str | None = None  # None: fab runs on the login node itself
    term_before: int = 120  # seconds before the time limit at which every program gets SIGTERM (0: never)
    requeue: int = 0  # Slurm attempts after the first (preemption, node failure, scontrol requeue); 0: --no-requeue
    continue_after_time_limit: bool = False  # at term_before: scontrol requeue (an attempt) instead of TIMEOUT
    cpus_per_rank: int | None = None  # --cpus-per-task of each node's step: this many for each of its processes
    mem_per_node: str | None = None  # --mem
    exclusive: bool = False  # --exclusive
    kind: str = "slurm"

    @property
    def gpus(self) -> str | None:
        """--gpus-per-node's value: "8" or "a100:8"."""
        if not self.gpus_per_node:
            return None
        return f"{self.gpu_type}:{self.gpus_per_node}" if self.gpu_type else str(self.gpus_per_node)


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
    gpus, gpu_type = None, None
    if isinstance(d.get("gpus_per_node"), str):
        m = GPUS_RE.match(d["gpus_per_node"].strip())
        if not m:
            raise checks.fail(f"{where}.gpus_per_node", f"{d['gpus_per_node'][:40]!r} is not a GPU count or "
                                                        "type:count (8, or a100:8)")
        gpu_type, gpus = m.group(1), checks.integer(int(m.group(2)), f"{where}.gpus_per_node", 0, 1024)
    elif "gpus_per_node" in d:
        gpus = checks.integer(d["gpus_per_node"], f"{where}.gpus_per_node", 0, 1024)
    requeue = checks.integer(d.get("requeue", 0), f"{where}.requeue", 0, 1000)
    go_on = checks.boolean(d.get("continue_after_time_limit", False), f"{where}.continue_after_time_limit")
    if go_on is True and not requeue:
        raise checks.fail(f"{where}.continue_after_time_limit", "needs scheduler.requeue of 1 or more (each "
                                                                "continuation is one more Slurm attempt)")
    cpus = checks.integer(d["cpus_per_rank"], f"{where}.cpus_per_rank", 1, 4096) if "cpus_per_rank" in d else None
    mem = None
    if "mem_per_node" in d:
        mem = str(d["mem_per_node"]).strip()
        if isinstance(d["mem_per_node"], bool) or not MEM_RE.match(mem):
            raise checks.fail(f"{where}.mem_per_node", f"{mem[:40]!r} is not a Slurm memory size (megabytes, or "
                                                       "with K, M, G or T: \"64G\")")
    exclusive = checks.boolean(d.get("exclusive", False), f"{where}.exclusive")
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
        name = option.split("=", 1)[0]
        if name in OWN_OPTIONS:
            raise checks.fail(at, f"{name} is set by fabtrain ({OWN_OPTIONS[name]})")
        if name in REFUSED_OPTIONS:
            raise checks.fail(at, f"{name} is not possible with fabtrain ({REFUSED_OPTIONS[name]})")
        options.append(option)
    if not valid(nodes, partition, account, gpus, login, term_before, requeue, go_on, cpus, exclusive):
        return INVALID  # each already reported
    return SlurmSpec(nodes=nodes, partition=partition, time=time, gpus_per_node=gpus, gpu_type=gpu_type,
                     account=account, sbatch=tuple(options), login=login, term_before=term_before, requeue=requeue,
                     continue_after_time_limit=go_on, cpus_per_rank=cpus, mem_per_node=mem, exclusive=exclusive)


def node_roles(mode: str, index: int) -> tuple[str, ...]:
    """In pserver mode the first node of the allocation also holds the pservers (as with dist_ips)."""
    return ("pserver", "trainer") if mode == "pserver" and index == 0 else ("trainer",)
