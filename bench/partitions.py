"""What fabtrain does when a node's network is cut, and how long it takes: the figures of
docs/partitions.md's table.

Three sshd nodes, each in its own network namespace on a bridge (tests/support/netns.py), one
stand-in trainer a node (tests/programs/fakejob.py, collective mode), interval 1 s, grace 2 s. Each
scenario cuts one node as the world does, measures from the node's events and run records (one
machine, one clock), heals, and counts what of the job is left in every namespace once the agents
have ended (every process there but sshd's):

  plain      node3's link set down in a kill-job job
  min_nodes  every packet of node3 dropped (nft), min_nodes 2, restart_backoff 2 s; node3's trainer
             ignores SIGTERM (it takes the whole grace, as one that saves a checkpoint does)
  coord      every packet of node1 (the coordinator's node) dropped, kill-job
  loss       30 % of node3's packets dropped both ways (nft numgen) for 30 s: a false failure or not
  tcp_blocked  TCP to and from the coordinator's port dropped on node3, UDP not: how long the pulses keep it
             in the job, and what ends it
  one_way    what node3 sends dropped (nft, its output only), then, in a second job, what it receives
  hang_loss  30 % loss on node3 and its trainer stopped (SIGSTOP): a hang caught as one, or a lost node
  copy_cut   copy-data, then deploy, to node3 over a 1 mbit link set down mid-file; healed, each again
  controller the controller's packets to node2 dropped (nft in the root namespace): fab status, logs,
             watch, the dashboard's poll and fab kill-all against the job, which goes on; healed, the
             dashboard again and a second fab kill-all

The baseline each figure is held against, measured in the same run: the node's lease (its agent's
newest answered beat, health.json's coordinator.lease); the ratio is the stop's distance from the
lease against fence.stop_bound, the bound docs/partitions.md states. It prints; bench/record.py keeps
the output in bench/results/ with its header (commit, date, nproc, load), as for every bench:

    .venv/bin/python bench/record.py partitions-<commit> -- .venv/bin/python bench/partitions.py [--only SCENARIO ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, bench/ is sys.path[0], where bench/copy.py would shadow the stdlib's copy.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.record import loadavg  # noqa: E402
from fabtrain.config.cluster import load_cluster  # noqa: E402
from fabtrain.controller.collector import Collector  # noqa: E402
from fabtrain.dashboard import create_app  # noqa: E402
from fabtrain.node import procfs  # noqa: E402
from fabtrain.remote.session import Session  # noqa: E402
from fabtrain.node.coordination import fence  # noqa: E402
from tests.support import netns  # noqa: E402
from tests.support.netns import cut_mid_file, write_corpus, write_project_with_a_blob  # noqa: E402
from tests.support.sshd import write_cluster  # noqa: E402
from tests.support.partition_job import GRACE, INTERVAL, NODES, PartitionJob, stopped_at  # noqa: E402
from tests.support.procscan import wait_for  # noqa: E402

FAB = str(Path(sys.executable).parent / "fab")
BOUND = fence.stop_bound(INTERVAL, GRACE)


def runner(state: Path):
    def fab(*args, cluster, check=None, timeout=120):
        env = {**os.environ, "FABTRAIN_CLUSTER": str(cluster), "FABTRAIN_STATE_DIR": str(state)}
        out = subprocess.run([FAB, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if check is not None and (out.returncode == 0) != check:
            raise SystemExit(f"fab {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out
    return fab


def left_after_heal(job: PartitionJob, net, nodes=NODES) -> int:
    """Processes of the job in the namespaces of `nodes` once healed and their agents ended by themselves."""
    for n in NODES:
        net.heal(n)
    wait_for(lambda: not any(job.job_pids(n) for n in nodes), timeout=30)
    return sum(len(job.job_pids(n)) for n in nodes)


def env_of(pid) -> str | None:
    try:
        return {k.decode(): v.decode() for k, v in procfs.environ(pid).items()}.get("MASTER_PORT")
    except (OSError, TypeError, AttributeError):
        return None


def stop_line(job, node, name, cut) -> str:
    gone = stopped_at(job, node, name)
    lease = (job.health(node).get("coordinator") or {}).get("lease")
    if gone is None or lease is None:
        return f"{node}: {name} not seen stopped"
    return (f"{node}: {name} stopped {gone - cut:.2f} s after the cut, {gone - lease:.2f} s after its lease "
            f"(bound {BOUND:.0f} s: ratio {(gone - lease) / BOUND:.2f})")


def plain(fab, root, net, out) -> None:
    job = PartitionJob(fab, root, net)
    cut = net.cut("node3", "link")
    wait_for(lambda: job.events("node1", "job_failed") and stopped_at(job, "node3", "trainer-2"), timeout=BOUND + 10)
    failed = job.events("node1", "job_failed")
    out(f"plain: job failed {failed[0]['ts'] - cut:.2f} s after the cut: {failed[0]['reason'][:90]}"
        if failed else "plain: job not failed")
    out("plain: " + stop_line(job, "node3", "trainer-2", cut))
    out(f"plain: left running after heal: {left_after_heal(job, net)}; kill-all exit {job.fab('kill-all').returncode}")


def min_nodes(fab, root, net, out) -> None:
    job = PartitionJob(fab, root, net, trainer_args="--ignore-term trainer-2", on_failure="restart",
                       restart_backoff=2, max_restarts=2, min_nodes=2)
    cut = net.cut("node3", "drop")
    wait_for(lambda: job.events("node1", "restarted") and job.events("node2", "restarted")
             and stopped_at(job, "node3", "trainer-2"), timeout=fence.fence_wait(INTERVAL, GRACE) + 20)
    left = job.events("node1", "node_left")
    out(f"min_nodes: node3 left {left[0]['ts'] - cut:.2f} s after the cut" if left else "min_nodes: no node_left")
    out("min_nodes: " + stop_line(job, "node3", "trainer-2", cut))
    new = min(job.run_record(n, f"trainer-{i}").get("started_at", 0) for i, n in ((0, "node1"), (1, "node2")))
    gone = stopped_at(job, "node3", "trainer-2") or float("nan")
    out(f"min_nodes: generation 1 started {new - cut:.2f} s after the cut, {new - gone:.2f} s after node3's "
        f"trainer stopped (fence_wait {fence.fence_wait(INTERVAL, GRACE):.0f} s)")
    time.sleep(1)
    out(f"min_nodes: left running on node3 after heal: {left_after_heal(job, net, ('node3',))}; "
        f"node3 restarted: {len(job.events('node3', 'restarted'))} times; "
        f"MASTER_PORT generation 1: {env_of(job.run_record('node1', 'trainer-0').get('program_pid'))} "
        f"(fenced refusals at the coordinator: {len(job.events('node1', 'fenced'))})")
    job.fab("kill-all", "--grace", "1")
    wait_for(lambda: not any(job.job_pids(n) for n in NODES), timeout=20)


def coordinator(fab, root, net, out) -> None:
    job = PartitionJob(fab, root, net)
    cut = net.cut("node1", "drop")
    wait_for(lambda: all(stopped_at(job, n, f"trainer-{i}") for i, n in enumerate(NODES)), timeout=BOUND + 10)
    gone = stopped_at(job, "node1", "trainer-0")
    out(f"coord: node1: trainer-0 stopped {gone - cut:.2f} s after the cut (the coordinator lost both others: "
        f"the job failed there; node1 itself still reached its own coordinator)" if gone else "coord: node1 not stopped")
    for i, n in ((1, "node2"), (2, "node3")):
        out("coord: " + stop_line(job, n, f"trainer-{i}", cut))
    out(f"coord: left running after heal: {left_after_heal(job, net)}; kill-all exit {job.fab('kill-all').returncode}")


def lossy(fab, root, net, out, seconds=30.0) -> None:
    """30 % of node3's packets dropped, both ways, for `seconds`: a false failure, or none."""
    job = PartitionJob(fab, root, net)
    pulses = (job.health("node3").get("coordinator") or {}).get("pulses", 0)
    net.cut("node3", "loss", 30)
    t0 = time.time()
    # A failure decided anywhere: the coordinator's (node1) or a node that fenced itself (node3's agent).
    wait_for(lambda: any(job.events(n, "job_failed") for n in NODES), timeout=seconds)
    failed = sorted((e for n in NODES for e in job.events(n, "job_failed")), key=lambda e: e["ts"])
    out(f"loss: 30 % both ways on node3 for {seconds:.0f} s: " + (
        f"job failed {failed[0]['ts'] - t0:.1f} s in, on {failed[0].get('node')}: {failed[0]['reason'][:100]}"
        if failed else "no failure") + "; node3's pulses answered meanwhile: %s" % (
        (job.health("node3").get("coordinator") or {}).get("pulses", 0) - pulses))
    net.heal("node3")
    job.fab("kill-all", "--grace", "1")
    wait_for(lambda: not any(job.job_pids(n) for n in NODES), timeout=20)


