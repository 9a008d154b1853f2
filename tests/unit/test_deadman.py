"""The dead-man, its pure parts: the deadline an agent publishes (node/deadman.py), its file's text as the contract
writes it and the launcher reads it (contract/launcher.py, node/launch.py), the launcher's decision, the bound it
keeps (coordination/fence.py), the policy's report of it, and which jobs have one at all (the plan).
The launcher ending a real program: tests/local/test_deadman_local.py."""
from __future__ import annotations

import os

import pytest

from fabtrain.contract import launcher as contract
from fabtrain.contract.jobfolder import JobFolder
from fabtrain.node import deadman, launch
from fabtrain.node.agent.policy import Config, Ledger, Note, Observation, Peers, ProcFacts, decide
from fabtrain.node.coordination import fence
from fabtrain.contract.states import ProcessState


# -- the file's text: one format, written by the contract, read alike by the launcher -------------------


@pytest.mark.parametrize("text", ["123.250 5\n", "1e3 0", " 7 2.5 ", "", "garbage", "1 2 3", "nan 5", "inf 5",
                                  "12 -1", "12 nan", "12 99999", "12", "\x00\x01"])
def test_the_launcher_reads_a_deadline_as_the_contract_does(text):
    assert launch.read_deadline(text) == contract.read_deadline(text)


def test_a_deadline_written_is_read_back_to_the_millisecond():
    assert contract.read_deadline(contract.deadline_text(4567.1234, 5.0)) == (4567.123, 5.0)
    assert contract.read_deadline(contract.deadline_text(12.0, 0.5)) == (12.0, 0.5)


def test_the_exit_record_says_fenced_after_the_code_and_a_reader_of_the_code_alone_still_reads_it(tmp_path):
    assert launch.FENCED == contract.FENCED
    path = str(tmp_path / "trainer-0.exit")
    launch.ExitRecord(path).write(143, fenced=True)
    assert open(path).read() == contract.exit_text(143, fenced=True) == "143 fenced\n"
    assert launch.read_exit(path) == 143 and launch.read_exit_record(path) == (143, True)
    launch.ExitRecord(path).write(0)
    assert open(path).read() == contract.exit_text(0) and launch.read_exit_record(path) == (0, False)
    assert launch.read_exit_record(str(tmp_path / "none.exit")) == (None, False)


# -- the launcher's decision ---------------------------------------------------------------------


def test_the_launcher_ends_its_program_only_once_a_readable_deadline_has_passed(tmp_path):
    path = str(tmp_path / "deadline")
    assert launch.deadline_due(path, 100.0) is None  # no file: no dead-man
    os.mkdir(path)
    assert launch.deadline_due(path, 100.0) is None  # unreadable: no dead-man, no crash
    os.rmdir(path)
    for garbage in (b"", b"soon 5", b"\xff\xfe", b"nan 5"):
        with open(path, "wb") as f:
            f.write(garbage)
        assert launch.deadline_due(path, 1e9) is None, garbage
    with open(path, "w") as f:
        f.write(contract.deadline_text(100.0, 3.0))
    assert launch.deadline_due(path, 99.99) is None
    assert launch.deadline_due(path, 100.0) == 3.0 == launch.deadline_due(path, 150.0)


def test_once_it_fired_the_dead_man_escalates_after_the_grace_whatever_the_file_says_next(tmp_path):
    path = str(tmp_path / "deadline")
    with open(path, "w") as f:
        f.write(contract.deadline_text(10.0, 2.0))
    sent = []
    man = launch.Deadman(path, os.getpid())
    man._send = sent.append
    man.check(9.5)
    assert sent == [] and man.term_at is None
    man.check(10.2)
    assert sent == [launch.signal.SIGTERM, launch.signal.SIGCONT] and man.term_at == 10.2
    with open(path, "w") as f:  # the agent runs again and renews it: the program is ending all the same
        f.write(contract.deadline_text(100.0, 2.0))
    man.check(11.0)
    assert len(sent) == 2
    man.check(12.2)
    man.check(13.0)
    assert sent[2:] == [launch.signal.SIGKILL]


# -- the deadline an agent publishes ---------------------------------------------------------------------


