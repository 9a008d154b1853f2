"""Checkpoints as data (issue 57): the words, what the agent makes of the hook's records across a restart, the
restart policy's damaged-checkpoint rule on the coordinator's board, the no_checkpoint rule, the setting, and
what the controller's views make of a trainer's records. No process (tests/local/test_checkpoints.py runs
the real thing)."""
from __future__ import annotations

import os
import subprocess
import threading
from types import SimpleNamespace

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.contract import checkpoints as words
from fabtrain.controller import checkpoints as views
from fabtrain.node.agent import checkpoints
from fabtrain.node.agent.policy import Config, Ledger, Status, on_status
from fabtrain.node.agent.relaunch import resume_env
from fabtrain.node.agent.supervisor import Progress
from fabtrain.node.coordination.board import Board
from fabtrain.node.coordination.restart import RestartPolicy
from fabtrain.plan.plan import make_plan
from tests.conftest import FAB, REPO

POLICY = RestartPolicy(enabled=True, max_restarts=5, backoff=1.0, exit_codes=None, grace=1.0)
CONFIG = Config(node="n1", job_id="J", interval=1.0, hang_timeout=3.0, startup_timeout=60.0, grace=2.0,
                on_failure="restart", coordinator_node="n1", coordinator="10.0.0.1:7180")


def rec(step, ts, **kw):
    return {"ts": ts, "step": step, "rank": 0, "source": "auto", "framework": "torch", **kw}


def saved(step, at, path="out/ckpt.pt"):
    return {"ckpt_step": step, "ckpt_at": at, "ckpt_path": path, "ckpt_bytes": 1 << 30, "ckpt_seconds": 3.1}


def context(generation, records, before=None, ended_at=None, exit_code=None, log=None, first=100.0):
    """A process context as the supervisor leaves it: its ranks fed the records, as the agent reads them."""
    progress = Progress(floor=0.0)
    progress.take([__import__("json").dumps(r).encode() for r in records], first)
    progress.first_record = first if records else None
    return SimpleNamespace(name="trainer-0", role="trainer", rank=0, generation=generation, before=before,
                           resumed=None, load_failure=None, progress=progress, ended=ended_at is not None,
                           ended_at=ended_at, exit_code=exit_code, close_reason=None, log_path=log,
                           record={"started_at": 90.0})


def test_a_restart_says_what_it_resumed_from_and_the_steps_lost():
    g0 = context(0, [rec(1200, 1000.0, checkpoint="saved", between_steps=True, **saved(1200, 1000.0)),
                     rec(1510, 1840.0, **saved(1200, 1000.0))], ended_at=1840.0, exit_code=137)
    g1 = context(1, [rec(1, 1900.0, resumed_from="out/ckpt.pt")], before=checkpoints.summary(g0))
    text, fields = checkpoints.resumed(g1)
    assert text == "generation 1 resumed from out/ckpt.pt (step 1200, saved 14 min before the failure): 310 steps lost"
    assert (fields["steps_lost"], fields["ckpt_step"]) == (310, 1200)
    assert checkpoints.resumed(g1) is None  # said once
    # The next failure, before any newer save: all of generation 1's steps are lost (its own count from 0).
    g1.ended, g1.ended_at = True, 1960.0
    g1.progress.take([b'{"ts": 1960.0, "step": 40, "rank": 0, "source": "auto", "framework": "torch"}'], 1960.0)
    g2 = context(2, [rec(1, 2000.0, resumed_from="out/ckpt.pt")], before=checkpoints.summary(g1))
    assert checkpoints.resumed(g2)[0].endswith("saved 16 min before the failure): 40 steps lost")
    # No load seen: it started from step 0, and every step of the one before is lost.
    g3 = context(3, [rec(1, 2100.0)], before=checkpoints.summary(g2))
    assert checkpoints.resumed(g3)[0] == "generation 3 loaded no checkpoint: it started from step 0 (1 steps of generation 2 lost)"
    health = checkpoints.health_fields(g0)
    assert (health["step"], health["ckpt_step"], health["ckpt_path"]) == (1510, 1200, "out/ckpt.pt")


