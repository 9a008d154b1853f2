"""The agent's rules, checked as data: made-up observations in, actions out. No process, no clock."""
from __future__ import annotations

import signal
from fabtrain.node.structs import replace

from fabtrain.node.agent.policy import (Config, DumpStacks, Escalate, Ledger, Note, Observation, Orphan, Peers, ProcFacts, Signal,
                                        Status, Stop, Stray, ZOMBIE_MIN_AGE, decide, next_deadline, on_status)
from fabtrain.node.agent.stacks import top_frame
from fabtrain.contract.states import ProcessState, describe_end, state_of

CFG = Config(node="n2", job_id="J", interval=1.0, hang_timeout=3.0, startup_timeout=60.0, grace=2.0, on_failure="kill-job",
             coordinator_node="n1", coordinator="10.0.0.1:7180")
RUNNING = ProcessState.RUNNING


def trainer(name="trainer-0", **kw) -> ProcFacts:
    base = dict(role=name.split("-")[0], rank=int(name.split("-")[1]), state=RUNNING, pid=200, launcher=100,
                last_activity=0.0)
    return ProcFacts(name=name, **{**base, **kw})


def run(*procs, now=10.0, ledger=Ledger(), cfg=CFG, **obs):
    return decide(Observation(now=now, procs=procs, **obs), ledger, cfg)


def notes(actions, kind=None):
    return [a for a in actions if isinstance(a, Note) and (kind is None or a.kind == kind)]


# -- one meaning for an exit code --------------------------------------------------------------


def test_an_exit_code_means_the_same_everywhere():
    assert state_of(False, exit_code=137) is ProcessState.KILLED
    assert state_of(False, exit_code=-9) is ProcessState.KILLED
    assert state_of(False, exit_code=3) is ProcessState.EXITED
    assert state_of(False) is ProcessState.KILLED  # no exit record: its launcher was killed, and the program with it
    assert state_of(False, before_boot=True) is ProcessState.LOST
    assert state_of(True, "S") is RUNNING and state_of(True, "T") is ProcessState.STOPPED
    assert state_of(True, "Z") is ProcessState.ZOMBIE and state_of(False, started=False) is ProcessState.NOT_STARTED
    assert describe_end(137) == "killed by SIGKILL (exit code 137)" == describe_end(None, signal=9)
    assert describe_end(0) == "exited with code 0"
    assert "str" == type(str(ProcessState.NOT_STARTED)).__name__ and ProcessState.NOT_STARTED == "not started"


# -- exits ----------------------------------------------------------------------------------


def test_a_non_zero_exit_fails_the_job_once():
    p = trainer(state=ProcessState.KILLED, exit_code=137)
    actions, ledger = run(p)
    (exited,) = notes(actions, "exited")
    assert exited.reason == "killed by SIGKILL (exit code 137)" and exited.fields["signal"] == "SIGKILL"
    assert ledger.status == Status("failed", "trainer-0 on n2 killed by SIGKILL (exit code 137)", "n2")
    assert [n.kind for n in notes(actions)][:2] == ["exited", "job_failed"]
    assert [a for a in actions if isinstance(a, Stop)] == []  # nothing else lives here
    again, _ = run(p, ledger=ledger)
    assert notes(again, "exited") == []


def test_exit_0_is_not_a_failure():
    actions, ledger = run(trainer(state=ProcessState.EXITED, exit_code=0))
    assert notes(actions, "exited")[0].reason == "exited with code 0" and ledger.status.status == "running"


def test_a_killed_launcher_is_the_processs_failure_not_a_lost_process():
    p = trainer(state=ProcessState.KILLED, launcher_lost=True, launcher=4242)
    actions, ledger = run(p)
    assert ledger.status.status == "failed"
    assert ledger.status.reason == "trainer-0 on n2 killed: its launcher (pid 4242) died without recording an exit code"


def test_a_failure_on_a_full_disk_says_so_and_where():
    actions, ledger = run(trainer(state=ProcessState.EXITED, exit_code=1), disk_full="/ws")
    assert "No space left on device: /ws on n2 is full" in ledger.status.reason
    assert "No space left on device" in notes(actions, "exited")[0].reason


# -- the hang rule --------------------------------------------------------------------------


def test_after_the_first_record_only_records_are_progress():
    busy = trainer(last_record=5.0, last_activity=9.9)  # CPU and log lines up to now, last record 5 s ago
    actions, ledger = run(busy, now=8.1)
    (hang,) = notes(actions, "hang")
    assert "no new metrics record" in hang.reason and "no progress" in hang.reason
    assert Stop("trainer-0", "hang: " + hang.reason) in actions
    assert ledger.status.reason.startswith("trainer-0 on n2 hung: no progress for 3 s")
    actions, _ = run(busy, now=7.9)
    assert notes(actions, "hang") == []