def test_the_deadline_is_the_lease_plus_the_fence_and_its_slack_and_the_steady_state_moves_it_with_the_lease():
    i = 1.0
    fa, slack = fence.fence_after(i), fence.fence_slack(i)
    assert (fa, slack, deadman.hold(i)) == (4.0, 3.0, 6.0)
    # cut off (the connection gone): the lease's, however old
    assert deadman.fence_deadline(100.0, 90.0, False, i) == 90.0 + fa + slack
    # connected, the lease at most an interval old: the lease's
    assert deadman.fence_deadline(100.0, 99.0, True, i) == 99.0 + fa + slack
    assert deadman.fence_deadline(100.0, 99.6, True, i) == 99.6 + fa + slack
    # connected, a late coordinator (the agent does not fence before hung_timeout): it vouches from now
    assert deadman.fence_deadline(100.0, 80.0, True, i) == 100.0 + deadman.hold(i)
    # a new coordinator followed, no lease yet: it vouches from now
    assert deadman.fence_deadline(100.0, None, False, i) == 100.0 + deadman.hold(i)
    # hosting an elected coordinator: no later than its step-down, + the same slack
    assert deadman.fence_deadline(100.0, 99.9, True, i, step_down=102.0) == 102.0 + slack


def test_a_coordinator_steps_down_a_lease_after_the_newest_moment_a_majority_echoed():
    nodes = ("n1", "n2", "n3", "n4", "n5")
    heard = {"n1": 50.0, "n2": 98.0, "n3": 99.0, "n4": 90.0}
    assert deadman.step_down_at(heard, nodes, "n1", 4.0) == 98.0 + 4.0  # n1 itself, n3, n2: 3 of 5
    assert deadman.step_down_at({"n1": 1.0, "n3": 99.0}, nodes, "n1", 4.0) is None  # no majority heard yet
    assert deadman.step_down_at({"n2": 97.0, "n9": 99.5}, ("n1", "n2", "n3"), "n1", 4.0) == 101.0


@pytest.mark.parametrize("interval,grace", [(1.0, 5.0), (0.5, 2.0), (2.0, 10.0), (10.0, 30.0), (0.2, 0.0)])
def test_the_dead_mans_end_fits_in_stop_bound(interval, grace):
    """From the lease: the deadline, a SIGTERM at most a poll late, the grace, the SIGKILL at most a poll after
    it; every process gone by then, within the bound the coordinator's fence_wait counts on."""
    lease = 1000.0
    for age in (0.0, interval * 0.5, interval):  # the steady state: the lease at most an interval old
        at = deadman.fence_deadline(lease + age, lease, True, interval)
        assert at == pytest.approx(lease + fence.fence_after(interval) + fence.fence_slack(interval))
        end = at + launch.DEADMAN_POLL + grace + launch.DEADMAN_POLL
        assert end <= lease + fence.stop_bound(interval, grace) + 1e-9
    assert 2 * launch.DEADMAN_POLL <= fence.KILL_AFTER
    assert fence.stop_bound(interval, grace) == pytest.approx(  # the sum as it was: no term added
        fence.fence_after(interval) + interval + fence.KEEPALIVE_PERIOD + interval + grace + fence.KILL_AFTER)


def test_the_file_moves_earlier_at_once_later_once_a_second_and_is_gone_when_the_agent_ends(tmp_path):
    path = str(tmp_path / "deadline")
    d = deadman.Deadline(path, 5.0)
    d.update(100.0, None, True, 1.0)
    assert not os.path.exists(path)  # no lease yet: none
    d.update(100.0, 99.5, True, 1.0)
    assert contract.read_deadline(open(path).read()) == (99.5 + 7.0, 5.0)
    d.update(100.5, 100.2, True, 1.0)  # later, within the second: not yet
    assert contract.read_deadline(open(path).read())[0] == 106.5
    d.update(101.0, 100.9, True, 1.0)
    assert contract.read_deadline(open(path).read())[0] == 107.9
    d.update(101.2, 100.9, False, 1.0, co=None)  # the same: nothing written
    assert d.written == 101.0
    d.update(110.0, 100.0, False, 1.0)  # earlier (cut off, an older lease: passed): at once; the agent fences
    assert contract.read_deadline(open(path).read())[0] == 107.0 and d.written == 110.0
    d.update(110.5, 110.4, True, 1.0)  # taken back within the second: a deadline that passed goes at once
    assert contract.read_deadline(open(path).read())[0] == 110.4 + 7.0 and d.written == 110.5
    again = deadman.Deadline(path, 5.0)  # an agent restarted by its keeper renews the one it finds
    assert again.at == 117.4
    again.update(111.5, None, False, 1.0)
    assert contract.read_deadline(open(path).read())[0] == 111.5 + deadman.hold(1.0)
    again.clear()
    assert not os.path.exists(path)
    os.mkdir(path)  # cannot be written: the agent goes on
    deadman.Deadline(str(tmp_path / "no" / "such"), 5.0).update(1.0, 1.0, True, 1.0)


