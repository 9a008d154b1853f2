"""The pod entrypoint of `fab export --k8s` (fabtrain.node.pod), run for real.

No Kubernetes here: each "pod" is a local process started as the rendered
container command starts it (its index in JOB_COMPLETION_INDEX, its part made
from the rendered Secret's one job spec), with pod i's address 127.0.0.<i+1>
(each its own address, as pods have). The job ends, fails and stops as it would in pods: the exit codes
are what Kubernetes would see, /proc says what is left.
"""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import yaml

from fabtrain.config.cluster import parse_cluster
from fabtrain.controller.kubeexport import manifest_text
from fabtrain.plan import kubernetes
from fabtrain.plan.plan import make_plan
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port

from tests.support import REPO
pytestmark = pytest.mark.timeout(180)


JOB_ID = "20261124-000000-abcd"


def cluster_doc(command: str, count: int = 2, watchdog: dict | None = None, job: dict | None = None,
                roles: list | None = None) -> dict:
    roles = roles or [["trainer"]] * count
    return {"cluster": {"name": "lab"},
            "nodes": [{"name": f"n{i}", "host": f"10.0.0.{i}", "roles": r} for i, r in enumerate(roles)],
            "job": {"mode": "collective", "image": "lab/train:1", "master_port": free_port(["127.0.0.1"]),
                    "trainer": {"command": command},
                    "watchdog": {"port": free_port(["127.0.0.1"]), "interval": 0.2, "grace": 1, **(watchdog or {})},
                    **(job or {})}}


def local_manifests(root: Path, doc: dict):
    """(plan, manifests) of the job, with pod i at 127.0.0.<i+1> and its own workspace under root."""
    cluster = parse_cluster(doc, "cluster.yaml")
    pods = kubernetes.pod_cluster(cluster, JOB_ID)
    # The pods' DNS names, and the pods' own file systems, on this machine.
    pods = replace(pods, nodes=tuple(replace(n, address=f"127.0.0.{i + 1}", workspace=str(root / f"ws-{n.name}"))
                                     for i, n in enumerate(pods.nodes)))
    plan = make_plan(pods, JOB_ID, secret="00112233445566778899aabbccddeeff", network=kubernetes.pod_network(pods))
    roles = [n.processes[0].role for n in plan.nodes]
    # Each role's pods are consecutive: role pod k is plan node first[role] + k, at 127.0.0.<first + k + 1>.
    first = {role: roles.index(role) for role in roles}
    assert all(roles[first[r]:first[r] + roles.count(r)] == [r] * roles.count(r) for r in first), roles
    return plan, kubernetes.manifests(plan, kubernetes.pod_spec(cluster),
                                      pods={r: {"count": roles.count(r), "address": ["127.0.0.", first[r] + 1, ""]}
                                            for r in first})


