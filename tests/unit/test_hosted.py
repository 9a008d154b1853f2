"""THE hosted supervisor (fabtrain/node/hosted.py) as data: the agents' verdict as the exit code a platform
reads, and what a SIGTERM means on each platform. The parts run for real in tests/slurm/test_slurm.py and
tests/local/test_kubernetes_pods.py."""
from __future__ import annotations

import json
import threading
import time

import pytest

from fabtrain.node import hosted, pod
from fabtrain.node.agent.loop import platform_stop, stopped_failure
from fabtrain.node.allocation import sigterm_cause, slurm_cause
from fabtrain.node.coordination.restart import RestartPolicy
from fabtrain.contract.jobfolder import DISRUPTED_BEFORE
from fabtrain.contract.states import ENDED, LOST, JobState, disruption_marker, killed_marker, read_disruption

JOB = {"node": "n1", "processes": [{"name": "pserver-0", "exit": "$WS/jobs/j/run/pserver-0.exit"}]}


def write_events(jd, *events):
    jd.mkdir(parents=True, exist_ok=True)
    (jd / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"kind": "torn')


@pytest.mark.parametrize("events, ended", [
    ([{"kind": "finished", "node": "n0"}], JobState.FINISHED),
    ([{"kind": "job_failed", "node": "n0"}], JobState.FAILED),
    ([{"kind": "kept", "node": "n1"}], JobState.FAILED),
    ([{"kind": "agent_exit", "node": "n1"}], JobState.FINISHED),  # its part ended, nothing failed here
    ([{"kind": "agent_exit", "node": "n0"}], None),  # another node's agent
    ([{"kind": "failure", "node": "n1"}, {"kind": "restarting"}, {"kind": "restarted"}], None),
    ([{"kind": "failure", "node": "n1"}, {"kind": "agent_exit", "node": "n1"}], JobState.FAILED),
])
def test_the_outcome_is_what_the_agents_said(tmp_path, events, ended):
    write_events(tmp_path, *events)
    assert hosted.outcome(str(tmp_path), "n1") == ended


def test_the_exit_code_is_the_agents_verdict_never_the_exit_files(tmp_path):
    jd = tmp_path / "jobs" / "j"
    (jd / "run").mkdir(parents=True)
    (jd / "run" / "pserver-0.exit").write_text("143")  # the agents stopped it at the end
    stop = hosted.Stop("evicted by Kubernetes", disruption=LOST)
    write_events(jd, {"kind": "finished", "node": "n0"})
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), None) == 0
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), stop) == 0  # finished first: a stop is only cleanup
    write_events(jd, {"kind": "job_failed", "node": "n0"})
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), None) == 1
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), stop) == 143
    write_events(jd)
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), None) == 1  # agents that never said
    (jd / "killed").write_text("fab kill-all")
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), None) == 143
    (jd / "killed").unlink()
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), None, agents=False) == 1  # no agents: no verdict
    (jd / "run" / "pserver-0.exit").write_text("0")
    assert hosted.exit_code(str(jd), JOB, str(tmp_path), None, agents=False) == 0


@pytest.mark.parametrize("state, reason, cause", [
    ("PREEMPTED", "None", "preempted by Slurm"),
    ("CANCELLED", "Preempted", "preempted by Slurm"),
    ("REQUEUED", "None", "requeued by Slurm"),
    ("NODE_FAIL", "None", "a node of the allocation failed (Slurm: NODE_FAIL)"),
    ("TIMEOUT", "TimeLimit", "Slurm's time limit"),
    ("CANCELLED", "None", "cancelled in Slurm (scancel)"),
    ("COMPLETING", "None", "cancelled in Slurm (scancel)"),  # what squeue and scontrol say during a scancel
    ("COMPLETED", "None", "cancelled in Slurm (scancel)"),
    ("RUNNING", "None", "ended with the job's Slurm step (another node's part ended first)"),
    ("", "", "ended by Slurm (its state could not be read)"),
])
def test_a_sigterm_from_slurm_says_what_slurm_did(state, reason, cause):
    assert slurm_cause(state, reason) == cause


def test_a_preempted_job_reads_preempted_while_it_is_completing():
    assert slurm_cause("COMPLETING", "None", preempted=True) == "preempted by Slurm"