def test_a_failure_in_a_load_names_the_newest_checkpoint_saved_before(tmp_path):
    g0 = context(0, [rec(20, 50.0, **saved(20, 50.0, "a.pt")), rec(30, 60.0, **saved(30, 60.0, "b.pt"))],
                 ended_at=61.0, exit_code=1)
    log = tmp_path / "t.log"
    log.write_text("step 30\n==== fabtrain: restart 1 (FABTRAIN_RESTART_COUNT=1) at now: failed ====\n"
                   "Traceback (most recent call last):\n  File \"/x/ck.py\", line 8, in <module>\n"
                   "  File \"/j/stacks/hook/_fabtrain_progress_frameworks.py\", line 192, in load\n"
                   "  File \"/v/torch/serialization.py\", line 1568, in load\n"
                   "RuntimeError: PytorchStreamReader failed reading zip archive\n")
    g1 = context(1, [], before=checkpoints.summary(g0), ended_at=70.0, exit_code=1, log=str(log))
    assert checkpoints.load_failure(g1) == ("b.pt", 30, None, ("a.pt", 20))  # (the one before it: previous)
    assert checkpoints.summary(g1)["loaded"] == "b.pt"
    # Before the marker, or no load in the traceback: not a load's failure.
    log.write_text("Traceback (most recent call last):\n  File \"/v/torch/serialization.py\", line 1, in load\n"
                   "==== fabtrain: restart 2 (FABTRAIN_RESTART_COUNT=2) at now: failed ====\n"
                   "Traceback (most recent call last):\n  File \"/x/ck.py\", line 9, in <module>\nKeyError: 'x'\n")
    assert checkpoints.load_failure(context(2, [], before=checkpoints.summary(g1), ended_at=80.0, exit_code=1,
                                            log=str(log))) is None
    # Records that say what it resumed from: a failure soon after its first step is one; a later one is not.
    soon = context(1, [rec(3, 101.0, resumed_from="b.pt")], before=checkpoints.summary(g0), ended_at=104.0, exit_code=1)
    assert checkpoints.load_failure(soon) == ("b.pt", 30, 4.0, ("a.pt", 20))
    late = context(1, [rec(3, 101.0, resumed_from="b.pt")], before=checkpoints.summary(g0), ended_at=900.0, exit_code=1)
    assert checkpoints.load_failure(late) is None


def beat(b, now, generation=0, failure=None):
    msg = {"node": "n1", "procs": {"trainer-0": {"role": "trainer", "state": "running"}}, "generation": generation}
    if failure:
        msg["failure"] = failure
    return b.beat(msg, now, 1000 + now)


def failure(generation, loaded=None):
    return {"reason": "trainer-0 on n1 exited with code 1", "kind": "exit", "exit_code": 1,
            "generation": generation, "loaded": loaded}


def test_two_generations_in_a_row_failing_after_loading_one_file_stop_the_restarts():
    b = Board("J", ["n1"], 5.0, POLICY)
    beat(b, 0)
    beat(b, 1, 0, failure(0))  # a plain crash: restarted
    beat(b, 3, 1)
    beat(b, 4, 1, failure(1, {"path": "out/ckpt.pt", "step": 1200, "after": None}))
    assert b.status["status"] == "restarting" and b.status["generation"] == 2  # once may be anything
    beat(b, 8, 2)
    beat(b, 9, 2, failure(2, {"path": "out/ckpt.pt", "step": 1200, "after": 4.0}))
    assert b.status["status"] == "failed"
    assert b.status["reason"] == ("trainer-0 on n1 exited with code 1; generation 1 and 2 failed 4 s after loading "
                                  "out/ckpt.pt (step 1200): the checkpoint may be damaged; not restarted")
    # Another file each time (a program that falls back to an older one), or a hang: restarted as before.
    other = {"path": "out/ckpt-1100.pt", "step": 1100, "after": None}
    assert POLICY.decide(failure(2, other), 2, {"path": "out/ckpt.pt"}).restart
    assert POLICY.decide(dict(failure(2, other), kind="hang"), 2, other).restart
    both = POLICY.decide(failure(2, other), 2, other)
    assert both.why_not == "generation 1 and 2 failed loading out/ckpt-1100.pt (step 1100): the checkpoint may be damaged"


class Co:
    def __init__(self, procs):
        self.lock = threading.Lock()
        self.board = SimpleNamespace(peers={"n1": SimpleNamespace(procs=procs)}, out=())


