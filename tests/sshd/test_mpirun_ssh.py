"""`job.launcher: mpirun` on 3 real sshd nodes: one mpirun on the first trainer node starts every
rank over the cluster's SSH settings; fabtrain's agents still watch every rank on every node.

The MPI program is C, compiled here by Open MPI's mpicc (tests/programs/mpi_allreduce.c)."""
import json
import os
import re
import shutil
import signal
import subprocess

import pytest

from fabtrain.node import procfs
from tests.conftest import require
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port, write_cluster

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]
NODES = ("node1", "node2", "node3")


@pytest.fixture(scope="module")
def allreduce(tmp_path_factory):
    require(shutil.which("mpicc") and shutil.which("mpirun"), "openmpi",
            "mpirun and mpicc come with openmpi-bin and libopenmpi-dev (`make system-deps`)")
    binary = tmp_path_factory.mktemp("mpi") / "mpi_allreduce"
    subprocess.run(["mpicc", "-O1", "-o", str(binary), "tests/programs/mpi_allreduce.c"], check=True)
    return binary


class MpiJob:
    def __init__(self, fab, root, sshd, binary, sleep):
        self.fab, self.root, self.sshd_port = fab, root, sshd.port
        port = free_port([n.address for n in sshd.nodes])
        self.path = write_cluster(root / "c.yaml", sshd, ssh_nodes=[(n, ["trainer"]) for n in NODES],
                                  job={"mode": "collective", "launcher": "mpirun", "master_port": port,
                                       "trainer": {"command": f"{binary} {sleep}"},
                                       "watchdog": {"port": free_port([sshd.nodes[0].address]), "grace": 1,
                                                    "interval": 0.2}})
        self.ws = [root / f"ws-{n}" for n in NODES]
        out = fab("deploy", "start-trainers", cluster=self.path, check=True)
        self.job_id = re.search(r"job (\S+): trainer started", out.stdout).group(1)
        self.jds = [w / "jobs" / self.job_id for w in self.ws]

    def exits(self):
        return {f"{jd.parent.parent.name}/{f.name}": f.read_text().strip() for jd in self.jds
                for f in (jd / "run").glob("*.exit") if f.name != "agent.exit"}

    def program(self, rank):
        """The pid of rank's program (the launcher's child) on its node, once mpirun has started it."""
        run = self.jds[rank] / "run" / f"trainer-{rank}.json"

        def found():
            if not run.exists():
                return None
            procs = procfs.scan()
            kids = procfs.children_map(procs)
            return next(iter(kids.get(json.loads(run.read_text())["pid"], ())), None)
        pid = wait_for(found, timeout=60)
        assert pid, self.describe()
        return pid

    def leftovers(self, agents=True):
        """Job processes by the marker, and Open MPI's daemons that our sshd nodes started (the
        daemons do not carry the marker: sshd started them, in the login's environment)."""
        found = live_marked(self.ws)
        if not agents:
            found = [f for f in found if "fabtrain.node.agent" not in f[1] and "fabtrain-keeper" not in f[1]]
        for pid, p in procfs.scan().items():
            cmd = procfs.cmdline(pid)
            if p.dead or not cmd or os.path.basename(cmd[0]) not in ("orted", "prted"):
                continue
            # SSH_CONNECTION=<client> <port> <server> <server port>: these sshd nodes' port.
            if procfs.environ(pid).get(b"SSH_CONNECTION", b"").endswith(b" %d" % self.sshd_port):
                found.append((pid, " ".join(cmd)))
        return sorted(set(found))

    def describe(self):
        lines = [f"leftovers: {self.leftovers()}", json.dumps(self.exits())]
        for jd in self.jds:
            lines += [f"--- {f}\n{f.read_text()[-1500:]}" for f in sorted(jd.glob("logs/*.log"))]
            if (jd / "events.jsonl").exists():
                lines.append((jd / "events.jsonl").read_text()[-3000:])
        return "\n".join(lines)

    def close(self):
        if self.leftovers():
            self.fab("kill-all", "--grace", "1", cluster=self.path)


@pytest.fixture
def mpi_job(fab, tmp_path, sshd, allreduce):
    jobs = []

    def start(sleep):
        jobs.append(MpiJob(fab, tmp_path, sshd, allreduce, sleep))
        return jobs[-1]
    yield start
    for job in jobs:
        job.close()


def test_mpirun_starts_every_rank_over_ssh_and_the_allreduce_is_right(mpi_job):
    job = mpi_job(0)
    names = {f"ws-{n}/{x}.exit" for n, x in zip(NODES, ("trainer-0", "trainer-1", "trainer-2"))} | \
        {"ws-node1/mpirun-0.exit"}
    assert wait_for(lambda: set(job.exits()) == names, timeout=90), job.describe()
    ranks = {k: v for k, v in job.exits().items() if "trainer" in k}
    assert set(ranks.values()) == {"0"}, job.describe()
    # mpirun ends with its ranks; if it is still there when the agents see the job finished, they stop it
    # (as they stop pservers then), so its own exit code is 0 or its answer to that SIGTERM.
    for rank, jd in enumerate(job.jds):  # each rank on its own node, its output in its own log
        log = (jd / "logs" / f"trainer-{rank}.log").read_text()
        assert f"rank {rank} of 3: allreduce sum 6 (env rank {rank})" in log, job.describe()
        run = json.loads((jd / "run" / f"trainer-{rank}.json").read_text())
        assert run["rank"] == rank and run["name"] == f"trainer-{rank}"
    assert wait_for(lambda: not job.leftovers(), timeout=30), job.describe()
    kinds = {json.loads(line)["kind"] for jd in job.jds for line in (jd / "events.jsonl").read_text().splitlines()}
    assert "finished" in kinds and "job_failed" not in kinds