def tcp_blocked(fab, root, net, out, hold=40.0) -> None:
    """node3's TCP to and from the coordinator's port dropped, its datagrams not: the beats' connection cannot be
    kept, the pulses get through. How long the job goes on so, and what ends it (hung_timeout without a beat)."""
    job = PartitionJob(fab, root, net)
    cut = net.cut("node3", "tcp-port", port=7180)
    wait_for(lambda: any(job.events(n, "job_failed") for n in NODES), timeout=hold)
    failed = sorted((e for n in NODES for e in job.events(n, "job_failed")), key=lambda e: e["ts"])
    pulses = (job.health("node3").get("coordinator") or {}).get("pulses", 0)
    out(f"tcp_blocked: TCP to the coordinator's port dropped on node3 for up to {hold:.0f} s: " + (
        f"job failed {failed[0]['ts'] - cut:.2f} s after the cut, on {failed[0].get('node')}: {failed[0]['reason'][:140]}"
        if failed else "no failure") + f"; node3's pulses answered: {pulses}")
    wait_for(lambda: stopped_at(job, "node3", "trainer-2"), timeout=BOUND + 5)
    gone, lease = stopped_at(job, "node3", "trainer-2"), (job.health("node3").get("coordinator") or {}).get("lease")
    out(f"tcp_blocked: node3: trainer-2 stopped {gone - cut:.2f} s after the cut, {gone - lease:.2f} s after its lease "
        f"(bound {BOUND:.0f} s: ratio {(gone - lease) / BOUND:.2f})" if gone and lease else
        "tcp_blocked: node3's trainer-2 not seen stopped")
    out(f"tcp_blocked: left running after heal: {left_after_heal(job, net)}; kill-all exit {job.fab('kill-all').returncode}")