def test_no_checkpoint_for_longer_than_the_setting_is_one_event_until_a_newer_one():
    said = []
    events = SimpleNamespace(write=lambda kind, reason, name=None, **f: said.append((str(kind), reason, name)))
    rule = checkpoints.NoCheckpoint({"no_checkpoint": 600}, events)
    running = Ledger(status=Status("running"))
    procs = {"trainer-0": {"role": "trainer", "state": "running", "since": 1000.0, "ckpt": None}}
    rule.check(Co(procs), running, 1500.0)
    rule.check(Co(procs), running, 1700.0)
    assert said == [("no_checkpoint", "no checkpoint for 12 min (job.watchdog.no_checkpoint: 10 min): none written "
                                      "since generation 0's first step", None)]
    procs["trainer-0"]["ckpt"] = {"at": 1800.0, "step": 1200, "path": "out/ckpt.pt"}
    rule.check(Co(procs), running, 2300.0)
    assert len(said) == 1
    rule.check(Co(procs), running, 2500.0)
    assert said[-1][1] == ("no checkpoint for 12 min (job.watchdog.no_checkpoint: 10 min): the last was trainer-0's "
                           "on n1, step 1200 (out/ckpt.pt)") and said[-1][2] == "trainer-0"
    rule.check(Co(procs), Ledger(status=Status("restarting")), 9000.0)
    assert len(said) == 2
    assert checkpoints.NoCheckpoint({}, events).limit is None


GOOD = {"cluster": {"name": "c"}, "nodes": [{"name": "n1", "host": "local", "roles": ["trainer"]}],
        "job": {"mode": "collective", "watchdog": {"no_checkpoint": 1800, "notify": {"command": ["true"]}}}}


def test_the_setting_reaches_the_agents_and_asks_for_its_alert(tmp_path):
    cluster = parse_cluster(GOOD, "c.yaml")
    assert cluster.job.watchdog.no_checkpoint == 1800.0
    assert cluster.job.watchdog.notify.on[-1] == "no_checkpoint"
    w = make_plan(cluster, "20261128-000000-abcd").watchdog
    assert w["no_checkpoint"] == 1800.0 and "no_checkpoint" in w["notify"]["on"]
    chosen = parse_cluster({**GOOD, "job": {"mode": "collective", "watchdog": {
        "no_checkpoint": 60, "notify": {"command": ["true"], "on": ["failed"]}}}}, "c.yaml")
    assert chosen.job.watchdog.notify.on == ("failed",)
    p = tmp_path / "c.yaml"
    p.write_text("cluster: {name: c}\nnodes: [{name: a, host: local, roles: [trainer]}]\n"
                 "job:\n  mode: collective\n  watchdog:\n    no_checkpoint: 30m\n")
    out = subprocess.run([FAB, "plan"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "FABTRAIN_CLUSTER": str(p)})
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip() == f"fab plan: {p}: job.watchdog.no_checkpoint: must be a number, got a string (line 6)"


@pytest.mark.parametrize("seconds,text", [(0.002, "2 ms"), (0.4, "0.4 s"), (4, "4 s"), (840, "14 min"),
                                          (9000, "2.5 h")])
def test_durations_read_as_a_person_says_them(seconds, text):
    assert words.seconds_text(seconds) == text


def test_the_views_say_the_last_checkpoint_and_the_work_at_risk():
    last = rec(1510, 1840.0, **saved(1200, 1000.0))
    v = views.view(last, 1840.0)
    assert (v["steps_since"], v["seconds_since"], v["bytes"]) == (310, 840.0, 1 << 30)
    assert v["text"] == ("step 1200, 14 min ago, 1.0 GiB in 3.1 s (out/ckpt.pt); a failure now loses 310 steps, "
                         "14 min")
    assert views.cell(last, 1840.0) == "1200 (14 min ago, 1.0 GiB, in 3.1 s), +310 steps"
    assert views.view(rec(5, 1.0), 2.0) is None and views.cell(rec(5, 1.0), 2.0) == "-"
    health = {"processes": [{"name": "trainer-0", "role": "trainer", "state": "exited", "step": 1510,
                             **saved(1200, 1000.0), "resumed": "generation 1 resumed from x"}]}
    assert views.health_lines([("n1", health, 1840.0)]) == [
        "checkpoint: trainer-0 on n1: step 1200, 14 min ago, 1.0 GiB in 3.1 s (out/ckpt.pt)"]  # ended: nothing at risk
    assert views.resumed_lines([("n1", health)]) == ["trainer-0 on n1: generation 1 resumed from x"]


# -- on_bad_checkpoint: previous, FABTRAIN_RESUME_FROM, and the hook's word on a load ---------------------------

