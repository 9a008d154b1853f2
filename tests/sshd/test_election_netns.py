"""A majority election under partitions (docs/partitions.md, "Majority election"): three sshd nodes in network
namespaces (tests/support/netns.py), a job that elects (min_nodes, three trainer nodes), real agents and
processes. What must hold in each case: the lost node's programs are gone (its agent saw them end, /proc has
them no more) before the smaller world starts; one coordinator a term (the `coordinator ... now on` events);
the generations only increase; and the job's end leaves nothing (`fab kill-all`).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from fabtrain.contract.launcher import DEADMAN, FENCES_ITSELF
from fabtrain.node import launch, procfs
from fabtrain.node.coordination import fence
from tests.support.netns import net, root  # noqa: F401 (the module fixtures)
from tests.support.partition_job import GRACE, INTERVAL, MASTER_PORT, NODES, PartitionJob, stopped_at
from tests.support.procscan import group, wait_for

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

STOP_BOUND = fence.stop_bound(INTERVAL, GRACE)
# From the cut to the smaller world: the lease and its margin, the candidacy's stagger, the fence wait
# from the election, the backoff, a cold start.
NEW_WORLD = fence.fence_after(INTERVAL) + 1 + 2 + fence.fence_wait(INTERVAL, GRACE) + 1 + 30
# From a heal to the old coordinator's node following the new one: a candidacy a lease (fence_after), its pre-vote's
# second, then its link's connection and first beat.
LEARN = 2 * fence.fence_after(INTERVAL) + 1 + 5


def electing(fab, root, net) -> PartitionJob:
    return PartitionJob(fab, root, net, on_failure="restart", restart_backoff=1, max_restarts=3, min_nodes=2,
                        max_rejoins=0)


def moves(job) -> list[str]:
    """Every election won, on any node: `coordinator now on X (term t), after Y`."""
    return [e["reason"] for n in NODES for e in job.events(n, "coordinator") if " now on " in e["reason"]]


def learned(job) -> list[str]:
    """What node1, the old coordinator, learned from a refused vote (agent/elect.py)."""
    return [e["reason"] for e in job.events("node1", "coordinator") if " learned " in e["reason"]]


def generations(job, node) -> list[int]:
    return [e.get("generation") for e in job.events(node, "restarted")]


def check_new_world(job, lost: str, kept: tuple) -> float:
    """The survivors run generation 1 without `lost` on a port of its own; `lost`'s trainer ended before it
    started. The new world's start (epoch)."""
    new = [job.run_record(n, f"trainer-{NODES.index(n)}") for n in kept]
    started = min(r["started_at"] for r in new)
    # The launcher names its program the moment it forks it: /proc shows the program's own environment once
    # it has exec'd (until then, the launcher's). A CI run read it in between.
    pid = new[0]["program_pid"]
    assert wait_for(lambda: b"MASTER_PORT" in procfs.environ(pid), timeout=10), (pid, procfs.stat(pid), job.describe())
    env = {k.decode(): v.decode() for k, v in procfs.environ(pid).items()}
    assert (env["MASTER_PORT"], env["WORLD_SIZE"], env["FABTRAIN_RESTART_COUNT"]) == (
        str(MASTER_PORT + 1), "2", "1"), env
    name = f"trainer-{NODES.index(lost)}"
    assert wait_for(lambda: stopped_at(job, lost, name), timeout=STOP_BOUND + 5), job.describe()
    gone = stopped_at(job, lost, name)
    assert gone < started, f"{lost}'s trainer ended {gone - started:.2f} s after generation 1 started"
    return started