def test_only_a_job_whose_launchers_read_a_deadline_gets_one():
    fenced = {"processes": [{"launch": contract.launch_command("py", "/j", "/j/run/t.exit", ["x"], deadline="/j/d")}]}
    plain = {"processes": [{"launch": contract.launch_command("py", "/j", "/j/run/t.exit", ["x"])}]}
    assert deadman.wanted(fenced) and not deadman.wanted(plain) and not deadman.wanted({"processes": []})
    assert JobFolder("/w/jobs/J").deadline == "/w/jobs/J/run/deadline"


def test_the_plan_gives_the_deadline_to_the_job_processes_of_a_job_whose_agents_fence_never_to_the_agent():
    from tests.unit.test_plan import cluster  # the plan's own test cluster (three nodes)
    from fabtrain.plan.plan import make_plan

    elastic = make_plan(cluster({"watchdog": {"min_nodes": 2, "on_failure": "restart"}}), "J1")
    for n in elastic.nodes:
        for p in n.processes:
            i = p.launch.index("--deadline")
            assert p.launch[i + 1] == "$WS/jobs/J1/run/deadline" and p.launch.index("--") > i
        assert "--deadline" not in elastic.agent_process(n.node)["launch"]
    for plain in (make_plan(cluster({}), "J1"), make_plan(cluster({"watchdog": {"on_failure": "restart"}}), "J1")):
        assert not any("--deadline" in p.launch for n in plain.nodes for p in n.processes)


# -- the agent's report, once it runs again ----------------------------------------------------------


CFG = Config(node="n2", job_id="J", interval=1.0, hang_timeout=3.0, startup_timeout=60.0, grace=2.0,
             on_failure="restart", coordinator_node="n1", coordinator="10.0.0.1:7180", elastic=True)


def ended_by_the_dead_man(**kw) -> ProcFacts:
    return ProcFacts(name="trainer-1", role="trainer", rank=1, state=ProcessState.KILLED, pid=200, launcher=100,
                     exit_code=143, fenced=True, **kw)


def test_a_process_its_launcher_ended_is_reported_as_the_fence_not_as_its_exit():
    peers = Peers(ever_connected=True, connected=True, lease_age=0.5)  # the agent's lease looks fine again
    actions, ledger = decide(Observation(now=10.0, procs=(ended_by_the_dead_man(),), peers=peers), Ledger(), CFG)
    kinds = [(a.kind, a.reason) for a in actions if isinstance(a, Note)]
    assert kinds[0] == ("killed", "killed by SIGTERM (exit code 143): " + contract.DEADMAN), kinds
    assert kinds[1][0] == "peer_lost" and kinds[1][1].endswith(contract.FENCES_ITSELF), kinds
    assert ledger.failure_kind == "lost" and ledger.coordinator_lost and ledger.failure_code is None
    assert "trainer-1 on n2: " + contract.DEADMAN in ledger.failure
    # once
    again, _ = decide(Observation(now=11.0, procs=(ended_by_the_dead_man(),), peers=peers), ledger, CFG)
    assert not [a for a in again if isinstance(a, Note)]


def test_a_deposed_coordinators_fence_says_why_it_stepped_down_when_its_launchers_fenced_first():
    peers = Peers(ever_connected=True, connected=True, lease_age=0.5, deposed="coordinator n2 (term 1) heard 1 of 3")
    _, ledger = decide(Observation(now=10.0, procs=(ended_by_the_dead_man(),), peers=peers), Ledger(), CFG)
    assert ledger.failure == "coordinator n2 (term 1) heard 1 of 3; " + contract.FENCES_ITSELF


def test_a_process_that_ended_by_itself_is_still_an_exit():
    proc = ProcFacts(name="trainer-1", role="trainer", rank=1, state=ProcessState.KILLED, pid=200, launcher=100,
                     exit_code=143)
    _, ledger = decide(Observation(now=10.0, procs=(proc,), peers=Peers(ever_connected=True, connected=True)),
                       Ledger(), CFG)
    assert ledger.failure_kind == "exit" and not ledger.coordinator_lost