PREVIOUS = RestartPolicy(enabled=True, max_restarts=5, backoff=1.0, exit_codes=None, grace=1.0,
                         on_bad_checkpoint="previous")
TORN = {"path": "out/ckpt-1200.pt", "step": 1200, "after": None, "previous": {"path": "out/ckpt-1000.pt", "step": 1000}}


def test_on_bad_checkpoint_previous_restarts_once_more_from_the_checkpoint_before_the_damaged_one():
    b = Board("J", ["n1"], 5.0, PREVIOUS)
    beat(b, 0)
    beat(b, 1, 0, failure(0))
    beat(b, 3, 1)
    beat(b, 4, 1, failure(1, TORN))
    assert b.status["status"] == "restarting" and "resume_from" not in b.status  # once may be anything
    beat(b, 8, 2)
    beat(b, 9, 2, failure(2, TORN))
    said = ("generation 3 resumes from out/ckpt-1000.pt, the checkpoint before out/ckpt-1200.pt, which generation 1 "
            "and 2 failed loading")
    assert b.status["status"] == "restarting" and b.status["generation"] == 3, b.status
    assert b.status["reason"] == "trainer-0 on n1 exited with code 1; " + said
    assert b.status["resume_from"] == {"generation": 3, "path": "out/ckpt-1000.pt", "step": 1000,
                                       "instead_of": "out/ckpt-1200.pt", "failed": [1, 2], "after": None, "text": said}
    # Every node's agent takes it with the restart (its FABTRAIN_RESUME_FROM), the restarting event says it.
    notes, ledger = on_status(b.status_line(), "J", Ledger(status=Status("running")), CONFIG, 100.0)
    assert ledger.resume == b.status["resume_from"] and said in notes[0].reason
    assert notes[0].fields["resume_from"]["path"] == "out/ckpt-1000.pt"
    beat(b, 12, 3)
    assert b.status["status"] == "running" and "resume_from" not in b.status
    # The same file after the fallback too: generation 3 loaded another one, so this is once again.
    beat(b, 13, 3, failure(3, {"path": "out/ckpt-1000.pt", "step": 1000, "after": 2.0, "previous": None}))
    assert b.status["status"] == "restarting" and "resume_from" not in b.status


def test_on_bad_checkpoint_previous_with_nothing_before_it_or_no_restart_left_fails_the_job_saying_why():
    one_file = {"path": "out/ckpt.pt", "step": 20, "after": None, "previous": None}  # a program that overwrites one file
    d = PREVIOUS.decide(failure(2, one_file), 2, one_file)
    assert not d.restart and d.failed("trainer-0 on n1 exited with code 1") == (
        "trainer-0 on n1 exited with code 1; generation 1 and 2 failed loading out/ckpt.pt (step 20): the checkpoint "
        "may be damaged and there is no checkpoint before it to fall back to; not restarted")
    spent = PREVIOUS.decide(failure(5, TORN), 5, TORN)
    assert not spent.restart and spent.failed("x") == (
        "x; generation 4 and 5 failed loading out/ckpt-1200.pt (step 1200): the checkpoint may be damaged; "
        "out/ckpt-1000.pt (the checkpoint before it) is not tried: max_restarts (5) spent; not restarted")
    # The previous is either generation's word (the agent that failed first may know it alone); `after` says when.
    d = PREVIOUS.decide(failure(2, dict(TORN, previous=None, after=3.0)), 2, TORN)
    assert d.restart and d.resume["path"] == "out/ckpt-1000.pt" and d.resume["text"] == (
        "generation 3 resumes from out/ckpt-1000.pt, the checkpoint before out/ckpt-1200.pt, which generation 1 and 2 "
        "failed 3 s after loading")
    assert POLICY.decide(failure(2, TORN), 2, TORN).damaged  # stop, the default: as before