def test_before_the_first_record_log_output_and_cpu_count():
    starting = trainer(last_record=None, last_activity=9.0)  # prints, or burns CPU, while it starts
    assert notes(run(starting, now=11.9)[0], "hang") == []
    (hang,) = notes(run(starting, now=12.1)[0], "hang")
    assert "no metrics record, no log output, no CPU time" in hang.reason


def test_a_stopped_process_is_a_hang():
    stopped = trainer(state=ProcessState.STOPPED, stopped_since=8.0, last_record=7.9)
    assert notes(run(stopped, now=9.6)[0], "hang") == []
    assert "stopped (SIGSTOP) for 3 s" in notes(run(stopped, now=10.9)[0], "hang")[0].reason


def test_a_pserver_waiting_for_trainers_is_not_hung_and_keep_kills_nothing():
    ps = trainer("pserver-0", last_record=0.0)
    actions, ledger = run(ps, now=100.0)
    assert notes(actions, "hang") == [] and dict(ledger.quiet)["pserver-0"] == 100.0
    # Trainers start: its silence counts from then.
    actions, _ = run(ps, trainer(last_record=100.0), now=102.0, ledger=ledger)
    assert notes(actions, "hang") == []
    keep = replace(CFG, on_failure="keep")
    actions, ledger = run(trainer(last_record=0.0), now=5.0, cfg=keep)
    assert "not killed: on_failure is keep" in notes(actions, "hang")[0].reason
    assert not [a for a in actions if isinstance(a, Stop)]
    assert notes(actions, "kept")


def test_the_next_deadline_is_the_hang_deadline():
    obs = Observation(now=6.0, procs=(trainer(last_record=5.0),))
    assert next_deadline(obs, Ledger(), CFG) == 8.0


# -- startup ----------------------------------------------------------------------------------


def test_a_node_that_never_joins_fails_the_job_by_name():
    peers = Peers(ever_connected=True, seen=("n1", "n2"))
    obs = dict(peers=peers, must_join=("n1", "n2", "n3"), startup_deadline=60.0)
    assert notes(run(trainer(last_activity=58.0), now=59.0, **obs)[0], "not_joined") == []
    actions, ledger = run(trainer(last_record=59.0), now=60.0, **obs)
    assert "node n3 never joined" in ledger.status.reason and notes(actions, "not_joined")
    # A process of this node that was never started.
    actions, ledger = run(trainer(last_activity=59.9), trainer("trainer-1", state=ProcessState.NOT_STARTED), now=60.0,
                          peers=Peers(ever_connected=True, seen=("n2",)), must_join=("n2",), startup_deadline=60.0)
    assert ledger.status.reason == "trainer-1 on n2 never started within startup_timeout (60 s)"
    # No coordinator ever answered.
    actions, ledger = run(trainer(last_record=59.5), now=60.0, peers=Peers(error="connection refused"),
                          must_join=("n1", "n2"), startup_deadline=60.0)
    assert ledger.status.reason.startswith("node n1 never joined: no coordinator answered at 10.0.0.1:7180")


def test_once_a_job_that_came_together_passes_its_startup_deadline_the_deadline_is_never_due_again():
    """It was: every agent of a job that had run startup_timeout stepped every 20 ms from then on."""
    joined = dict(peers=Peers(ever_connected=True, seen=("n1", "n2")), must_join=("n1", "n2"), startup_deadline=60.0)
    p = trainer(last_record=59.5)
    _, ledger = run(p, now=30.0, **joined)
    assert next_deadline(Observation(now=30.0, procs=(p,), **joined), ledger, CFG) == 60.0  # the check is ahead
    actions, ledger = run(p, now=60.5, ledger=ledger, **joined)
    assert notes(actions, "not_joined") == [] and ledger.status.status == "running" and ledger.startup_checked
    due = next_deadline(Observation(now=60.5, procs=(p,), **joined), ledger, CFG)
    assert due == 59.5 + CFG.hang_timeout  # the hang rule's moment, not the past startup deadline


# -- the job's status, teardown, escalation ----------------------------------------------------


