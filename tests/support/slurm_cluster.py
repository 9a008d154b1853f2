"""A real Slurm cluster on this machine for the tests: munged, slurmctld and three slurmd.

Debian's slurm-wlm 22.05 runs several slurmd on one host when each has its
own NodeName and port (`slurmd -N nK`). Everything lives under the test's own
folder (state, spool, logs, pid files, ports of its own) except munged's,
which runs as the munge user and so gets a folder of its own that user can
reach; its socket and key are private to this cluster, so two test runs never
share one. Accounting is off (no slurmdbd), as on many small clusters: `sacct`
answers that accounting storage is disabled. Every daemon is stopped by the
pid it was started with, never by name.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.sshd import free_port

SBIN = Path("/usr/sbin")
DAEMONS = ("slurmctld", "slurmd", "munged")


def slurm_missing() -> list[str]:
    """Install slurm-wlm and munge where missing (as `make system-deps` does); what is still missing."""
    wanted = (("slurm-wlm", SBIN / "slurmctld"), ("munge", SBIN / "munged"))
    missing = [pkg for pkg, path in wanted if not path.exists()]
    if missing:
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=False,
                       capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        missing = [pkg for pkg, path in wanted if not path.exists()]
    return missing


def _carrying(conf: Path) -> list[tuple[int, str]]:
    """(pid, command name) of every process whose environment names `conf` as its SLURM_CONF."""
    wanted, found = b"SLURM_CONF=" + bytes(conf), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if wanted in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.append((int(entry), Path(f"/proc/{entry}/comm").read_text().strip()))
            except OSError:
                continue  # gone, or not ours to read
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive_slurmctld(pidfile: Path) -> bool:
    try:
        stat = Path(f"/proc/{int(pidfile.read_text().strip())}/stat").read_text()
    except (OSError, ValueError):
        return False
    return "(slurmctld)" in stat and stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_orphaned_steps() -> None:
    """SIGKILL the step daemons (and their tasks) of earlier test clusters whose slurmctld is gone: a run killed
    midway never reached its own stop, and slurmstepd outlives slurmd."""
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit() or Path(f"/proc/{entry}/comm").read_text().strip() != "slurmstepd":
                continue
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        conf = Path(os.fsdecode(env.get(b"SLURM_CONF", b"")))
        if not conf.name or "ClusterName=fabtrain-test" not in (conf.read_text() if conf.exists() else
                                                               "ClusterName=fabtrain-test"):
            continue  # not a test cluster's
        if _alive_slurmctld(conf.parent / "slurmctld.pid"):
            continue  # its cluster is still up (another test run's)
        for pid, _ in _carrying(conf):
            _kill(pid)


@dataclass
class SlurmCluster:
    root: Path
    nodes: tuple[str, ...] = ("n1", "n2", "n3")
    procs: list[subprocess.Popen] = field(default_factory=list)
    munge_dir: Path | None = None
    # GPUs as GRES on stand-in device files (two a node, type "fake") and two CPUs a node bound by task/affinity:
    # Slurm's own binding (CUDA_VISIBLE_DEVICES, the CPU mask), without a GPU.
    resources: bool = False
    # A second partition "high" on the same nodes whose jobs preempt (requeue) those of "debug".
    preemption: bool = False
    slurmd_timeout: int = 300  # Slurm's default

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    def env(self, base: dict | None = None) -> dict:
        """The environment every Slurm command of this cluster needs (its slurm.conf)."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        # In the cluster's own folder: what a command leaves in its working directory (sbatch's default
        # slurm-<id>.out) stays out of the checkout.
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, check=check,
                              timeout=timeout, cwd=self.root)

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> "SlurmCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        stop_orphaned_steps()
        try:
            self._start_munge()
            self._write_conf()
            self._daemon([str(SBIN / "slurmctld"), "-D", "-i"])
            self._wait(lambda: "UP" in self.run("scontrol", "ping", check=False).stdout, "slurmctld to answer")
            for name in self.nodes:
                self._daemon([str(SBIN / "slurmd"), "-D", "-N", name])
            self._wait(lambda: self.idle() == len(self.nodes), "every slurmd to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def idle(self) -> int:
        out = self.run("sinfo", "-h", "-t", "idle", "-o", "%D", check=False).stdout.strip()
        return sum(int(x) for x in out.split()) if out else 0

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        # munged runs as munge and checks that no one else can write where its key and socket are.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="fabtrain-munge-"))
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        os.chmod(self.munge_dir, 0o700)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        os.chmod(key, 0o400)
        os.chmod(self.munge_dir, 0o711)  # the socket must be reachable by root's clients; its folder is not listable
        argv = ["setpriv", f"--reuid={munge.pw_uid}", f"--regid={munge.pw_gid}", "--init-groups",
                str(SBIN / "munged"), "-F", "--socket", str(self.socket), "--key-file", str(key),
                "--pid-file", str(self.munge_dir / "munged.pid"), "--log-file", str(self.munge_dir / "munged.log"),
                "--seed-file", str(self.munge_dir / "munged.seed")]
        self._daemon(argv)
        self._wait(lambda: subprocess.run(["munge", "-n", "-S", str(self.socket)], capture_output=True).returncode == 0,
                   "munged to answer")

    def _write_conf(self) -> None:
        host = socket.gethostname()
        ports = free_port(["127.0.0.1", "0.0.0.0"])  # a block of 16 ports no earlier call had
        ctld_port, node_ports = ports, [ports + 1 + i for i in range(len(self.nodes))]
        r = self.root
        lines = [
            "ClusterName=fabtrain-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"SlurmctldPort={ctld_port}",
            "ProctrackType=proctrack/linuxproc", f"TaskPlugin=task/{'affinity' if self.resources else 'none'}",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides", "ReturnToService=2",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # Short waits, so a cancelled or failed job leaves the nodes at once.
            "KillWait=5", "MinJobAge=300", "InactiveLimit=0", "MessageTimeout=10",
            # How long slurmctld waits for a silent slurmd before it marks the node DOWN (a lost node's test).
            f"SlurmdTimeout={self.slurmd_timeout}",
            "SchedulerParameters=sched_interval=1", "SchedulerType=sched/backfill",
        ]
        resources = "CPUs=1"
        if self.resources:
            for i in range(2):  # stand-ins for /dev/nvidiaK: char devices slurmd can stat
                device = r / f"fakegpu{i}"
                if not device.exists():
                    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            (r / "gres.conf").write_text(f"NodeName={','.join(self.nodes)} Name=gpu Type=fake File={r}/fakegpu[0-1]\n")
            lines.append("GresTypes=gpu")
            resources = "CPUs=2 Gres=gpu:fake:2"
        for name, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} {resources} "
                         "RealMemory=1000")
        if self.preemption:
            lines += ["PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE"]
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES State=UP MaxTime=INFINITE"
                     + (" PriorityTier=1" if self.preemption else ""))
        if self.preemption:
            lines.append(f"PartitionName=high Nodes={','.join(self.nodes)} State=UP MaxTime=INFINITE PriorityTier=2")
        (r / "state").mkdir(exist_ok=True)
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, argv: list[str]) -> None:
        log = open(self.root / f"{Path(argv[0]).name if argv[0] != 'setpriv' else 'munged'}-{len(self.procs)}.out", "ab")
        with log:
            self.procs.append(subprocess.Popen(argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def _wait(self, ready, what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"waiting for {what}: {p.args[0]} exited with {p.returncode}; "
                                       f"logs in {self.root}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {timeout:.0f} s; logs in {self.root}")
            time.sleep(0.05)

    # -- stop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Every job cancelled, then every daemon by its pid: slurmd first, then slurmctld, then munged (SIGKILL
        after 10 s); then whatever still carries this cluster's slurm.conf (a step daemon, which outlives its
        slurmd, and its tasks) is SIGKILLed by pid."""
        if self.procs and self.conf.exists():
            self.run("scancel", "--full", "--quiet", f"--user={os.getuid()}", check=False)
            deadline = time.monotonic() + 5
            while any(comm == "slurmstepd" for _, comm in _carrying(self.conf)) and time.monotonic() < deadline:
                time.sleep(0.1)
        daemons = {p.pid for p in self.procs}
        for p in reversed(self.procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs.clear()
        for pid, _ in _carrying(self.conf):
            if pid not in daemons:
                _kill(pid)
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None