class Pods:
    """A rendered job's pods (every Indexed Job's) as local processes."""

    def __init__(self, root: Path, command: str, count: int = 2, watchdog: dict | None = None,
                 job: dict | None = None, roles: list | None = None):
        plan, docs = local_manifests(root, cluster_doc(command, count, watchdog, job, roles))
        self.files = root / "etc-fabtrain"
        self.files.mkdir(mode=0o700)
        for name, text in docs[0]["stringData"].items():  # job.json (the job spec) and secret
            (self.files / name).write_text(text)
        commands = {d["metadata"]["labels"][f"{kubernetes.LABEL}/role"]: d["spec"]["template"]["spec"]["containers"][0]["command"]
                    for d in docs if d["kind"] == "Job"}
        # Each pod: its Job's container command and its completion index among that Job's pods.
        self.pods = [(commands[n.processes[0].role], sum(m.processes[0].role == n.processes[0].role
                                                         for m in plan.nodes[:i]))
                     for i, n in enumerate(plan.nodes)]
        self.workspaces = [root / f"ws-{n.node}" for n in plan.nodes]
        self.jds = [w / "jobs" / plan.job_id for w in self.workspaces]
        self.procs = [self.start_pod(i) for i in range(len(self.pods))]
        self.replaced: list[subprocess.Popen] = []

    def start_pod(self, i: int) -> subprocess.Popen:
        """Pod i's container, as the kubelet starts it (again, for a pod that replaces an evicted one)."""
        command, index = self.pods[i]
        return subprocess.Popen([self.files if a == kubernetes.JOB_FILES else a for a in command], cwd=REPO,
                                env={**os.environ, "JOB_COMPLETION_INDEX": str(index)}, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def exits(self, timeout: float = 60) -> list[int | None]:
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def program(self, pod: int, name: str) -> int:
        run = self.jds[pod] / "run" / f"{name}.json"
        assert wait_for(lambda: run.exists() and "program_pid" in json.loads(run.read_text()), timeout=30), \
            self.describe()
        return json.loads(run.read_text())["program_pid"]

    def left(self) -> list:
        return live_marked(self.workspaces)

    def describe(self) -> str:
        out = []
        for p in self.procs:
            if p.poll() is not None:
                out.append(p.stdout.read())
        for jd in self.jds:
            out += [f"--- {f}\n{f.read_text()[-1500:]}" for f in sorted(jd.glob("logs/*.log"))]
            events = jd / "events.jsonl"
            out.append(events.read_text() if events.exists() else "(no events)")
        return "\n".join(out)

    def events(self, pod: int) -> list[dict]:
        path = self.jds[pod] / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []

    def close(self) -> None:
        for p in self.procs + self.replaced:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for pid, _ in self.left():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pods(tmp_path):
    started = []

    def start(command: str, count: int = 2, **settings) -> Pods:
        started.append(Pods(tmp_path, command, count, **settings))
        return started[-1]

    yield start
    for p in started:
        p.close()


def test_pods_of_a_job_that_finishes_exit_0_and_leave_nothing(pods):
    job = pods("python3 -c 'import time; time.sleep(1)'")
    assert job.exits() == [0, 0], job.describe()
    assert not job.left()


def test_a_rank_killed_in_one_pod_fails_every_pod_and_leaves_nothing(pods):
    job = pods("python3 tests/programs/ticker.py")
    victim = job.program(1, "trainer-1")
    job.program(0, "trainer-0")
    os.kill(victim, signal.SIGKILL)
    # The agents tear the whole job down; every pod exits non-zero, so each Job (backoffLimit 0) fails.
    codes = job.exits()
    assert None not in codes and all(c != 0 for c in codes), (codes, job.describe())
    assert not job.left()
    kinds = [json.loads(line)["kind"] for line in (job.jds[0] / "events.jsonl").read_text().splitlines()]
    assert "job_failed" in kinds and "teardown" in kinds, kinds


def test_pods_told_to_stop_stop_their_processes_and_exit_143(pods):
    job = pods("python3 tests/programs/ticker.py")
    for pod in (0, 1):
        job.program(pod, f"trainer-{pod}")
    # Its first line written before the kubelet's SIGTERM: a started pid alone may not have printed yet.
    log = job.jds[1] / "logs" / "trainer-1.log"
    assert wait_for(lambda: log.is_file() and "trainer 1 started" in log.read_text(), timeout=30), job.describe()
    for p in job.procs:  # what the kubelet does when the Job is deleted
        p.send_signal(signal.SIGTERM)
    assert job.exits() == [143, 143], job.describe()
    assert not job.left()
    # Every process's log went to the pod's stdout, prefixed: what `kubectl logs` shows.
    assert "[trainer-1 trainer-1] trainer 1 started" in job.procs[1].stdout.read()


def test_a_pserver_job_whose_trainers_finish_succeeds_in_every_pod_the_pservers_too(pods):
    # The agents stop the pservers once every trainer exited 0 (SIGTERM, 143): the job finished, so every pod
    # exits 0 (Succeeded), the pserver's too: its exit code is the agents' verdict, not its process's.
    job = pods("python3 -c 'import time; time.sleep(1)'", roles=[["pserver"], ["trainer"], ["trainer"]],
               job={"mode": "pserver", "pserver": {"command": "python3 tests/programs/ticker.py",
                                                   "port": free_port(["127.0.0.1"])}})
    assert job.exits() == [0, 0, 0], job.describe()
    assert (job.jds[0] / "run" / "pserver-0.exit").read_text().strip() == "143"  # stopped by the agents
    assert "finished" in [e["kind"] for e in job.events(0)]
    assert not job.left()


def restarted_once(job, first: int) -> bool:
    """Both pods run generation 1: pod 1's program says restart 1, pod 0's is not the program `first`."""
    env = job.workspaces[1] / "env-trainer-1.json"
    return env.exists() and json.loads(env.read_text())["env"].get("FABTRAIN_RESTART_COUNT") == "1" and \
        job.program(0, "trainer-0") != first


def test_an_evicted_pod_is_a_lost_node_that_restarts_the_job_never_a_kill_all(pods):
    job = pods("python3 tests/programs/ticker.py",
               watchdog={"on_failure": "restart", "restart_backoff": 1, "max_restarts": 2})
    first = job.program(0, "trainer-0")
    job.program(1, "trainer-1")
    job.procs[1].send_signal(signal.SIGTERM)  # the kubelet evicting the pod: no fabtrain stop marked it first
    assert job.procs[1].wait(timeout=30) == 143, job.describe()
    # Kubernetes makes a pod for the index again (a disruption is not the Job's failure): it joins the restart.
    job.replaced.append(job.procs[1])
    job.procs[1] = job.start_pod(1)

    assert wait_for(lambda: restarted_once(job, first), timeout=60), job.describe()
    said = [e for pod in (0, 1) for e in job.events(pod)]
    assert any(e["kind"] == "restarting" and "node trainer-1 evicted by Kubernetes" in e.get("reason", "")
               for e in said), said
    assert not [e for e in said if "kill-all" in json.dumps(e)], said
    assert [p.poll() for p in job.procs] == [None, None]  # generation 1 runs in both pods


@pytest.mark.parametrize("workspace", ["kept", "fresh"])
def test_a_pod_evicted_before_its_agent_could_say_so_is_still_a_lost_node_when_its_replacement_starts(pods, workspace):
    """The kubelet's SIGTERM can reach a pod whose agent cannot answer it (killed, or in its first moments before
    its handler is in): its replacement must not read as generation 0 going on, whether it starts on the evicted
    pod's workspace (which kept the eviction) or on a fresh one (an emptyDir: only the coordinator can tell)."""
    job = pods("python3 tests/programs/ticker.py",
               watchdog={"on_failure": "restart", "restart_backoff": 1, "max_restarts": 2})
    first = job.program(0, "trainer-0")
    job.program(1, "trainer-1")
    # Its keeper is up, and the coordinator has heard the pod's agent (it knows its part going on).
    assert wait_for(lambda: any(e["kind"] == "agent_started" for e in job.events(1)) and
                    "trainer-1" in (json.loads((job.jds[0] / "health.json").read_text()).get("peers") or {})
                    if (job.jds[0] / "health.json").exists() else False, timeout=30)
    agent = json.loads((job.jds[1] / "run" / "agent.json").read_text())["program_pid"]
    # The OOM killer takes the agent and the keeper that would restart it; then the kubelet evicts the pod.
    keeper = [int(pid) for pid in Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
              if b"if read line" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(keeper) == 1, keeper
    for pid in keeper + [agent]:
        os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not os.path.exists(f"/proc/{agent}") or
                    Path(f"/proc/{agent}/stat").read_text().split()[2] == "Z", timeout=10)
    job.procs[1].send_signal(signal.SIGTERM)
    assert job.procs[1].wait(timeout=30) == 143, job.describe()
    assert not [e for e in job.events(1) if e["kind"] in ("failure", "agent_stopped")], job.events(1)  # it said nothing
    if workspace == "fresh":
        job.workspaces[1].rename(job.workspaces[1].with_name("ws-of-the-evicted-pod"))
    job.replaced.append(job.procs[1])
    job.procs[1] = job.start_pod(1)

    assert wait_for(lambda: restarted_once(job, first), timeout=60), job.describe()
    said = [e for pod in (0, 1) for e in job.events(pod)]
    assert [e["generation"] for e in said if e["kind"] == "restarting"] == [1, 1], said  # once, on both pods
    why = "node trainer-1 evicted by Kubernetes" if workspace == "kept" else \
        "node trainer-1 lost: its part was started again while generation 0 ran there"
    assert any(e["kind"] == "restarting" and why in e["reason"] for e in said), said
    assert not (job.jds[1] / "disrupted.before").exists()  # said once: a later start of this pod says nothing again
    assert [p.poll() for p in job.procs] == [None, None]


@pytest.fixture
def kubectl(tmp_path):
    """tests/support/fake_kubectl.py as `kubectl`, first on PATH; its pods are stopped by pid at the end."""
    state, bin_dir = tmp_path / "kubectl-state", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f'#!/bin/sh\nexec {sys.executable} {REPO}/tests/support/fake_kubectl.py {state} "$@"\n')
    (bin_dir / "kubectl").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_KUBECTL_WORKDIR": str(REPO)}
    yield env, state
    for pid_file in (state / "pods").glob("*.pid"):
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_fab_status_logs_and_kill_all_reach_the_pods_through_kubectl(fab, tmp_path, kubectl):
    env, state = kubectl
    doc = cluster_doc("python3 tests/programs/ticker.py", 2) | {"kubernetes": {"namespace": "lab"}}
    plan, docs = local_manifests(tmp_path, doc)
    (tmp_path / "k8s").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "k8s" / f"{i:02d}.yaml").write_text(manifest_text(d))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(doc))
    subprocess.run(["kubectl", "--namespace", "lab", "apply", "-f", str(tmp_path / "k8s")], env={**os.environ, **env},
                   check=True, capture_output=True, timeout=60)
    workspaces = [tmp_path / f"ws-trainer-{i}" for i in range(2)]
    assert wait_for(lambda: all((w / "jobs" / JOB_ID / "run" / f"trainer-{i}.json").exists()
                                for i, w in enumerate(workspaces)), timeout=60)

    status = fab("status", cluster=cluster, env=env, check=True)
    assert f"job {JOB_ID}: 2 pods (kubectl)" in status.stdout
    assert all(f"lab-{JOB_ID}-trainer-{i}  trainer-{i}  running on local" in status.stdout for i in range(2)), status.stdout
    assert wait_for(lambda: "trainer-1 trainer-1] tick" in fab("logs", cluster=cluster, env=env).stdout, timeout=30)
    logs = fab("logs", "--lines", "100000", cluster=cluster, env=env, check=True)
    # kubectl's prefix (the pod), then the pod's own (its node and process).
    assert f"[pod/lab-{JOB_ID}-trainer-1/trainer] [trainer-1 trainer-1] trainer 1 started" in logs.stdout, logs.stdout

    killed = fab("kill-all", cluster=cluster, env=env, check=True)
    assert f'job.batch "lab-{JOB_ID}-trainer" deleted' in killed.stdout, killed.stdout
    assert not live_marked(workspaces)
    gone = fab("status", cluster=cluster, env=env)
    assert gone.returncode == 2 and "kubectl: no pods of cluster lab in namespace lab" in gone.stderr, gone.stderr
    calls = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    assert ["--namespace", "lab", "get", "pods", "-l", "fabtrain.io/cluster=lab", "-o", "json"] in calls
    assert all(c[:2] == ["--namespace", "lab"] for c in calls if c[0] != "run-pod")


def test_a_pod_whose_job_failed_reads_failed_in_fab_status(fab, tmp_path, kubectl):
    env, state = kubectl
    doc = cluster_doc("python3 -c 'import sys, time; time.sleep(0.5); sys.exit(3)'", 2) | {"kubernetes": {}}
    plan, docs = local_manifests(tmp_path, doc)
    (tmp_path / "k8s").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "k8s" / f"{i:02d}.yaml").write_text(manifest_text(d))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(doc))
    subprocess.run(["kubectl", "apply", "-f", str(tmp_path / "k8s")], env={**os.environ, **env}, check=True,
                   capture_output=True, timeout=60)
    assert wait_for(lambda: len(list((state / "pods").glob("*.exit"))) == 2, timeout=60)
    status = fab("status", cluster=cluster, env=env)
    assert status.returncode == 1 and "status: the job has failed pods" in status.stderr, (status.stdout, status.stderr)
    assert f"lab-{JOB_ID}-trainer-0  trainer-0  FAILED exited 1 (the job failed)" in status.stdout, status.stdout