def test_a_failure_elsewhere_tears_down_here_and_escalates_after_the_grace():
    _, ledger = on_status({"op": "status", "job_id": "J", "status": "failed", "reason": "boom", "node": "n3"},
                          "J", Ledger(), CFG)
    actions, ledger = run(trainer(last_record=9.9), ledger=ledger)
    assert Stop("trainer-0", "teardown: job failed (boom)") in actions and notes(actions, "teardown")
    closing = trainer(last_record=9.9, term_at=10.0, kill_signal="SIGTERM")
    assert not [a for a in run(closing, now=11.9, ledger=ledger)[0] if isinstance(a, Escalate)]
    actions, _ = run(closing, now=12.0, ledger=ledger)
    assert Escalate("trainer-0") in actions
    assert on_status({"op": "status", "job_id": "other", "status": "failed"}, "J", Ledger(), CFG)[1] == Ledger()


def test_finished_stops_the_pservers():
    ledger = Ledger(status=Status("finished", "every trainer exited with code 0"))
    actions, _ = run(trainer("pserver-0"), trainer(state=ProcessState.EXITED, exit_code=0), ledger=ledger)
    assert Stop("pserver-0", "the job finished") in actions


def test_a_silent_coordinator_fails_the_job():
    actions, ledger = run(trainer(last_record=9.9), peers=Peers(ever_connected=True, silent_for=6.0, error="reset"))
    assert notes(actions, "peer_lost")[0].fields["peer"] == "n1"
    assert ledger.status.reason.startswith("coordinator 10.0.0.1:7180 (agent of n1) unreachable: no answer to a beat "
                                           "for 6.0 s (reset); this node fences itself")


def test_a_node_cut_off_fences_itself_fence_after_its_lease_with_the_connection_gone():
    """The lease (the newest answered beat's send time), not the last line heard, decides; fence_after is an
    interval under peer_timeout, so the node stops before the coordinator even declares it lost."""
    assert CFG.fence_after == 4.0 < CFG.peer_timeout
    cut = Peers(ever_connected=True, connected=False, silent_for=1.0, lease_age=3.9, error="timed out")
    actions, ledger = run(trainer(last_record=9.9), peers=cut)
    assert not notes(actions, "peer_lost") and ledger.status.status == "running"
    actions, ledger = run(trainer(last_record=9.9), peers=replace(cut, lease_age=4.0))  # a status heard 1 s ago
    assert notes(actions, "peer_lost") and Stop("trainer-0", "teardown: job failed (%s)" % ledger.status.reason) \
        in actions
    assert "fence_after 4 s" in ledger.status.reason
    # On an open connection (the kernel on the coordinator's side answers) slow is not gone.
    actions, ledger = run(trainer(last_record=9.9), peers=replace(cut, connected=True, lease_age=29.0))
    assert ledger.status.status == "running"


def test_a_fenced_answer_stops_the_node_for_good_and_no_restart_brings_it_back():
    cfg = replace(CFG, on_failure="restart")
    fenced = {"op": "fenced", "job_id": "J", "node": "n2", "generation": 1, "reason": "n2 left the job at generation 0"}
    actions, ledger = on_status(fenced, "J", Ledger(), cfg)
    assert [n.kind for n in notes(actions)] == ["fenced"] and ledger.status.status == "failed"
    actions, ledger = run(trainer(last_record=9.9), ledger=ledger, cfg=cfg)
    assert [a for a in actions if isinstance(a, Stop)] == [Stop("trainer-0", "teardown: job failed (%s)"
                                                                % ledger.status.reason)]
    restart = {"op": "status", "job_id": "J", "status": "restarting", "generation": 2, "backoff": 1.0}
    assert on_status(restart, "J", ledger, cfg, 11.0) == ([], ledger)
    assert on_status(fenced, "J", ledger, cfg) == ([], ledger)  # said once


def test_a_slow_coordinator_on_an_open_connection_is_not_lost_until_hung_timeout():
    slow = Peers(ever_connected=True, connected=True, silent_for=29.0)
    actions, ledger = run(trainer(last_record=9.9), peers=slow)
    assert not notes(actions, "peer_lost") and ledger.status.status == "running"
    actions, ledger = run(trainer(last_record=9.9), peers=replace(slow, silent_for=31.0))
    assert notes(actions, "peer_lost") and ledger.status.status == "failed"
    assert "answered nothing for 31 s on an open connection (hung_timeout 30 s)" in ledger.status.reason


# -- orphans and zombies ------------------------------------------------------------------------