@pytest.mark.parametrize("victim", ["rank 1", "mpirun"])
def test_a_rank_or_mpirun_killed_ends_every_process_on_every_node(mpi_job, victim):
    job = mpi_job(300)
    programs = [job.program(rank) for rank in range(3)]
    assert any("orted" in cmd for _, cmd in job.leftovers()), job.describe()  # mpirun reached the nodes over ssh
    if victim == "mpirun":
        run = json.loads((job.jds[0] / "run" / "mpirun-0.json").read_text())
        pid = next(iter(procfs.children_map(procfs.scan()).get(run["pid"], ())))
    else:
        pid = programs[1]
    os.kill(pid, signal.SIGKILL)
    # The ranks, their launchers, mpirun, its ssh clients and Open MPI's daemons: all gone within 2 s.
    assert wait_for(lambda: not job.leftovers(agents=False), timeout=2, interval=0.02), job.describe()
    assert wait_for(lambda: not job.leftovers(), timeout=30), job.describe()
    key = "ws-node1/mpirun-0.exit" if victim == "mpirun" else "ws-node2/trainer-1.exit"
    assert job.exits()[key] == "137"
    kinds = [json.loads(line)["kind"] for line in (job.jds[2] / "events.jsonl").read_text().splitlines()]
    assert "job_failed" in kinds  # the agents saw it too, on every node


def test_kill_all_leaves_nothing_of_an_mpirun_job(mpi_job):
    job = mpi_job(300)
    for rank in range(3):
        job.program(rank)
    out = job.fab("kill-all", "--grace", "1", cluster=job.path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert wait_for(lambda: not job.leftovers(), timeout=10), job.describe()


def daemon_of(job, rank):
    """Open MPI's daemon that started `rank` on its node, as the rank's run record names it."""
    starter = json.loads((job.jds[rank] / "run" / f"trainer-{rank}.json").read_text())["starter"]
    assert os.path.basename(procfs.cmdline(starter["pid"])[0]) == starter["command"] == "orted", starter
    return starter["pid"]


def events_of(jd):
    return [json.loads(line) for line in (jd / "events.jsonl").read_text().splitlines()]


def mpirun_pid(job):
    run = json.loads((job.jds[0] / "run" / "mpirun-0.json").read_text())
    return next(iter(procfs.children_map(procfs.scan()).get(run["pid"], ())))


# mpirun crashed (SIGSEGV in PMIx_Finalize) in its own abort once; SIGKILL of mpirun is in the test above.
@pytest.mark.parametrize("mpirun_dies", [None, signal.SIGSEGV], ids=["mpirun-aborts", "mpirun-SEGV-mid-abort"])
def test_a_daemon_that_does_not_leave_when_a_rank_fails_is_ended_by_its_nodes_agent(mpi_job, mpirun_dies):
    """Open MPI's daemons leave when mpirun ends, unless they cannot hear it (here: stopped; in CI, once
    mpirun crashed in its own abort and node2's daemon stayed). They carry no job marker: the agent
    knows the one that started its ranks from their run records, and ends it once the job has ended,
    however mpirun ended."""
    job = mpi_job(300)
    programs = [job.program(rank) for rank in range(3)]
    mpirun, daemon = mpirun_pid(job), daemon_of(job, 2)
    os.kill(daemon, signal.SIGSTOP)  # node3's daemon can neither stop rank 2 nor leave
    os.kill(programs[1], signal.SIGKILL)
    if mpirun_dies:  # while its abort runs: once it has begun to take the other ranks down
        wait_for(lambda: not procfs.alive(programs[0]), timeout=5, interval=0.005)
        try:
            os.kill(mpirun, mpirun_dies)
        except ProcessLookupError:  # its abort was quicker (a loaded machine): the daemon is left all the same
            pass
    assert wait_for(lambda: not job.leftovers(agents=False), timeout=10, interval=0.05), job.describe()
    # The agent ends the daemon STARTER_WAIT after both its rank's end and the job's, at its next step: after
    # the ranks are gone, never before (seen on a loaded machine: still alive the moment they were).
    assert wait_for(lambda: procfs.stat(daemon) is None or procfs.stat(daemon).dead, timeout=10), job.describe()
    orphans = [e for e in events_of(job.jds[2]) if e["kind"] == "orphan"]
    assert any(f"Open MPI's daemon (pid {daemon}), which started trainer-2 here, outlived the job" in e["reason"]
               for e in orphans), job.describe()
    assert wait_for(lambda: not job.leftovers(), timeout=30), job.describe()


def test_kill_all_ends_a_daemon_that_does_not_leave_even_without_the_agents(mpi_job):
    job = mpi_job(300)
    for rank in range(3):
        job.program(rank)
    daemon = daemon_of(job, 1)
    agent = json.loads((job.jds[1] / "run" / "agent.json").read_text())["pid"]
    for pid in (daemon, agent):  # node2's agent cannot help, and its daemon cannot leave
        os.kill(pid, signal.SIGSTOP)
    out = job.fab("kill-all", "--grace", "1", cluster=job.path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert procfs.stat(daemon) is None or procfs.stat(daemon).dead, job.describe()  # when kill-all returns
    killed = [e for e in events_of(job.jds[1]) if e["kind"] == "killed" and e["name"] == "trainer-1" and "pids" in e]
    assert killed and daemon in killed[0]["pids"], killed  # the rank itself: kill-all's, or the woken agent's
    assert f"Open MPI's daemon that started it here, pid {daemon}" in killed[0]["reason"]
    assert wait_for(lambda: not job.leftovers(), timeout=30), job.describe()