def test_the_first_node_cut_off_alone_node2_coordinates_term_2_and_the_job_goes_on_without_it(fab, root, net):
    job = electing(fab, root, net)
    try:
        old_pid = job.run_record("node1", "trainer-0")["program_pid"]
        net.cut("node1", "drop")
        assert wait_for(lambda: job.events("node2", "restarted") and job.events("node3", "restarted"),
                        timeout=NEW_WORLD), job.describe()
        check_new_world(job, "node1", ("node2", "node3"))
        assert procfs.stat(old_pid) is None
        # node1's coordinator stepped down (its lease: 1 of 3) and its node fenced itself.
        assert any("steps down" in e["reason"] for e in job.events("node1", "coordinator")), job.describe()
        assert any("steps down" in e["reason"] for e in job.events("node1", "peer_lost")), job.describe()
        # One election, one coordinator a term; generation 1 only, once a node.
        assert moves(job) == ["coordinator now on node2 (term 2), after node1"], moves(job)
        assert generations(job, "node2") == generations(job, "node3") == [1]
        (left,) = job.events("node2", "node_left")
        assert left["peer"] == "node1" and left["world_size"] == 2, left
        assert wait_for(lambda: (job.health("node3").get("coordinator") or {}).get("node") == "node2", timeout=10)
        assert job.health("node3")["coordinator"]["term"] == 2
        assert wait_for(lambda: job.health("node2")["job"]["status"] == "running", timeout=4 * INTERVAL + 5), \
            job.health("node2")["job"]
        status = job.fab("status")
        assert "coordinator now on node2 (term 2)" in status.stdout, status.stdout
    finally:
        job.end()


def test_the_first_node_cut_from_node2_only_keeps_its_term_and_node2_leaves(fab, root, net):
    job = electing(fab, root, net)
    try:
        net.cut("node1", "peer", peer="node2")  # node3 still reaches both
        assert wait_for(lambda: job.events("node1", "restarted") and job.events("node3", "restarted"),
                        timeout=NEW_WORLD), job.describe()
        check_new_world(job, "node2", ("node1", "node3"))
        # node1 hears node3: 2 of 3, it keeps term 1; node3 refused node2's candidacy; nobody was elected.
        assert moves(job) == [], moves(job)
        assert not any("steps down" in e["reason"] for e in job.events("node1", "coordinator")), job.describe()
        assert generations(job, "node1") == generations(job, "node3") == [1]
        (left,) = job.events("node1", "node_left")
        assert left["peer"] == "node2" and left["world_size"] == 2, left
        net.heal("node2")
        net.heal("node1")
        time.sleep(3 * INTERVAL)
        assert not job.events("node2", "restarted"), job.describe()
        assert moves(job) == [] and (job.health("node3").get("coordinator") or {}).get("node") == "node1"
    finally:
        job.end()


def test_a_heal_in_the_middle_of_the_restart_leaves_node1_out_and_one_coordinator_a_term(fab, root, net):
    job = electing(fab, root, net)
    try:
        net.cut("node1", "drop")
        assert wait_for(lambda: moves(job), timeout=NEW_WORLD), job.describe()
        assert not job.events("node2", "restarted"), "healed too late: generation 1 had started"
        net.heal("node1")  # during generation 1's backoff (its fence wait from the election)
        assert wait_for(lambda: job.events("node2", "restarted") and job.events("node3", "restarted"),
                        timeout=NEW_WORLD), job.describe()
        check_new_world(job, "node1", ("node2", "node3"))
        # node1, healed, is refused a vote (node2 and node3 follow node2 within its lease): the refusal names term 2
        # and node2, node1 beats node2, and with max_rejoins 0 it is fenced out for good. One election.
        assert wait_for(lambda: job.events("node1", "fenced"), timeout=LEARN), job.describe()
        assert learned(job) == ["node1 learned from a refused vote: coordinator node2 (term 2)"], learned(job)
        assert moves(job) == ["coordinator now on node2 (term 2), after node1"], moves(job)
        assert generations(job, "node2") == generations(job, "node3") == [1] and not job.events("node1", "restarted")
        assert wait_for(lambda: job.health("node2")["job"]["status"] == "running", timeout=4 * INTERVAL + 5)
    finally:
        job.end()


