"""How often an agent beats: every watchdog interval, or less often in a job larger than the
coordinator's beat budget (COORDINATOR_BEATS a second); anything that matters goes at once.

A real Client (not started: `update` is what hands it a beat) behind the agent's Link, with
the settings a real job.json of 64 and of 1,000 nodes gives the agent. No process, no socket.
"""
from __future__ import annotations

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.node.agent.link import Link
from fabtrain.node.agent.loop import settings
from fabtrain.node.coordination import Client
from fabtrain.node.coordination.board import COORDINATOR_BEATS, beat_period, hung_timeout, peer_timeout
from fabtrain.plan.plan import make_plan


def job_settings(nodes: int, interval: float = 1.0):
    c = parse_cluster({"cluster": {"name": "c"},
                       "nodes": [{"name": "n%d" % i, "host": "10.%d.%d.%d" % (i >> 16, (i >> 8) & 255, i & 255),
                                  "roles": ["trainer"]} for i in range(1, nodes + 1)],
                       "job": {"mode": "collective", "master_port": 29500,
                               "watchdog": {"interval": interval}}}, "c.yaml")
    job = make_plan(c, "J").job_json("n2")
    cfg, restart = settings(job, [n["name"] for n in job["nodes"]])
    return job, cfg, restart


@pytest.mark.parametrize("nodes, interval, period, lost", [
    (2, 1.0, 1.0, 5.0), (64, 1.0, 1.0, 5.0), (500, 1.0, 1.0, 5.0), (1000, 1.0, 2.0, 10.0),
    (1000, 3.0, 3.0, 15.0), (64, 0.5, 0.5, 5.0)])
def test_the_beat_period_and_the_silence_that_loses_a_peer_grow_only_past_the_coordinators_budget(
        nodes, interval, period, lost):
    assert COORDINATOR_BEATS == 500
    assert beat_period(interval, nodes) == period and peer_timeout(interval, nodes) == lost
    assert nodes / beat_period(interval, nodes) <= max(COORDINATOR_BEATS, nodes / interval)


@pytest.fixture(scope="module")
def big():
    return job_settings(1000)


def link_of(job, cfg, restart, tmp_path) -> tuple[Link, Client]:
    link = Link(job, [n["name"] for n in job["nodes"]], cfg, restart, str(tmp_path), lambda *a, **k: None,
                lambda: None)
    link.client = Client("127.0.0.1", 1, cfg.interval, lambda msg: None, job_id=job["job_id"], node=job["node"],
                         peer_timeout=cfg.peer_timeout)
    return link, link.client


def beat(state="running", code=None, rate=1.0, done=False, failure=None):
    return {"op": "beat", "job_id": "J", "node": "n2", "ts": 0.0, "done": done, "failure": failure, "final": None,
            "generation": 0, "procs": {"trainer-0": {"role": "trainer", "rank": 1, "state": state,
                                                     "exit_code": code, "rate": rate}}}


def test_a_1000_node_jobs_agent_beats_every_other_tick_and_sends_what_matters_at_once(big, tmp_path):
    job, cfg, restart = big
    assert (cfg.nodes, cfg.interval, cfg.beat_period, cfg.peer_timeout, cfg.hung_timeout) == (1000, 1.0, 2.0, 10.0,
                                                                                              hung_timeout(10.0))
    link, client = link_of(job, cfg, restart, tmp_path)
    sent = []

    def tick(b, urgent=False):
        before = client.seq
        link.send(b, urgent)
        sent.append(client.seq > before)
    tick(beat())  # the first beat goes
    for rate in (1.1, 1.2, 1.3, 1.4):
        tick(beat(rate=rate))  # the rate changes every tick: one beat in two
    assert sent == [True, False, True, False, True]
    tick(beat(rate=1.5, state="exited", code=1), urgent=True)  # the trainer exited: at once, between ticks
    tick(beat(rate=1.5, state="exited", code=1), urgent=True)  # nothing new: nothing sent
    tick(beat(state="exited", code=1, failure={"reason": "trainer-0 exited with code 1"}))  # a tick, new: at once
    tick(beat(state="exited", code=1, failure={"reason": "trainer-0 exited with code 1"}, done=True), urgent=True)
    assert sent[5:] == [True, False, True, True]
    assert client.beat["done"] is True and client.beat["roster"] is None and client.urgent


def test_a_64_node_jobs_agent_beats_every_tick_as_before(tmp_path):
    job, cfg, restart = job_settings(64)
    assert (cfg.nodes, cfg.beat_period, cfg.peer_timeout) == (64, 1.0, 5.0)
    link, client = link_of(job, cfg, restart, tmp_path)
    for i in range(5):
        link.send(beat(rate=1.0))  # not even the rate changes: every tick still beats
        assert client.seq == i + 1
    link.send(beat(rate=1.0), urgent=True)
    assert client.seq == 5