def one_way(fab, root, net, out) -> None:
    """node3's outgoing packets dropped, then (a second job) its incoming ones: TCP gets no answer either way."""
    for how, what in (("drop-out", "what node3 sends"), ("drop-in", "what node3 receives")):
        job = PartitionJob(fab, root, net)
        cut = net.cut("node3", how)
        wait_for(lambda: job.events("node1", "job_failed") and stopped_at(job, "node3", "trainer-2"),
                 timeout=BOUND + 10)
        failed = job.events("node1", "job_failed")
        out(f"one_way ({how}: {what} dropped): " + (f"job failed {failed[0]['ts'] - cut:.2f} s after the cut: "
                                                  f"{failed[0]['reason'][:90]}" if failed else "job not failed"))
        out(f"one_way ({how}): " + stop_line(job, "node3", "trainer-2", cut))
        out(f"one_way ({how}): left running after heal: {left_after_heal(job, net)}; "
            f"kill-all exit {job.fab('kill-all').returncode}")


def hang_under_loss(fab, root, net, out, hang_timeout=6, lossy_for=10.0) -> None:
    """30 % loss on node3, then its trainer stopped (SIGSTOP) under the loss: caught as a hang, or taken for a lost node."""
    job = PartitionJob(fab, root, net, hang_timeout=hang_timeout)
    net.cut("node3", "loss", 30)
    time.sleep(lossy_for)
    before = sum(len(job.events(n, "peer_lost")) + len(job.events(n, "job_failed")) for n in NODES)
    pid = job.run_record("node3", "trainer-2")["program_pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    wait_for(lambda: job.events("node1", "job_failed") and stopped_at(job, "node3", "trainer-2"),
             timeout=hang_timeout + 4 * fence.peer_timeout(INTERVAL))
    hang = job.events("node3", "hang")
    failed = job.events("node1", "job_failed")
    out(f"hang_loss: 30 % both ways on node3 for {lossy_for:.0f} s: {before} peer_lost or job_failed events; "
        f"then node3's trainer stopped (SIGSTOP), the loss still on")
    out(f"hang_loss: hang caught {hang[0]['ts'] - stopped:.2f} s after the SIGSTOP (hang_timeout {hang_timeout} s)"
        if hang else "hang_loss: no hang event on node3")
    out(f"hang_loss: job failed {failed[0]['ts'] - stopped:.2f} s after the SIGSTOP: {failed[0]['reason'][:90]}"
        if failed else "hang_loss: job not failed")
    gone = stopped_at(job, "node3", "trainer-2")
    out(f"hang_loss: node3: trainer-2 stopped {gone - stopped:.2f} s after the SIGSTOP; peer_lost events: "
        f"{sum(len(job.events(n, 'peer_lost')) for n in NODES)}" if gone else "hang_loss: node3's trainer not stopped")
    out(f"hang_loss: left running after heal: {left_after_heal(job, net)}; kill-all exit {job.fab('kill-all').returncode}")


