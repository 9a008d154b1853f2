"""The controller's view: series thinning and the job's state."""
from types import SimpleNamespace

import pytest

from fabtrain.controller.collector import Collector, NodeView, Series


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


def collector_with(processes, events=(), killed=False):
    session = SimpleNamespace(cluster=SimpleNamespace(nodes=[SimpleNamespace(name="n0")]))
    c = Collector(session)
    c.nodes["n0"] = NodeView("n0", up=True, job_id="J", processes=processes, killed=killed)
    for e in events:
        c.events.appendleft(e)
    return c


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
])
def test_job_state(procs, events, killed, expected):
    assert collector_with(procs, events, killed).job_state() == expected