def test_the_setting_is_checked_in_one_line_and_reaches_the_agents(tmp_path):
    w = make_plan(parse_cluster(GOOD, "c.yaml"), "20261128-000000-abcd").watchdog
    assert "on_bad_checkpoint" not in w and RestartPolicy.from_watchdog(w).on_bad_checkpoint == "stop"
    chosen = {**GOOD, "job": {"mode": "collective", "watchdog": {"on_failure": "restart", "on_bad_checkpoint": "previous"}}}
    w = make_plan(parse_cluster(chosen, "c.yaml"), "20261128-000000-abcd").watchdog
    assert w["on_bad_checkpoint"] == "previous" and RestartPolicy.from_watchdog(w).on_bad_checkpoint == "previous"
    with pytest.raises(ValueError, match="on_bad_checkpoint must be one of stop, previous, got 'older'"):
        RestartPolicy.from_watchdog(dict(w, on_bad_checkpoint="older"))
    p = tmp_path / "c.yaml"
    p.write_text("cluster: {name: c}\nnodes: [{name: a, host: local, roles: [trainer]}]\n"
                 "job:\n  mode: collective\n  watchdog:\n    on_failure: restart\n    on_bad_checkpoint: older\n")
    out = subprocess.run([FAB, "plan"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "FABTRAIN_CLUSTER": str(p)})
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip() == (f"fab plan: {p}: job.watchdog.on_bad_checkpoint: must be one of stop, previous, "
                                  f"got 'older' (line 7)")


def test_a_restarted_process_resumes_from_its_newest_checkpoint_never_a_damaged_one():
    g0 = context(0, [rec(10, 50.0, **saved(10, 50.0, "ckpt-10.pt")), rec(20, 60.0, **saved(20, 60.0, "ckpt-20.pt"))],
                 ended_at=61.0, exit_code=1)
    before = checkpoints.summary(g0)
    assert checkpoints.resume_path(before) == "ckpt-20.pt" and checkpoints.resume_path(None) is None
    assert checkpoints.previous(before, "ckpt-20.pt") == ("ckpt-10.pt", 10)
    assert checkpoints.previous(before, "ckpt-10.pt") is None and checkpoints.previous(before, "elsewhere.pt") is None
    # relaunch.py: the variable, for a plain restart and for the fallback (a trainer, whatever it saved itself)
    ctx = SimpleNamespace(role="trainer", before=dict(before))
    assert resume_env(ctx, {"A": "1"}, None) == {"A": "1", "FABTRAIN_RESUME_FROM": "ckpt-20.pt"}
    fallback = {"generation": 3, "path": "ckpt-10.pt", "step": 10, "instead_of": "ckpt-20.pt", "failed": [1, 2],
                "after": None, "text": "..."}
    ctx = SimpleNamespace(role="trainer", before=dict(before, damaged=[]))
    assert resume_env(ctx, {}, fallback) == {"FABTRAIN_RESUME_FROM": "ckpt-10.pt"}
    assert ctx.before["damaged"] == ["ckpt-20.pt"] and ctx.before["pointed"] == "ckpt-10.pt"
    pserver = SimpleNamespace(role="pserver", before={"saves": {}, "damaged": [], "loaded": None})
    assert resume_env(pserver, {}, fallback) == {}  # it saved nothing: none named (generation 0: never set)
    # The generation that resumed from it says so; the damaged file stays out until it is saved anew.
    g3 = context(3, [rec(1, 100.0, resumed_from="ckpt-10.pt"), rec(5, 101.0, **saved(5, 101.0, "ckpt-15.pt"))],
                 before=ctx.before, ended_at=102.0, exit_code=1)
    assert checkpoints.resumed(g3)[0] == ("generation 3 resumed from ckpt-10.pt (step 10, saved 11 s before the "
                                          "failure), the checkpoint before ckpt-20.pt, which generation 1 and 2 "
                                          "failed loading: 10 steps lost")
    after = checkpoints.summary(g3)
    assert after["damaged"] == ["ckpt-20.pt"] and checkpoints.resume_path(after) == "ckpt-15.pt"
    only_damaged = dict(after, saves={"ckpt-20.pt": (20, 60.0, 0)})
    assert checkpoints.resume_path(only_damaged) == "ckpt-10.pt"  # then what the generation before loaded
    assert checkpoints.resume_path(dict(only_damaged, loaded="ckpt-20.pt")) is None
    g4 = context(4, [rec(25, 200.0, **saved(20, 200.0, "ckpt-20.pt"))], before=after, ended_at=201.0, exit_code=1)
    assert checkpoints.summary(g4)["damaged"] == [] and checkpoints.resume_path(checkpoints.summary(g4)) == "ckpt-20.pt"
    # An async save that had not landed when its generation ended is never resumed from.
    torn = context(0, [rec(30, 70.0, **saved(30, 70.0, "dcp-30"), ckpt_async=True)], ended_at=71.0, exit_code=1)
    assert checkpoints.resume_path(checkpoints.summary(torn)) is None