def test_the_old_coordinator_healed_learns_who_won_and_is_back_in_a_later_generation(fab, root, net):
    job = PartitionJob(fab, root, net, on_failure="restart", restart_backoff=1, max_restarts=3, min_nodes=2,
                       max_rejoins=1)
    try:
        net.cut("node1", "drop")
        assert wait_for(lambda: job.events("node2", "restarted") and job.events("node3", "restarted"),
                        timeout=NEW_WORLD), job.describe()
        check_new_world(job, "node1", ("node2", "node3"))
        net.heal("node1")
        # node1 (stepped down, fenced) stands in vain; the refusal names term 2 and node2: node1 takes up term 2,
        # beats node2 with nothing running and is taken into generation 2 (node_back), a world of 3 again.
        assert wait_for(lambda: job.events("node1", "restarted"), timeout=LEARN + 30), job.describe()
        assert learned(job) == ["node1 learned from a refused vote: coordinator node2 (term 2)"], learned(job)
        (back,) = job.events("node2", "node_back")
        assert back["peer"] == "node1" and back["reason"] == "node1 back in generation 2 (WORLD_SIZE 3)", back
        pid = job.run_record("node1", "trainer-0")["program_pid"]  # its own environment once it has exec'd
        assert wait_for(lambda: b"MASTER_PORT" in procfs.environ(pid), timeout=10), (pid, job.describe())
        env = {k.decode(): v.decode() for k, v in procfs.environ(pid).items()}
        assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["FABTRAIN_RESTART_COUNT"]) == (
            "0", "3", str(MASTER_PORT + 2), "2"), env
        # every node starts its part of generation 2 by itself: node1's can be on file before node2's or node3's
        assert wait_for(lambda: generations(job, "node2") == generations(job, "node3") == [1, 2], timeout=30), \
            (generations(job, "node2"), generations(job, "node3"), job.describe())
        assert generations(job, "node1") == [2]
        # one coordinator a term: node1 of term 1, node2 of term 2, and no election since
        assert moves(job) == ["coordinator now on node2 (term 2), after node1"], moves(job)
        assert (job.health("node1").get("coordinator") or {}).get("node") == "node2"
        assert job.health("node1")["coordinator"]["term"] == 2 and not job.events("node1", "fenced")
        # node1's own coordinator stepped down: its health says node2's hosts the job's, not its own
        assert [n for n in NODES if job.health(n)["coordinator"]["hosted_here"]] == ["node2"], \
            {n: job.health(n)["coordinator"] for n in NODES}
    finally:
        job.end()


def test_the_coordinators_agent_paused_and_resumed_steps_down_and_node2_coordinates_term_2(fab, root, net):
    """node1's agent stopped (SIGSTOP): nothing of it runs, but its trainer's launcher is the node's dead-man
    (node/launch.py, node/deadman.py): /proc has neither the trainer nor anything of its group before generation 1
    starts on node2 and node3, while the agent is still stopped. Resumed, the agent steps down and reports the
    fence (its launcher's `fenced` exit record): one election, one coordinator a term."""
    job = electing(fab, root, net)
    agent = int(job.run_record("node1", "agent").get("program_pid") or 0) or _agent_pid(job, "node1")
    try:
        paused_until_the_new_world(job, agent, "node1", ("node2", "node3"))
        os.kill(agent, signal.SIGCONT)
        # Resumed: its lease is long gone (the beats queued meanwhile echo lines from before the pause): it steps
        # down before it answers anything, and reports its node's fence, which its launchers did.
        assert wait_for(lambda: stopped_at(job, "node1", "trainer-0"), timeout=STOP_BOUND + 5), job.describe()
        (killed,) = [e for e in job.events("node1", "killed") if e.get("name") == "trainer-0"]
        assert DEADMAN in killed["reason"], killed
        assert wait_for(lambda: job.events("node1", "peer_lost"), timeout=10), job.describe()
        assert job.events("node1", "peer_lost")[0]["reason"].endswith(FENCES_ITSELF), job.events("node1", "peer_lost")
        assert wait_for(lambda: any("steps down" in e["reason"] for e in job.events("node1", "coordinator")),
                        timeout=10), job.describe()
        assert moves(job) == ["coordinator now on node2 (term 2), after node1"], moves(job)
        assert generations(job, "node2") == generations(job, "node3") == [1]
        assert not job.events("node1", "restarted")
    finally:
        resume(agent)
        job.end()