def test_orphans_get_sigterm_then_sigkill_after_the_grace():
    old = Stray(pid=77, ctime=1.0, job="OLD", role="trainer", rank="7", age=30.0, job_running=False)
    young = replace(old, pid=78, age=1.0)
    actions, ledger = run(strays=(old, young))
    assert Signal(77, 1.0, signal.SIGTERM) in actions and not [a for a in actions if getattr(a, "pid", 0) == 78]
    (note,) = notes(actions, "orphan")
    assert note.reason == "belongs to job OLD, which is not running; killing it"
    assert note.fields == {"pid": 77, "role": "trainer", "rank": 7, "job": "OLD", "signal": "SIGTERM"}
    assert ledger.orphans == (Orphan(77, 1.0, "belongs to job OLD, which is not running", "trainer-7", "OLD", 10.0),)
    actions, ledger = run(now=12.0, ledger=ledger, orphans_alive=frozenset({77}))
    assert Signal(77, 1.0, signal.SIGKILL) in actions
    _, ledger = run(now=13.0, ledger=ledger, orphans_alive=frozenset())
    assert ledger.orphans == ()


def test_what_a_process_left_behind_is_killed_as_an_orphan():
    done = trainer(state=ProcessState.EXITED, exit_code=3, leftovers=((300, 2.0),))
    actions, ledger = run(done)
    orphan = notes(actions, "orphan")[0]
    assert "outlived its main process trainer-0 (pid 200, which exited with code 3)" in orphan.reason
    assert ledger.orphans == (Orphan(300, 2.0, orphan.reason.replace("; killing it", ""), "trainer-0", "", 10.0),)


def test_open_mpis_daemon_left_after_the_jobs_end_is_killed_as_an_orphan_and_only_then():
    """The agent hands the policy a rank's starter (orted) only once it outstayed STARTER_WAIT; the policy
    ends it only when the job has ended and nothing of it runs here (the daemon serves every rank here)."""
    done = trainer(state=ProcessState.EXITED, exit_code=137, starter=(500, 4.0))
    other = trainer("trainer-3", last_record=9.9)
    failed = Ledger(status=Status("failed", "trainer-1 on node2 exited with code 137"))
    actions, ledger = run(replace(done, exit_code=0), ledger=Ledger(reported=frozenset({"trainer-0"})))
    assert ledger.status.status == "running" and notes(actions, "orphan") == []  # other ranks need the daemon
    actions, _ = run(done, other, ledger=failed)  # trainer-3 still runs under it: the teardown comes first
    assert not [a for a in actions if getattr(a, "pid", None) == 500]
    actions, ledger = run(done, replace(done, name="trainer-4"), ledger=failed)  # two ranks, one daemon
    (note,) = notes(actions, "orphan")
    assert note.reason == "Open MPI's daemon (pid 500), which started trainer-0 here, outlived the job; killing it"
    assert Signal(500, 4.0, signal.SIGTERM) in actions and [o.pid for o in ledger.orphans] == [500]
    actions, ledger = run(done, now=12.0, ledger=ledger, orphans_alive=frozenset({500}))  # grace over
    assert Signal(500, 4.0, signal.SIGKILL) in actions and notes(actions, "orphan")[0].fields["signal"] == "SIGKILL"


def test_zombies_are_reported_once_and_their_parent_killed_when_the_job_ends():
    p = trainer(zombies=((301, 250, 3.0),), last_record=9.9)
    actions, ledger = run(p)
    assert notes(actions, "zombie") == []  # defunct since this look: its parent may reap it in a moment
    p = replace(p, last_record=14.9)  # still making progress
    actions, ledger = run(p, now=10.0 + ZOMBIE_MIN_AGE, ledger=ledger)
    (note,) = notes(actions, "zombie")
    assert "has not reaped it for 5 s" in note.reason and not [a for a in actions if isinstance(a, Signal)]
    ledger = replace(ledger, status=Status("failed", "x"))
    actions, ledger = run(p, now=15.5, ledger=ledger)
    assert notes(actions, "zombie") == [] and Signal(250, None, signal.SIGKILL) in actions


def test_a_zombie_reaped_between_two_looks_is_never_reported_and_a_new_one_at_its_pid_starts_again():
    """On a starved machine a shell takes seconds to reap its `sleep`: defunct for a moment is not news."""
    p = trainer(zombies=((301, 250, 3.0),), last_record=9.9)
    _, ledger = run(p)
    _, ledger = run(trainer(last_record=11.9), now=12.0, ledger=ledger)  # reaped
    assert ledger.zombies_since == ()
    p = replace(p, last_record=15.9)
    actions, ledger = run(p, now=16.0, ledger=ledger)  # defunct again (a later child): counted from now
    assert notes(actions, "zombie") == []
    actions, _ = run(replace(p, last_record=20.9), now=21.0, ledger=ledger)
    assert len(notes(actions, "zombie")) == 1


# -- stacks before the kill ------------------------------------------------------------------


