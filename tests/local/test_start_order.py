"""With the watchdog on, a start goes to the coordinator's node first (its agent must listen
before the others' agents look for it), and to every other node as soon as that node says its
agent listens: before its own processes have started and settled, not after its whole start."""
import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller import lifecycle
from fabtrain.remote import rpc
from fabtrain.remote.session import Session

NODES = [("n0", ["trainer"]), ("n1", ["trainer"]), ("n2", ["trainer"])]


class Printed:
    """What a node's start prints before its reply, into the order list."""

    def __init__(self, node, order):
        self.node, self.order = node, order

    def write(self, text):
        self.order.append(("printed", self.node, text))

    def flush(self):
        pass


@pytest.fixture
def started(local_job, monkeypatch):
    """start(): the job, and the order in which start requests went out and replies came back."""
    job = local_job(NODES, mode="collective", trainer={"command": "sleep 600"}, watchdog={"interval": 1})
    job.fab("deploy", check=True)
    monkeypatch.setenv("FABTRAIN_STATE_DIR", str(job.state))
    order = []
    real = rpc.Channels.call
    quiet = {}  # start(unasked=True): no start asks to be told, and what each node prints is kept

    def call(self, transport, op, payload, **kw):
        if op == "start":
            order.append(("asked", transport.node.name))
            if quiet.get("on"):
                payload = {k: v for k, v in payload.items() if k != "tell_listening"}
                kw["stream"] = Printed(transport.node.name, order)
        try:
            return real(self, transport, op, payload, **kw)
        finally:
            if op == "start":
                order.append(("answered", transport.node.name))

    monkeypatch.setattr(rpc.Channels, "call", call)

    def start(unasked=False):
        quiet["on"] = unasked
        session = Session(load_cluster(str(job.path)))
        try:
            result = lifecycle.start(session, ("trainer",))
        finally:
            session.close()
        job.job_id = result.job_id
        assert result.complete, result.failures()
        for node, _ in NODES:  # every node runs its trainer and its agent
            assert {p.name for p in next(r for r in result.replies if r.node == node).value.started} == \
                {"agent", "trainer-%s" % node[1:]}, result.replies
        return order
    return start


def test_the_others_start_once_the_coordinators_agent_listens(started):
    order = started()
    assert order[0] == ("asked", "n0")
    # n0 goes on with its trainer and its settle time while the others are asked.
    assert order.index(("asked", "n1")) < order.index(("answered", "n0")), order
    assert order.index(("asked", "n2")) < order.index(("answered", "n0")), order


def test_a_coordinators_node_that_never_says_its_agent_listens_is_waited_for(started, monkeypatch):
    monkeypatch.setattr(lifecycle, "COORDINATOR_LISTENS", "a line no node prints")
    order = started()
    assert order[:2] == [("asked", "n0"), ("answered", "n0")], order


def test_a_start_that_does_not_ask_to_be_told_prints_nothing(started):
    """A Slurm allocation's and a Kubernetes pod's start run node ops' start in their own process,
    whose stdout is the user's log: the line is said only to a controller that asks for it."""
    order = started(unasked=True)
    assert not [o for o in order if o[0] == "printed"], order
    assert order[:2] == [("asked", "n0"), ("answered", "n0")], order