def controller(fab, root, net, out) -> None:
    """The controller's packets to node2 dropped (the laptop off the VPN for it; the nodes still reach each other)."""
    job = PartitionJob(fab, root, net)
    pid = job.run_record("node2", "trainer-1")["program_pid"]

    def timed(*args):
        t0 = time.monotonic()
        said = job.fab(*args, timeout=120)
        text = said.stdout + said.stderr
        named = next((line.strip() for line in text.splitlines() if "node2" in line), "node2 not named")
        return f"{time.monotonic() - t0:.2f} s, exit {said.returncode}: {named[:130]}"

    session = Session(load_cluster(str(job.path)))
    collector = Collector(session, job_id=job.job_id)
    token = "bench-token-0123456789abcdef0123456789"
    dashboard = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": token, "ALLOWED_HOSTS": ["127.0.0.1:8265"],
                            "TESTING": True}).test_client()

    def polled() -> str:
        """The dashboard's collector polls once; what its /api/cluster then says of node2."""
        t0 = time.monotonic()
        collector.poll()
        took = time.monotonic() - t0
        nodes = {n["name"]: n for n in dashboard.get("/api/cluster", headers={
            "Authorization": f"Bearer {token}", "Host": "127.0.0.1:8265"}).get_json()["nodes"]}
        return "poll %.2f s; node2 up %s (%s); node1 up %s, node3 up %s" % (
            took, nodes["node2"]["up"], nodes["node2"].get("down") or "-", nodes["node1"]["up"], nodes["node3"]["up"])

    net.cut("node2", "controller")
    out(f"controller: fab status {timed('status')}")
    out(f"controller: fab logs {timed('logs')}")
    out(f"controller: fab watch --timeout 4 {timed('watch', '--timeout', '4')}")
    out(f"controller: dashboard {polled()}")
    untouched = not any(job.events(n, "job_failed") for n in NODES) and pid in job.job_pids("node2")
    out(f"controller: the job untouched after them: {'yes' if untouched else 'no'}")
    killed = time.time()
    out(f"controller: fab kill-all --grace 1 {timed('kill-all', '--grace', '1')}")
    # node2 is left to its agent, whose coordinator went with kill-all on node1: it fences itself.
    wait_for(lambda: stopped_at(job, "node2", "trainer-1"), timeout=BOUND + 10)
    gone = stopped_at(job, "node2", "trainer-1")
    out(f"controller: node2's trainer-1 stopped {gone - killed:.2f} s after kill-all began (its agent fenced itself)"
        if gone else "controller: node2's trainer-1 not seen stopped")
    net.heal("node2")
    out(f"controller: healed: dashboard {polled()}")
    session.close()
    out("controller: left running after heal, before the second kill-all: "
        + ", ".join(f"{n} {len(job.job_pids(n))}" for n in NODES))
    out(f"controller: healed: fab kill-all --grace 1 {timed('kill-all', '--grace', '1')}")
    wait_for(lambda: not any(job.job_pids(n) for n in NODES), timeout=20)
    out(f"controller: left running after the second kill-all: {sum(len(job.job_pids(n)) for n in NODES)}")


def failure_line(said: str) -> str:
    """The line of a fab task's output that says node3 failed (not its progress lines)."""
    lines = [line.strip() for line in said.splitlines() if "node3" in line]
    return next((line for line in lines if "FAILED" in line or "failed" in line), lines[-1] if lines else "node3 not named")


