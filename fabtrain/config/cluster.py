"""cluster.yaml: load, validate, and turn into a frozen `Cluster`.

Every mistake in the file is reported at once, one line each naming the file,
the line, the field and the problem (`UserErrors`). Nothing here touches the network; paths that live
on the nodes are kept as written (``~`` is expanded on the node).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fabtrain.contract.checkpoints import ON_BAD_CHECKPOINT
from fabtrain.contract.states import STOP_GRACE
from fabtrain.config.checks import (ENV_NAME_RE, HOST_RE, IFACE_RE, IMAGE_RE, INVALID, NAME_RE, ONE_LINE_RE, USER_RE,
                                    Checks, FieldError, kind_of, reported, shown, valid)
from fabtrain.config.gpus import fit_gpus, parse_gpus, per_node_given
from fabtrain.config.elastic import check_min_nodes, check_spares, elastic_settings
from fabtrain.config.kubernetes import KubernetesSpec, parse_kubernetes
from fabtrain.config.launcher import check_launcher
from fabtrain.config.scheduler import SlurmSpec, address_placeholder, node_roles, parse_scheduler
from fabtrain.config.yamlfile import YAMLFileError, load_yaml_with_lines
from fabtrain.data.archive import DEFAULT_MAX_EXPANSION, DEFAULT_MAX_EXTRACT_MB
from fabtrain.errors import UserError, UserErrors

DEFAULT_CLUSTER_FILE = "cluster.yaml"
ROLES = ("pserver", "trainer")
MODES = ("pserver", "collective")
HOST_KEY_POLICIES = ("strict", "accept-new")
ON_FAILURE = ("kill-job", "keep", "restart")
LAUNCHERS = ("fabtrain", "mpirun")
NOTIFY_ON = ("failed", "hang", "restart", "finished")  # the default `on`
NOTIFY_KINDS = NOTIFY_ON + ("straggler", "no_checkpoint")  # what `on` may name
WEBHOOK_RE = re.compile(r"^https?://[^\s/?#]+[^\s]*$")



_SSH_FIELDS = {"user", "port", "key", "known_hosts", "host_key_policy", "connect_timeout"}

# Every field cluster.yaml may hold, by where it sits (docs/configuration.md documents each).
FIELDS: dict[str, set[str]] = {
    "": {"cluster", "nodes", "dist_ips", "scheduler", "job", "kubernetes"},
    "cluster": {"name", "workspace", "python", "ssh", "gpus"},
    "cluster.ssh": _SSH_FIELDS | {"parallel"},
    "nodes[]": {"name", "host", "roles", "workspace", "python", "address", "iface", "gpus", "spare"} | _SSH_FIELDS,
    "job": {"name", "mode", "sgd", "master_port", "code", "pserver", "trainer", "data", "watchdog", "env", "image",
            "launcher"},
    "job.pserver": {"port", "ports_num", "ports_num_for_sparse", "per_node", "command"},
    "job.trainer": {"per_node", "command", "use_gpu", "trainer_count", "gpus_per_rank"},
    "job.data": {"dir", "shared", "input", "test", "strategy", "min_freq", "max_extract_mb", "max_expansion"},
    "job.watchdog": {"enabled", "interval", "hang_timeout", "startup_timeout", "grace", "on_failure", "port", "notify",
                     "max_restarts", "restart_backoff", "restart_on_exit_codes", "straggler", "min_nodes", "instrument",
                     "no_checkpoint", "on_bad_checkpoint", "max_rejoins"},
    "job.watchdog.instrument": {"pserver", "trainer"},
    "job.watchdog.straggler": {"share", "window"},
    "job.watchdog.notify": {"webhook", "command", "on"},
}


@dataclass(frozen=True)
class SSHSettings:
    user: str | None = None  # None: ~/.ssh/config's User, else the current user
    port: int | None = None  # None: ~/.ssh/config's Port, else 22
    key: str | None = None  # None: ssh-agent / ~/.ssh/config IdentityFile / defaults
    known_hosts: str = "~/.ssh/known_hosts"
    host_key_policy: str = "accept-new"
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class Node:
    name: str
    host: str  # "local" or an SSH host / ~/.ssh/config alias
    roles: tuple[str, ...]
    workspace: str
    python: str
    address: str  # how the other nodes reach this one (torch/paddle endpoints)
    ssh: SSHSettings
    gpus: int | None = None  # how many; None: whatever the node has
    gpu_ids: tuple[int, ...] | None = None  # the physical indices `gpus: [2, 3]` names; None: 0..gpus-1
    gpu_auto: bool = False  # `gpus: auto`: the node's free GPUs, leased at start (docs/gpu.md)
    iface: str | None = None  # the interface gloo/NCCL use; None: the one carrying `address`, found at start
    spare: bool = False  # min_nodes: runs its agent and no program until it takes a lost trainer node's place

    @property
    def is_local(self) -> bool:
        return self.host == "local"


# A port of None is `auto`: chosen at start among the ports free on the nodes
# concerned (fabtrain.controller.preflight), recorded in job.json.


@dataclass(frozen=True)
class PserverSpec:
    port: int | None = 7164
    ports_num: int = 1
    ports_num_for_sparse: int = 1
    per_node: int = 1
    command: str = "python -m workload.pserver"


@dataclass(frozen=True)
class TrainerSpec:
    per_node: int = 1
    command: str = "python -m workload.trainer --model word2vec"
    use_gpu: bool = False
    trainer_count: int = 1  # PaddlePaddle's per-process thread/GPU count
    gpus_per_rank: int = 1  # with use_gpu: how many of its node's GPUs each local rank sees


@dataclass(frozen=True)
class DataSpec:
    dir: str = "data/sample"  # on this machine, relative to the cluster file
    shared: bool = False  # True: already on shared storage at this path on every node
    input: str = "sample"  # what `fab split-data` splits: a file, a directory, a URL, or "sample"
    test: str | None = None  # a test-set file (a tarball brings its own)
    strategy: str = "contiguous"  # contiguous | round-robin | files
    min_freq: int = 1  # dictionary cut-off
    max_extract_mb: int = DEFAULT_MAX_EXTRACT_MB  # a tarball input may extract to this much
    max_expansion: float = DEFAULT_MAX_EXPANSION  # ... and to this many times its own size


@dataclass(frozen=True)
class NotifySpec:
    """Alerts the agents send themselves (fabtrain/node/agent/notify.py): no controller needed."""
    webhook: str | None = None  # POST a JSON body (Slack-compatible `text`, plus the event)
    command: tuple[str, ...] = ()  # argv run with the event as JSON on stdin (no shell)
    on: tuple[str, ...] = NOTIFY_ON


@dataclass(frozen=True)
class WatchdogSpec:
    enabled: bool = True
    interval: float = 1.0
    hang_timeout: float = 120.0
    # Before its first metrics record a process may take this long to start, and every node must join.
    startup_timeout: float = 600.0
    grace: float = STOP_GRACE  # seconds between SIGTERM and SIGKILL
    on_failure: str = "kill-job"
    port: int | None = 7180  # the agents' shared store, on the first node
    notify: NotifySpec | None = None
    # on_failure restart: how many times, the first backoff (doubled each time), which exit codes (None: any).
    max_restarts: int = 3
    # A rank below straggler_share of the median rank's step rate for straggler_window seconds: a straggler.
    straggler_share: float = 0.7
    straggler_window: float = 60.0
    restart_backoff: float = 10.0
    restart_on_exit_codes: tuple[int, ...] | None = None
    # on_failure restart: a lost node leaves and the job goes on while this many trainer nodes are left (None: fails).
    min_nodes: int | None = None
    # min_nodes: how many times one node that left may come back into the job; after that it is kept out.
    max_rejoins: int = 3
    # The roles whose Python programs write progress records through the launcher's hook (docs/progress.md).
    instrument: tuple[str, ...] = ("pserver", "trainer")
    # Seconds without a new checkpoint from any trainer (the hook sees the saves) before a `no_checkpoint`
    # event and alert (None: never).
    no_checkpoint: float | None = None
    # on_failure restart, two generations in a row failing soon after loading one checkpoint file: stop (the
    # job fails), or previous (restart once more, FABTRAIN_RESUME_FROM naming the checkpoint saved before it).
    on_bad_checkpoint: str = ON_BAD_CHECKPOINT[0]


@dataclass(frozen=True)
class JobSpec:
    name: str = "job"
    mode: str = "pserver"
    sgd: str = "sync"
    master_port: int | None = 29500  # torch / paddle collective rendezvous
    code: str = "."  # what `fab deploy` ships, relative to the cluster file: the project's own code
    pserver: PserverSpec = field(default_factory=PserverSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    data: DataSpec = field(default_factory=DataSpec)
    watchdog: WatchdogSpec = field(default_factory=WatchdogSpec)
    env: tuple[tuple[str, str], ...] = ()
    image: str | None = None  # the container image of `fab export --k8s`: python3, fabtrain and job.code in it
    launcher: str = "fabtrain"  # who starts the ranks: fabtrain on each node, or one `mpirun` (collective mode)


@dataclass(frozen=True)
class Cluster:
    name: str
    path: str  # the file it came from, for messages and relative paths
    parallel: int
    nodes: tuple[Node, ...]
    job: JobSpec
    scheduler: SlurmSpec | None = None  # a Slurm allocation; then `nodes` are its stand-ins (config/scheduler.py)
    kubernetes: KubernetesSpec | None = None  # the job's pods (fab export --k8s; status, logs, kill-all by kubectl)

    @property
    def trainer_nodes(self) -> tuple[Node, ...]:
        """The nodes whose trainers make the job's world at start: spares are not in it (spare_nodes)."""
        return tuple(n for n in self.nodes if "trainer" in n.roles and not n.spare)

    @property
    def spare_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.spare)

    @property
    def pserver_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if "pserver" in n.roles)

    @property
    def trainer_count(self) -> int:
        """Number of trainer processes (PaddlePaddle's num_gradient_servers)."""
        return len(self.trainer_nodes) * self.job.trainer.per_node

    @property
    def pserver_count(self) -> int:
        if self.job.mode != "pserver":
            return 0
        return len(self.pserver_nodes) * self.job.pserver.per_node

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UserError(f"{self.path}: no node named {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    def code_dir(self) -> Path:
        """job.code on this machine (relative to the cluster file, like job.data.dir)."""
        d = Path(os.path.expanduser(self.job.code))
        return (d if d.is_absolute() else Path(self.path).resolve().parent / d).resolve()

    def data_dir(self) -> Path:
        """job.data.dir on this machine (relative paths are relative to the cluster file)."""
        d = Path(os.path.expanduser(self.job.data.dir))
        return d if d.is_absolute() else Path(self.path).resolve().parent / d


def cluster_path(path: str | os.PathLike | None = None) -> str:
    """The cluster file to use: the argument, else $FABTRAIN_CLUSTER, else ./cluster.yaml."""
    return os.fspath(path or os.environ.get("FABTRAIN_CLUSTER") or DEFAULT_CLUSTER_FILE)


@reported
def _no_checkpoint(p, w: dict, watchdog: WatchdogSpec) -> WatchdogSpec:
    """job.watchdog.no_checkpoint: seconds without a new checkpoint before the `no_checkpoint` event and alert.
    Setting it asks for the alert: a notify without its own `on` sends it too."""
    if w.get("no_checkpoint") is None:
        return watchdog
    limit = p.number(w["no_checkpoint"], "job.watchdog.no_checkpoint", 1, 30 * 86400)
    notify = watchdog.notify
    if notify is not None and isinstance(w.get("notify"), dict) and "on" not in w["notify"]:
        notify = replace(notify, on=notify.on + ("no_checkpoint",))
    return replace(watchdog, no_checkpoint=limit, notify=notify)


@reported
def _on_bad_checkpoint(p, w: dict, watchdog: WatchdogSpec) -> WatchdogSpec:
    """job.watchdog.on_bad_checkpoint: stop (the default), or previous (coordination/restart.py)."""
    value = p.choice(w.get("on_bad_checkpoint", watchdog.on_bad_checkpoint), "job.watchdog.on_bad_checkpoint",
                     ON_BAD_CHECKPOINT)
    return replace(watchdog, on_bad_checkpoint=value) if value in ON_BAD_CHECKPOINT else watchdog


def _instrument(checks: Checks, value: Any, where: str) -> tuple[str, ...]:
    """job.watchdog.instrument: true, false, or per role ({trainer: true, pserver: false}; a role left out is
    instrumented)."""
    if isinstance(value, bool):
        return WatchdogSpec.instrument if value else ()
    if not isinstance(value, dict):
        raise checks.fail(where, f"must be true, false or a mapping of roles to true/false, got {kind_of(value)}")
    roles = checks.mapping(value, where, FIELDS[where])
    return tuple(r for r in WatchdogSpec.instrument if checks.boolean(roles.get(r, True), f"{where}.{r}"))


def load_cluster(path: str | os.PathLike | None = None) -> Cluster:
    path = cluster_path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UserError(f"{path}: no such cluster file (set FABTRAIN_CLUSTER or create ./cluster.yaml)") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    try:
        doc, lines = load_yaml_with_lines(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        kind = "" if isinstance(e, YAMLFileError) else "YAML syntax error: "
        raise UserError(f"{path}: {where}{kind}{problem}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    return parse_cluster(doc, path, lines)


def parse_cluster(doc: Any, path: str = DEFAULT_CLUSTER_FILE, lines: dict[str, int] | None = None) -> Cluster:
    """The Cluster `doc` describes; every mistake in it at once (UserErrors), each on its `lines` line."""
    return _Parser(path, lines or {}).cluster(doc)


class _Parser(Checks):
    """Walks the YAML document; every check knows the dotted field it is on."""

    def cluster(self, doc: Any) -> Cluster:
        if doc is None:
            raise UserError(f"{self.path}: the file is empty")
        if not isinstance(doc, dict):
            raise UserError(f"{self.path}: (top level): must be a mapping, got {kind_of(doc)}")
        top = self.mapping(doc, "", FIELDS[""], {"cluster", "job"})
        if sum(k in top for k in ("nodes", "dist_ips", "scheduler")) != 1:
            self.report("nodes", "give exactly one of 'nodes' (a list), 'dist_ips' (\"ip1,ip2\") "
                                 "or 'scheduler' (a Slurm allocation)")

        c = self.mapping(top["cluster"], "cluster", FIELDS["cluster"], {"name"})
        name = self.string(c["name"], "cluster.name", NAME_RE, "name")
        workspace = self.path_value(c.get("workspace", f"~/.fabtrain/{name}" if valid(name) else INVALID),
                                    "cluster.workspace")
        python = self.path_value(c["python"], "cluster.python") if "python" in c else None
        ssh_doc = self.mapping(c.get("ssh"), "cluster.ssh", FIELDS["cluster.ssh"])
        parallel = self.integer(ssh_doc.get("parallel", 32), "cluster.ssh.parallel", 1, 1024)
        ssh = self.ssh(ssh_doc, "cluster.ssh", SSHSettings())
        # Every node's `gpus` where it gives none of its own (`cluster: {gpus: auto}`).
        self.default_gpus = self.gpus(c["gpus"], "cluster.gpus") if "gpus" in c else (None, None, False)

        job = self.part(self.job, top["job"])
        nodes: tuple[Node, ...] = ()
        scheduler = self.part(parse_scheduler, self, top["scheduler"], NAME_RE, HOST_RE) if "scheduler" in top else None
        kubernetes = self.part(parse_kubernetes, self, top["kubernetes"]) if "kubernetes" in top else None
        if scheduler is not None and kubernetes is not None:
            self.report("kubernetes", "a cluster file is either a Slurm allocation (scheduler) or Kubernetes pods: "
                                      "give one of them")
        if scheduler is not None and "gpus" in c:
            self.report("cluster.gpus", "Slurm chooses the GPUs (scheduler.gpus_per_node): leave cluster.gpus out")
        if scheduler is not None:  # the allocation's stand-ins: node K's workspace on the shared filesystem
            if valid(scheduler, job, workspace):
                nodes = tuple(self.make_node(f"node{i}", scheduler.login or "local", node_roles(job.mode, i),
                                             f"{workspace}/node{i}", python, address_placeholder(i), ssh,
                                             scheduler.gpus_per_node, None) for i in range(scheduler.nodes))
            scheduler = scheduler if valid(scheduler) else None
        elif "dist_ips" in top:
            nodes = self.part(self.dist_ips, top["dist_ips"], workspace, python, ssh, job)
            nodes = nodes if valid(nodes) else ()
        elif "nodes" in top:
            nodes = self.nodes(top["nodes"], workspace, python, ssh)
        self.check_keys(nodes)

        if not self.errors:  # the checks across fields, once every field is right
            cluster = Cluster(name=name, path=self.path, parallel=parallel, nodes=nodes, job=job, scheduler=scheduler,
                              kubernetes=kubernetes)
            fitted = self.part(fit_gpus, cluster, per_node_given(doc), self.fail)
            cluster = fitted if valid(fitted) else cluster
            self.part(self.check_roles, cluster)
            self.part(check_launcher, cluster, self.fail)
            self.part(check_min_nodes, cluster, self.fail)
            self.part(check_spares, cluster, self.fail)
        if self.errors:
            raise UserErrors(sorted(self.errors, key=lambda e: e.line))
        return cluster

    def part(self, parse, *args):
        """One part of the file whose own mistakes do not stop the rest being read."""
        try:
            return parse(*args)
        except FieldError as e:
            self.errors.append(e)
            return INVALID

    def check_keys(self, nodes: tuple[Node, ...]) -> None:
        """An SSH key must be readable where a node connects with it; a local node never does."""
        for i, n in enumerate(nodes):
            key = n.ssh.key
            if key and valid(key) and not n.is_local:
                expanded = os.path.expanduser(key)
                if not os.path.isfile(expanded) or not os.access(expanded, os.R_OK):
                    where = self.key_fields.get(n.name, "cluster.ssh.key")
                    self.report(where, f"cannot read key file {key} (node {n.name} connects with it)")
                    return

    def ssh(self, doc: dict, where: str, base: SSHSettings) -> SSHSettings:
        user = base.user
        if "user" in doc:
            user = self.string(doc["user"], f"{where}.user", USER_RE, "user name")
        port = self.integer(doc["port"], f"{where}.port", 1, 65535) if "port" in doc else base.port
        key = self.path_value(doc["key"], f"{where}.key") if "key" in doc else base.key
        known_hosts = self.path_value(doc["known_hosts"], f"{where}.known_hosts") if "known_hosts" in doc else base.known_hosts
        policy = self.choice(doc["host_key_policy"], f"{where}.host_key_policy", HOST_KEY_POLICIES) if "host_key_policy" in doc else base.host_key_policy
        timeout = self.number(doc["connect_timeout"], f"{where}.connect_timeout", 0.1, 3600) if "connect_timeout" in doc else base.connect_timeout
        return SSHSettings(user=user, port=port, key=key, known_hosts=known_hosts, host_key_policy=policy, connect_timeout=timeout)

    def nodes(self, value: Any, workspace: str, python: str | None, ssh: SSHSettings) -> tuple[Node, ...]:
        if not isinstance(value, list):
            self.report("nodes", f"must be a list of nodes, got {kind_of(value)}")
            return ()
        if not value:
            self.report("nodes", "must list at least one node")
        nodes, seen = [], {}
        for i, item in enumerate(value):
            where = f"nodes[{i}]"
            d = self.mapping(item, where, FIELDS["nodes[]"], {"name", "host", "roles"})
            name = self.string(d["name"], f"{where}.name", NAME_RE, "node name")
            if name in seen:
                self.report(f"{where}.name", f"duplicate node name {name!r} (also nodes[{seen[name]}])")
            elif valid(name):
                seen[name] = i
            host = self.string(d["host"], f"{where}.host", HOST_RE, "host")
            roles = self.roles(d["roles"], f"{where}.roles")
            node_ssh = self.ssh(d, where, ssh)
            if "key" in d and valid(name):
                self.key_fields[name] = f"{where}.key"
            # A node's own workspace, else one folder per node under the cluster's: two
            # nodes on one machine, or on servers sharing /home, never share one by default.
            ws = self.path_value(d["workspace"], f"{where}.workspace") if "workspace" in d else f"{workspace}/{name}"
            py = self.path_value(d["python"], f"{where}.python") if "python" in d else python
            address = self.string(d["address"], f"{where}.address", HOST_RE, "address") if "address" in d else None
            gpus = self.gpus(d["gpus"], f"{where}.gpus") if "gpus" in d else self.default_gpus
            iface = self.string(d["iface"], f"{where}.iface", IFACE_RE, "interface name") if "iface" in d else None
            spare = self.boolean(d["spare"], f"{where}.spare") if "spare" in d else False
            nodes.append(self.make_node(name, host, roles, ws, py, address, node_ssh,
                                        *(gpus if valid(gpus) else (None, None, False)), iface=iface, spare=spare))
        return tuple(nodes)

    @reported
    def roles(self, value: Any, where: str) -> tuple[str, ...]:
        roles = [value] if isinstance(value, str) else value
        if not isinstance(roles, list) or not roles:
            raise self.fail(where, "must be a non-empty list of roles (pserver, trainer)")
        for r in roles:
            if r not in ROLES:
                raise self.fail(where, f"unknown role {shown(r)}; roles are: {', '.join(ROLES)}")
        return tuple(dict.fromkeys(roles))

    def dist_ips(self, value: Any, workspace: str, python: str | None, ssh: SSHSettings, job: JobSpec) -> tuple[Node, ...]:
        """PaddleX's Train.dist_ips: "ip1,ip2"; the first machine also hosts the pserver."""
        if isinstance(value, str):
            ips = [s.strip() for s in value.split(",")]
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            ips = [s.strip() for s in value]
        else:
            raise self.fail("dist_ips", f'must be a string like "10.0.0.1,10.0.0.2" or a list of addresses, got {kind_of(value)}')
        if not ips or any(not ip for ip in ips):
            raise self.fail("dist_ips", "must list at least one address, separated by commas, with none empty")
        machines = [ip for ip in ips if ip != "local"]  # "local,local": two nodes on this machine, as nodes: allows
        if len(set(machines)) != len(machines):
            raise self.fail("dist_ips", "lists the same address twice")
        pserver_mode = valid(job) and job.mode == "pserver"
        nodes = []
        for i, ip in enumerate(ips):
            host = self.string(ip, f"dist_ips[{i}]", HOST_RE, "host")
            roles = ("pserver", "trainer") if (i == 0 and pserver_mode) else ("trainer",)
            gpus = self.default_gpus if valid(self.default_gpus) else (None, None, False)
            nodes.append(self.make_node(f"node{i}", host, roles, f"{workspace}/node{i}", python, None, ssh, *gpus))
        return tuple(nodes)

    gpus = parse_gpus

    def make_node(self, name, host, roles, workspace, python, address, ssh, gpus, gpu_ids, gpu_auto=False, iface=None, spare=False) -> Node:
        if host == "local":
            address = address or "127.0.0.1"
            # A local node runs on this machine: the interpreter that runs fab.
            python = python or sys.executable
        else:
            address = address or host
            python = python or "python3"
        return Node(name=name, host=host, roles=roles, workspace=workspace, python=python, address=address, ssh=ssh,
                    gpus=gpus, gpu_ids=gpu_ids, gpu_auto=gpu_auto, iface=iface, spare=spare)

    def job_env(self, env_doc: Any) -> list[tuple[str, str]]:
        """job.env: NAME: value pairs, every value a string (a YAML boolean as true/false)."""
        if not isinstance(env_doc, dict):
            self.report("job.env", f"must be a mapping of NAME: value, got {kind_of(env_doc)}")
            return []
        env = []
        for k, v in env_doc.items():
            if not isinstance(k, str) or not ENV_NAME_RE.match(k):
                self.report(f"job.env.{k}", "not a valid environment variable name")
            elif isinstance(v, (dict, list)) or v is None:
                self.report(f"job.env.{k}", f"must be a string or number, got {kind_of(v)}")
            else:
                env.append((k, str(v).lower() if isinstance(v, bool) else str(v)))
        return env

    def job(self, value: Any) -> JobSpec:
        d = self.mapping(value, "job", FIELDS["job"])
        name = self.string(d.get("name", "job"), "job.name", NAME_RE, "job name")
        mode = self.choice(d.get("mode", "pserver"), "job.mode", MODES)
        sgd = self.choice(d.get("sgd", "sync"), "job.sgd", ("sync", "async"))
        master_port = self.port(d.get("master_port", JobSpec.master_port), "job.master_port")

        p = self.mapping(d.get("pserver"), "job.pserver", FIELDS["job.pserver"])
        dp = PserverSpec()
        pserver = PserverSpec(
            port=self.port(p.get("port", dp.port), "job.pserver.port"),
            ports_num=self.integer(p.get("ports_num", dp.ports_num), "job.pserver.ports_num", 1, 1024),
            ports_num_for_sparse=self.integer(p.get("ports_num_for_sparse", dp.ports_num_for_sparse), "job.pserver.ports_num_for_sparse", 0, 1024),
            per_node=self.integer(p.get("per_node", dp.per_node), "job.pserver.per_node", 1, 64),
            command=self.command(p.get("command", dp.command), "job.pserver.command"),
        )
        if valid(pserver.port, pserver.per_node, pserver.ports_num, pserver.ports_num_for_sparse):
            span = pserver.per_node * (pserver.ports_num + pserver.ports_num_for_sparse)
            if pserver.port is not None and pserver.port + span - 1 > 65535:
                self.report("job.pserver.port", f"{pserver.port} + {span} ports runs past 65535")

        t = self.mapping(d.get("trainer"), "job.trainer", FIELDS["job.trainer"])
        dt = TrainerSpec()
        trainer = TrainerSpec(
            per_node=self.integer(t.get("per_node", dt.per_node), "job.trainer.per_node", 1, 256),
            command=self.command(t.get("command", dt.command), "job.trainer.command"),
            use_gpu=self.boolean(t.get("use_gpu", dt.use_gpu), "job.trainer.use_gpu"),
            trainer_count=self.integer(t.get("trainer_count", dt.trainer_count), "job.trainer.trainer_count", 1, 1024),
            gpus_per_rank=self.integer(t.get("gpus_per_rank", dt.gpus_per_rank), "job.trainer.gpus_per_rank", 1, 64),
        )

        dd = self.mapping(d.get("data"), "job.data", FIELDS["job.data"])
        data = DataSpec(
            dir=self.path_value(dd.get("dir", DataSpec.dir), "job.data.dir"),
            shared=self.boolean(dd.get("shared", False), "job.data.shared"),
            # input and test are read on this machine by prepare.py, never by a shell.
            input=self.string(dd.get("input", DataSpec.input), "job.data.input", ONE_LINE_RE, "input (one line)"),
            test=self.string(dd["test"], "job.data.test", ONE_LINE_RE, "path (one line)") if dd.get("test") is not None else None,
            strategy=self.choice(dd.get("strategy", DataSpec.strategy), "job.data.strategy", ("contiguous", "round-robin", "files")),
            min_freq=self.integer(dd.get("min_freq", 1), "job.data.min_freq", 1, 1 << 30),
            max_extract_mb=self.integer(dd.get("max_extract_mb", DataSpec.max_extract_mb), "job.data.max_extract_mb", 1, 1 << 40),
            max_expansion=self.number(dd.get("max_expansion", DataSpec.max_expansion), "job.data.max_expansion", 1, 1e9),
        )

        w = self.mapping(d.get("watchdog"), "job.watchdog", FIELDS["job.watchdog"])
        dw = WatchdogSpec()
        watchdog = WatchdogSpec(
            enabled=self.boolean(w.get("enabled", dw.enabled), "job.watchdog.enabled"),
            interval=self.number(w.get("interval", dw.interval), "job.watchdog.interval", 0.1, 3600),
            hang_timeout=self.number(w.get("hang_timeout", dw.hang_timeout), "job.watchdog.hang_timeout", 1, 7 * 86400),
            startup_timeout=self.number(w.get("startup_timeout", dw.startup_timeout), "job.watchdog.startup_timeout",
                                        1, 7 * 86400),
            grace=self.number(w.get("grace", dw.grace), "job.watchdog.grace", 0, 600),
            on_failure=self.choice(w.get("on_failure", dw.on_failure), "job.watchdog.on_failure", ON_FAILURE),
            port=self.port(w.get("port", dw.port), "job.watchdog.port"),
            notify=self.part(self.notify, w["notify"]) if w.get("notify") is not None else None,
            max_restarts=self.integer(w.get("max_restarts", dw.max_restarts), "job.watchdog.max_restarts", 0, 1000),
            restart_backoff=self.number(w.get("restart_backoff", dw.restart_backoff), "job.watchdog.restart_backoff",
                                        0, 3600),
            restart_on_exit_codes=self.exit_codes(w.get("restart_on_exit_codes"), "job.watchdog.restart_on_exit_codes"),
            **elastic_settings(self, w, dw),
            **self.straggler(w.get("straggler"), dw),
            instrument=_instrument(self, w.get("instrument", True), "job.watchdog.instrument"),
        )
        watchdog = _on_bad_checkpoint(self, w, _no_checkpoint(self, w, watchdog))

        env = self.job_env(d.get("env") or {})
        code = self.path_value(d.get("code", JobSpec.code), "job.code")
        image = self.string(d["image"], "job.image", IMAGE_RE, "container image") if d.get("image") is not None else None
        launcher = self.choice(d.get("launcher", JobSpec.launcher), "job.launcher", LAUNCHERS)
        return JobSpec(name=name, mode=mode, sgd=sgd, master_port=master_port, code=code, pserver=pserver,
                       trainer=trainer, data=data, watchdog=watchdog, env=tuple(env), image=image, launcher=launcher)

    def notify(self, value: Any) -> NotifySpec:
        where = "job.watchdog.notify"
        n = self.mapping(value, where, FIELDS[where])
        webhook = None
        if n.get("webhook") is not None:
            webhook = self.string(n["webhook"], f"{where}.webhook")
            if not WEBHOOK_RE.match(webhook):
                raise self.fail(f"{where}.webhook", f"{shown(webhook)} is not an http:// or https:// URL")
        command: tuple[str, ...] = ()
        if n.get("command") is not None:
            if not isinstance(n["command"], list) or not n["command"]:
                raise self.fail(f"{where}.command", f"must be a non-empty list of arguments (argv, no shell), "
                                                    f"got {kind_of(n['command'])}")
            command = tuple(self.string(a, f"{where}.command[{i}]", ONE_LINE_RE) for i, a in enumerate(n["command"]))
        if not webhook and not command:
            raise self.fail(where, "give a webhook, a command, or both")
        on = n.get("on", list(NOTIFY_ON))
        if not isinstance(on, list) or not on:
            raise self.fail(f"{where}.on", f"must be a non-empty list of: {', '.join(NOTIFY_KINDS)}")
        on = tuple(self.choice(k, f"{where}.on[{i}]", NOTIFY_KINDS) for i, k in enumerate(on))
        return NotifySpec(webhook=webhook, command=command, on=on)

    def straggler(self, doc, dw: WatchdogSpec) -> dict:
        s = self.mapping(doc, "job.watchdog.straggler", FIELDS["job.watchdog.straggler"])
        return {"straggler_share": self.number(s.get("share", dw.straggler_share), "job.watchdog.straggler.share",
                                               0.01, 1),
                "straggler_window": self.number(s.get("window", dw.straggler_window), "job.watchdog.straggler.window",
                                                1, 7 * 86400)}

    def check_roles(self, cluster: Cluster) -> None:
        if not cluster.trainer_nodes and not cluster.spare_nodes:  # every one a spare: check_spares says so
            raise self.fail("nodes", "no node has the trainer role")
        if cluster.job.mode == "pserver" and not cluster.pserver_nodes:
            raise self.fail("nodes", "job.mode is pserver but no node has the pserver role")
        if cluster.job.mode == "collective":
            for i, n in enumerate(cluster.nodes):
                if "pserver" in n.roles:
                    raise self.fail(f"nodes[{i}].roles", "job.mode is collective: there are no pservers (remove the pserver role or set job.mode: pserver)")
        # Two nodes on one machine must not share a workspace: kill-all finds a
        # node's processes by the workspace marker.
        seen: dict[tuple[str, str], str] = {}
        for n in cluster.nodes:
            key = ("local" if n.is_local else n.host, n.workspace)
            if key in seen:
                raise self.fail(f"nodes.{n.name}.workspace", f"same host and workspace as node {seen[key]!r}; give each node on one machine its own workspace")
            seen[key] = n.name