def test_a_paused_agent_on_node3_leaves_its_node_fenced_by_its_dead_man_and_nobody_is_elected(fab, root, net):
    """The commoner freeze: node3's agent stopped (SIGSTOP), its coordinator on node1 well. node1's coordinator
    loses node3 (no beat) and starts generation 1 on node1 and node2 only `fence_wait` after it last heard it;
    node3's trainer's launcher ends it by then (its dead-man's deadline counts from the same last answer).
    No election: node1 keeps its term. Resumed, node3's agent reports the fence its launcher did."""
    job = electing(fab, root, net)
    agent = int(job.run_record("node3", "agent").get("program_pid") or 0) or _agent_pid(job, "node3")
    try:
        paused_until_the_new_world(job, agent, "node3", ("node1", "node2"))
        (left,) = job.events("node1", "node_left")
        assert left["peer"] == "node3" and left["world_size"] == 2, left
        os.kill(agent, signal.SIGCONT)
        assert wait_for(lambda: [e for e in job.events("node3", "killed") if e.get("name") == "trainer-2"],
                        timeout=10), job.describe()
        (killed,) = [e for e in job.events("node3", "killed") if e.get("name") == "trainer-2"]
        assert DEADMAN in killed["reason"], killed
        assert moves(job) == [] and generations(job, "node1") == generations(job, "node2") == [1], job.describe()
        assert not job.events("node3", "restarted")
    finally:
        resume(agent)
        job.end()


def resume(agent: int) -> None:
    """SIGCONT for a test's paused agent on its way out; resumed earlier, it may have left already."""
    try:
        os.kill(agent, signal.SIGCONT)
    except ProcessLookupError:
        pass


def paused_until_the_new_world(job, agent: int, node: str, kept: tuple) -> None:
    """SIGSTOP `node`'s agent until `kept` run generation 1; meanwhile its trainer and the trainer's launcher's
    group are gone from /proc before that generation started, the agent never ran, and the exit record says
    `fenced` (its launcher's dead-man ended it: node/launch.py, node/deadman.py). The agent stays stopped."""
    name = f"trainer-{NODES.index(node)}"
    trainer = job.run_record(node, name)
    pid, launcher = trainer["program_pid"], trainer["pid"]  # the launcher leads the trainer's group
    seen = {}

    def new_world() -> bool:
        if "gone" not in seen and procfs.stat(pid) is None and not group(launcher):
            seen["gone"] = time.time()  # first seen gone: no earlier than it went
        return all(job.events(n, "restarted") for n in kept)

    os.kill(agent, signal.SIGSTOP)
    assert wait_for(new_world, timeout=NEW_WORLD), job.describe()
    started = min(job.run_record(n, f"trainer-{NODES.index(n)}")["started_at"] for n in kept)
    assert procfs.stat(agent).state in "tT", f"{node}'s agent ran meanwhile"
    assert "gone" in seen, f"{node}'s trainer (pid {pid}) or its group still ran when generation 1 started\n" \
        + job.describe()
    assert seen["gone"] < started, f"{node}'s trainer ended {seen['gone'] - started:.2f} s after generation 1"
    exit_record = str(job.jd(node) / "run" / f"{name}.exit")
    assert launch.read_exit_record(exit_record)[1], open(exit_record).read()  # `fenced`: the dead-man ended it


def _agent_pid(job, node) -> int:
    for pid in job.job_pids(node):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"fabtrain.node.agent" in f.read():
                    return pid
        except OSError:
            continue
    raise AssertionError(job.describe())