def test_a_hang_dumps_every_live_processs_stacks_once_before_any_stop_and_names_the_first_to_stop():
    hung = trainer("trainer-1", last_record=5.0)  # stopped first
    late = trainer("trainer-0", last_record=6.0)
    actions, ledger = run(late, hung, now=8.5)
    dumps = [a for a in actions if isinstance(a, DumpStacks)]
    assert dumps == [DumpStacks(("trainer-0", "trainer-1"))]
    first_stop = next(i for i, a in enumerate(actions) if isinstance(a, Stop))
    assert actions.index(dumps[0]) < first_stop
    assert [(n.name, n.fields["first"]) for n in notes(actions, "hang")] == [("trainer-1", "trainer-1")]
    assert ledger.stacks_taken
    again, _ = run(late, hung, now=12.0, ledger=ledger)
    assert not [a for a in again if isinstance(a, DumpStacks)]


def test_another_nodes_hang_dumps_stacks_here_before_the_teardown_but_another_failure_does_not():
    hang = {"op": "status", "job_id": "J", "status": "failed", "reason": "trainer-1 on n3 hung: no progress",
            "node": "n3"}
    _, ledger = on_status(hang, "J", Ledger(), CFG)
    actions, _ = run(trainer(last_record=9.9), ledger=ledger)
    assert actions.index(DumpStacks(("trainer-0",))) < actions.index(Stop("trainer-0", "teardown: job failed (%s)"
                                                                            % hang["reason"]))
    _, ledger = on_status(dict(hang, reason="trainer-1 on n3 exited with code 1"), "J", Ledger(), CFG)
    actions, _ = run(trainer(last_record=9.9), ledger=ledger)
    assert not [a for a in actions if isinstance(a, DumpStacks)]


def test_the_main_threads_top_frame_is_read_from_faulthandlers_dump():
    text = ('Thread 0x00007f31b272e6c0 (most recent call first):\n'
            '  File "/w/x.py", line 5 in sleeper\n  File "/usr/lib/threading.py", line 982 in run\n\n'
            'Current thread 0x00007f31b3490240 (most recent call first):\n'
            '  File "/w/fakejob.py", line 42 in spin_forever\n  File "/w/fakejob.py", line 90 in main\n')
    assert top_frame(text) == "/w/fakejob.py:42 in spin_forever"
    assert top_frame("") is None


def test_an_agent_restarted_on_a_node_cut_off_still_fences_itself():
    """Its predecessor had a lease: the new agent's lease starts with it, though it never reaches the
    coordinator (one that never had a lease waits, as agents started before the coordinator do)."""
    import time

    from fabtrain.node.agent.link import Link
    from fabtrain.node.agent.policy import coordinator_lost
    from fabtrain.node.coordination.restart import RestartPolicy

    job = {"job_id": "J", "node": "n2", "watchdog": {"coordinator": {"host": "10.0.0.1", "port": 7180}}}
    link = Link(job, ["n1", "n2"], CFG, RestartPolicy.never(), "/nonexistent", None, None,
                resumed=time.monotonic() - CFG.fence_after)
    assert coordinator_lost(link.peers(), CFG)
    fresh = Link(job, ["n1", "n2"], CFG, RestartPolicy.never(), "/nonexistent", None, None)
    assert not coordinator_lost(fresh.peers(), CFG)


def test_a_restart_whose_start_the_coordinator_moves_later_starts_then_and_the_same_status_again_moves_nothing():
    """A lost node's fence may move the pending generation's start (board._leave): the agents take the remaining
    backoff of the status with a new ts, once; the same status comes with every reply and must not push it on."""
    cfg = replace(CFG, on_failure="restart")
    first = {"op": "status", "job_id": "J", "status": "restarting", "generation": 1, "backoff": 8.0, "ts": 100.0}
    _, ledger = on_status(first, "J", Ledger(), cfg, 100.0)
    assert (ledger.generation, ledger.restart_at) == (1, 108.0)
    assert on_status(first, "J", ledger, cfg, 103.0)[1].restart_at == 108.0  # the same status, again
    moved = dict(first, backoff=6.0, ts=103.0)  # at 103 the start moves to 109
    _, ledger = on_status(moved, "J", ledger, cfg, 103.0)
    assert ledger.restart_at == 109.0
    assert on_status(moved, "J", ledger, cfg, 105.0)[1].restart_at == 109.0
    earlier = dict(first, backoff=1.0, ts=106.0)  # never earlier than it was
    assert on_status(earlier, "J", ledger, cfg, 106.0)[1].restart_at == 109.0
