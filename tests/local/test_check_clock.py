"""fab check's clock column over real node ops on local nodes: a node on this machine's kernel has no offset."""
from fabtrain.config.cluster import parse_cluster
from fabtrain.controller import lifecycle
from fabtrain.controller.report import check_text
from fabtrain.remote.session import Session


def local_session(tmp_path):
    return Session(parse_cluster({"cluster": {"name": "clock", "workspace": str(tmp_path / "ws")},
                                  "nodes": [{"name": "n0", "host": "local", "roles": ["trainer"]}],
                                  "job": {"mode": "collective", "trainer": {"command": "true"}}}, "c.yaml"))


def test_a_node_on_this_machine_has_no_clock_offset(tmp_path):
    session = local_session(tmp_path)
    try:
        [c] = lifecycle.check(session)
    finally:
        session.close()
    assert c.clock_offset == (0.0, 0.0)
    row = next(line for line in check_text([c]).splitlines() if line.startswith("n0"))
    assert row.endswith("0 (this machine)") and "±" not in row, row


def test_a_node_on_another_kernel_shows_the_bound_of_the_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(lifecycle, "boot_id", lambda: "another-machine")  # the controller elsewhere
    session = local_session(tmp_path)
    try:
        [c] = lifecycle.check(session)
    finally:
        session.close()
    lo, hi = c.clock_offset
    assert lo <= 0 <= hi and hi > lo  # the node's clock is this one's: the bound holds 0, and is a bound
    row = next(line for line in check_text([c]).splitlines() if line.startswith("n0"))
    assert "±" in row and "this machine" not in row, row