def copy_cut(fab, root, net, out) -> None:
    """copy-data, then deploy, to node3 over a capped link (tbf 1 mbit; copy-data also 5 % loss) set down
    mid-file: how soon each ends and names node3, whether a half-written file is under its name, and the
    next run once healed (every shard verified; the file shipped whole)."""
    import hashlib

    folder = root / "copy"
    folder.mkdir()
    corpus = write_corpus(folder / "corpus.txt")
    blob = write_project_with_a_blob(folder / "project")
    path = write_cluster(folder / "c.yaml", net, ssh_nodes=[(n, ["trainer"]) for n in NODES],
                         job={"mode": "collective", "code": "project", "trainer": {"command": "true"},
                              "data": {"dir": str(folder / "prepared"), "input": str(corpus)},
                              "watchdog": {"enabled": False}})
    env = {**os.environ, "FABTRAIN_CLUSTER": str(path), "FABTRAIN_STATE_DIR": str(folder / "state")}
    fab("split-data", cluster=path, check=True)
    data = folder / "ws-node3" / "data"
    net.cap("node3", "1mbit")
    net.cut("node3", "loss", 5)
    try:
        proc, said, took = cut_mid_file(net, [FAB, "copy-data"], env, data, ".train.txt-")
    finally:
        net.heal("node3")
    named = failure_line(said)
    out(f"copy_cut: copy-data ended {took:.2f} s after the cut, exit {proc.returncode}: {named[:120]}; "
        f"a half-written shard under its name: {'yes' if (data / 'train.txt-00002').exists() else 'no'}")
    manifest = json.loads((folder / "prepared" / "MANIFEST.json").read_text())
    t0 = time.monotonic()
    again = fab("copy-data", cluster=path)
    whole = all(hashlib.sha256((folder / f"ws-{n}" / "data" / f"train.txt-{i:05d}").read_bytes()).hexdigest()
                == manifest["files"][f"train.txt-{i:05d}"]["sha256"] for i, n in enumerate(NODES))
    out(f"copy_cut: healed: copy-data {time.monotonic() - t0:.2f} s, exit {again.returncode}, every shard's sha256 "
        f"as the manifest says: {'yes' if whole else 'no'}; "
        + next((line.strip()[:100] for line in again.stdout.splitlines() if line.startswith("node3:")), "node3 silent"))
    ws3 = folder / "ws-node3"
    net.cap("node3", "1mbit")
    try:
        proc, said, took = cut_mid_file(net, [FAB, "deploy"], env, ws3, ".weights.bin.")
    finally:
        net.heal("node3")
    named = failure_line(said)
    half = any(p.read_bytes() != blob for p in ws3.rglob("weights.bin"))
    out(f"copy_cut: deploy ended {took:.2f} s after the cut, exit {proc.returncode}: {named[:120]}; "
        f"a half-written file under its name: {'yes' if half else 'no'}")
    t0 = time.monotonic()
    again = fab("deploy", cluster=path)
    shipped = [p for p in ws3.rglob("weights.bin") if "code" in p.parts]
    whole = bool(shipped) and all(p.read_bytes() == blob for p in shipped)
    out(f"copy_cut: healed: deploy {time.monotonic() - t0:.2f} s, exit {again.returncode}, the file whole: "
        f"{'yes' if whole else 'no'}")


SCENARIOS = {"plain": plain, "min_nodes": min_nodes, "coord": coordinator, "loss": lossy, "tcp_blocked": tcp_blocked, "one_way": one_way,
             "hang_loss": hang_under_loss, "controller": controller, "copy_cut": copy_cut}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=SCENARIOS, metavar="SCENARIO",
                    help=f"run only these, in this order (of: {', '.join(SCENARIOS)})")
    args = ap.parse_args()
    why = netns.available()
    if why:
        print(f"partitions: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        def out(line: str) -> None:
            print(line, flush=True)
        out(f"load average before: {loadavg()}; stop bound {BOUND:.0f} s, fence_wait "
            f"{fence.fence_wait(INTERVAL, GRACE):.0f} s, peer_timeout {fence.peer_timeout(INTERVAL):.0f} s")
        net = netns.NetnsCluster(Path(tmp) / "net", len(NODES))
        try:
            fab = runner(Path(tmp) / "state")
            (Path(tmp) / "jobs").mkdir()
            for name in args.only or SCENARIOS:
                SCENARIOS[name](fab, Path(tmp) / "jobs", net, out)
        finally:
            net.close()
        out(f"load average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
