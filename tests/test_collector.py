"""The controller's view: series thinning and the job's state."""
import pytest

from fabtrain.controller.jobstate import NodeObservation, job_verdict
from fabtrain.controller.series import Series
from fabtrain.node.states import ProcessState, process_state


def test_series_stays_bounded_evenly_spaced_and_keeps_the_latest_point():
    s = Series(max_points=100)
    for step in range(1_000_000):
        s.add(step, 1.0 / (step + 1))
    pts = s.export()
    assert len(pts) <= 2 * 100 + 1
    assert pts[0][0] == 0 and pts[-1] == (999_999, 1.0 / 1_000_000)
    gaps = {b[0] - a[0] for a, b in zip(pts[:-2], pts[1:-1])}
    assert len(gaps) == 1  # one stride over the whole run: the chart keeps its shape


def test_a_short_series_is_kept_whole():
    s = Series(max_points=100)
    for step in range(50):
        s.add(step, step)
    assert s.export() == [(i, i) for i in range(50)]


def observe(processes, events=(), killed=False, agent=None):
    return [NodeObservation("n0", True, "J", tuple(processes), killed, agent, 0.5 if agent else None, tuple(events))]


def p(name, state, code=None):
    return {"name": name, "state": state, "exit_code": code}


@pytest.mark.parametrize("procs,events,killed,expected", [
    ([p("pserver-0", "running"), p("trainer-0", "running")], [], False, "running"),
    ([p("pserver-0", "not started"), p("trainer-0", "not started")], [], False, "starting"),
    ([p("pserver-0", "running"), p("trainer-0", "exited", 0)], [], False, "finished"),
    # After a normal end the agents stop the pservers (SIGTERM -> 143): still finished.
    ([p("pserver-0", "exited", 143), p("trainer-0", "exited", 0)], [{"kind": "finished"}], False, "finished"),
    ([p("pserver-0", "exited", 143), p("trainer-0", "exited", 1)], [{"kind": "job_failed"}], False, "failed"),
    ([p("pserver-0", "running"), p("trainer-0", "exited", 137)], [], False, "failed"),
    ([p("pserver-0", "killed"), p("trainer-0", "killed")], [{"kind": "killed"}], True, "killed"),
    ([p("pserver-0", "running"), p("trainer-0", "lost")], [], False, "failed"),
    ([], [], False, "starting"),
])
def test_job_state(procs, events, killed, expected):
    assert job_verdict(observe(procs, events, killed)).state == expected


def test_exit_code_137_is_killed_by_sigkill_not_an_exit():
    v = job_verdict(observe([p("pserver-0", "running"), p("trainer-0", "exited", 137)]))
    trainer = v.process("n0", "trainer-0")
    assert (trainer.state, trainer.signal, trainer.exit_code, trainer.label) == ("killed", "SIGKILL", 137, "killed (SIGKILL)")
    assert v.reason == "trainer-0 on n0 killed by SIGKILL" and not v.ended  # pserver-0 still runs
    assert process_state(False, None, 137, None) == process_state(False, "killed", None, 9) == ProcessState.KILLED
    assert process_state(False, None, 3, None) == ProcessState.EXITED
    assert process_state(False, None, None, None) == ProcessState.LOST
    assert process_state(True, "T", None, None) == ProcessState.STOPPED


def test_a_process_whose_launcher_is_gone_runs_while_its_agent_sees_it():
    agent = {"ts": 1.0, "job_id": "J", "interval": 1.0, "processes": [{"name": "trainer-0", "state": "running"}],
             "job": {"status": "running"}}
    v = job_verdict(observe([p("pserver-0", "running"), p("trainer-0", "lost")], agent=agent))
    assert v.state == "running" and v.process("n0", "trainer-0").label == "running (launcher gone)"
    assert v.notes == ("trainer-0 on n0: its launcher is gone; its agent still sees it running",)
    # An agent silent for long is not believed: lost is lost.
    stale = [NodeObservation("n0", True, "J", (p("pserver-0", "running"), p("trainer-0", "lost")), False, agent, 60.0)]
    assert job_verdict(stale).state == "failed"


def test_the_agents_word_on_the_job_comes_before_exit_codes():
    failed = {"ts": 1.0, "job_id": "J", "job": {"status": "failed", "reason": "trainer-1 on n1 hung",
                                                 "on_failure": "keep", "kept": True}}
    v = job_verdict(observe([p("pserver-0", "running"), p("trainer-0", "running")], agent=failed))
    assert (v.state, v.reason, v.kept, v.ended, v.said_by) == ("failed", "trainer-1 on n1 hung", True, True, ("n0",))
    assert "on_failure keep: survivors left running" in v.summary()


def test_nothing_reachable_is_unknown_and_no_job_is_no_job():
    assert job_verdict([NodeObservation("n0", False, error="refused")]).state == "unknown"
    assert job_verdict([NodeObservation("n0", None)]).state == "unknown"
    assert job_verdict([NodeObservation("n0", True)]).state == "no job"