def hooked(tmp_path, steps=0):
    """The hook's reporter as the load wrappers see it (progress_frameworks is the hook's own source)."""
    import fabtrain.node.progress as progress
    r = progress.Reporter({progress.ENV_METRICS: str(tmp_path / "trainer-0.jsonl"), "RANK": "0"})
    r.steps = steps
    return r


def lines(path):
    return [__import__("json").loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_the_hook_writes_each_load_before_the_first_step_beside_the_records_and_never_changes_it(tmp_path):
    from fabtrain.contract.jobfolder import LOAD
    from fabtrain.node import progress_frameworks as frameworks
    side = tmp_path / ("trainer-0.jsonl" + LOAD)  # where the agent reads it (the hook has its own copy of the name)
    r = hooked(tmp_path)
    torn = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")

    def bad(f, **kw):
        raise torn
    load = frameworks._loads(r, bad)
    with pytest.raises(RuntimeError) as raised:
        load("out/ckpt-20.pt", weights_only=True)
    assert raised.value is torn and raised.traceback[-1].name == "bad"  # the program's own exception, untouched
    (line,) = lines(side)
    assert (line["load"], line["path"], line["rank"], line["error"]) == (
        "failed", "out/ckpt-20.pt", 0, "RuntimeError: " + str(torn))
    assert "resumed_from" not in r.values and not (tmp_path / "trainer-0.jsonl").exists()  # no record: startup rule
    good = frameworks._loads(r, lambda f: {"step": 10})
    assert good("out/ckpt-10.pt") == {"step": 10}
    assert lines(side)[-1]["load"] == "loaded" and r.values["resumed_from"] == "out/ckpt-10.pt"
    late = frameworks._loads(hooked(tmp_path, steps=3), bad)
    with pytest.raises(RuntimeError):
        late("out/ckpt-30.pt")
    assert len(lines(side)) == 2  # after the first step a load is not looked at
    # Nowhere to write: the hook says so once and stops; the program's load goes on.
    gone = hooked(tmp_path / "no-such-dir")
    assert frameworks._loads(gone, lambda f: 7)("x.pt") == 7 and gone.failed


def test_the_agent_takes_the_hooks_word_on_a_load_over_the_traceback(tmp_path):
    g0 = context(0, [rec(10, 50.0, **saved(10, 50.0, "ckpt-10.pt")), rec(20, 60.0, **saved(20, 60.0, "ckpt-20.pt"))],
                 ended_at=61.0, exit_code=1)
    metrics = tmp_path / "trainer-0.jsonl"
    side = tmp_path / "trainer-0.jsonl.load"
    log = tmp_path / "t.log"
    log.write_text("Segmentation fault\n")  # no traceback at all
    side.write_text('{"ts": 65.0, "pid": 7, "rank": 0, "path": "ckpt-20.pt", "load": "failed", "error": "E: x"}\n')
    g1 = context(1, [], before=checkpoints.summary(g0), ended_at=70.0, exit_code=1, log=str(log))
    g1.metrics_path = str(metrics)
    assert checkpoints.load_failure(g1) == ("ckpt-20.pt", 20, None, ("ckpt-10.pt", 10))
    assert checkpoints.as_beat(g1.load_failure)["previous"] == {"path": "ckpt-10.pt", "step": 10}
    # It loaded, then failed before its first step: 5 s after loading; another rank's failed load wins.
    side.write_text('{"ts": 65.0, "pid": 7, "rank": 0, "path": "ckpt-20.pt", "load": "loaded"}\n')
    g1.load_failure = None
    assert checkpoints.load_failure(g1) == ("ckpt-20.pt", 20, 5.0, ("ckpt-10.pt", 10))
    with side.open("a") as f:
        f.write('{"ts": 66.0, "pid": 8, "rank": 1, "path": "ckpt-20.pt", "load": "failed"}\n'
                '{"ts": 66.5, "pid": 7, "rank": 0, "path": "data.pt", "load": "loaded"}\n')
    assert checkpoints.last_load(str(metrics))["pid"] == 8
    # Long after its load (it failed in something else, later), or no failure: not a load's failure.
    side.write_text('{"ts": 65.0, "pid": 7, "rank": 0, "path": "ckpt-20.pt", "load": "loaded"}\n')
    g1.load_failure, g1.ended_at = None, 65.0 + checkpoints.LOAD_WINDOW + 1
    assert checkpoints.load_failure(g1) is None
    assert checkpoints.summary(g1)["loaded"] == "ckpt-20.pt"