def test_a_slurm_sigterm_after_the_agents_ended_a_marked_job_is_still_the_users_stop(tmp_path):
    """scancel signals the step's processes in turn: the programs may die first, the agents end the job on
    the `killed` marker and leave, and only then does the step task read its SIGTERM. The stop is still
    the one the marker names; unmarked, it is the end of a step whose job already ended."""
    folder, jd = tmp_path / "slurm", tmp_path / "job"
    folder.mkdir()
    jd.mkdir()
    (jd / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"ts": 1.0, "node": "n0", "kind": "job_failed", "reason": "trainer-0 on n0: stopped by fab kill-all"},
        {"ts": 2.0, "node": "n1", "kind": "agent_exit", "reason": "nothing left to watch"}]))
    assert sigterm_cause(str(folder), str(jd), "n1", "") == hosted.Stop("the job's Slurm step ended after the job did")
    (jd / "killed").write_text(killed_marker("the dashboard's Kill button"))
    assert sigterm_cause(str(folder), str(jd), "n1", "") == hosted.Stop(
        "the dashboard's Kill button", by="the dashboard's Kill button")


def test_a_pod_sigterm_without_fabtrains_mark_is_kubernetes_taking_the_node(tmp_path):
    assert pod.sigterm_cause(str(tmp_path)) == hosted.Stop("evicted by Kubernetes", disruption=LOST)
    (tmp_path / "killed").write_text("fab kill-all")
    assert pod.sigterm_cause(str(tmp_path)) == hosted.Stop("fab kill-all", by="fab kill-all")


def test_a_disrupted_node_reports_a_lost_node_that_restarts_never_an_agent_stopped(tmp_path):
    assert stopped_failure(str(tmp_path), "n1", "SIGTERM", ["trainer-1"]) == (
        "the agent on n1 was stopped (SIGTERM) while trainer-1 still ran", "other")
    (tmp_path / "disrupted").write_text("%s\nevicted by Kubernetes\n" % LOST)
    assert read_disruption(str(tmp_path)) == (LOST, "evicted by Kubernetes")
    assert stopped_failure(str(tmp_path), "n1", "SIGTERM", ["trainer-1"]) == ("node n1 evicted by Kubernetes", LOST)
    policy = RestartPolicy(enabled=True, max_restarts=2, backoff=1.0, exit_codes=None, grace=1.0)
    assert policy.decide({"kind": LOST}, 0).restart
    assert not policy.decide({"kind": ENDED}, 0).restart  # the platform ended the whole job: no restart in it


def test_a_signalled_agent_in_a_slurm_step_waits_for_the_step_task_to_say_why(tmp_path):
    # Slurm signals every process of the step at once: the agent must not read its own stop first.
    def say():
        time.sleep(0.3)
        (tmp_path / "disrupted").write_text("%s\npreempted by Slurm\n" % ENDED)
    threading.Thread(target=say).start()
    t0 = time.monotonic()
    assert platform_stop(str(tmp_path), {"slurm": {"job_id": "7"}}, True) == (ENDED, "preempted by Slurm")
    assert 0.2 < time.monotonic() - t0 < 3
    (tmp_path / "disrupted").unlink()
    t0 = time.monotonic()
    assert platform_stop(str(tmp_path), {}, True) == (None, None)  # SSH nodes: fabtrain marks before it signals
    assert platform_stop(str(tmp_path), {"slurm": {"job_id": "7"}}, False) == (None, None)
    assert time.monotonic() - t0 < 0.2


@pytest.mark.parametrize("kind, kept", [(LOST, True), (ENDED, False)])
def test_a_part_started_again_keeps_the_loss_of_the_one_before_for_its_agent_and_never_an_end(tmp_path, kind, kept):
    (tmp_path / "disrupted").write_text(disruption_marker(kind, "evicted by Kubernetes"))
    hosted.forget_earlier_part(str(tmp_path), JOB)
    assert read_disruption(str(tmp_path)) == (None, None)  # the new part is not disrupted
    assert read_disruption(str(tmp_path), DISRUPTED_BEFORE) == ((LOST, "evicted by Kubernetes") if kept else (None, None))
