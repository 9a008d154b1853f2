"""The rank to blame at a hang (coordination/blame.py, pure) and what feeds it: a stack file's main
thread and collective (agent/stacks.py), and each rank's steps in a metrics file (agent/supervisor.py)."""
import json
import os
from pathlib import Path

import pytest

from fabtrain.node.agent import stacks
from fabtrain.node.agent.supervisor import Progress
from fabtrain.node.coordination import blame
from fabtrain.node.coordination.blame import RankView

C10D = "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py:2811 in all_reduce"


def rank(r, step=412, frame=C10D, collective="all_reduce", node="node1", why=None, name=None):
    return RankView(node, name or "trainer-%d" % r, r, step, frame, collective, why)


def test_the_rank_outside_the_collective_is_named_with_its_node_step_and_frame():
    views = [rank(0), rank(1), rank(2, frame="/w/loader.py:88 in __getitem__", collective=None, node="node3"),
             rank(3, node="node2")]
    found = blame.judge(views)
    assert [v.rank for v in found.ranks] == [2]
    assert found.sentence == ("rank 2 on node3 stopped stepping at step 412 in `loader.py:88 in __getitem__`; "
                              "ranks 0, 1, 3 wait in all_reduce")


def test_a_stopped_rank_that_cannot_answer_is_named():
    views = [rank(0), rank(1, frame=None, collective=None, why="no stack: pid 9 is stopped (SIGSTOP) and cannot answer")]
    found = blame.judge(views)
    assert [v.rank for v in found.ranks] == [1]
    assert found.sentence == "rank 1 on node1 is stopped at step 412 (stopped (SIGSTOP)); rank 0 waits in all_reduce"


def test_without_stacks_the_rank_behind_in_steps_is_named():
    views = [rank(0, step=40, frame=None, collective=None, why="no stack: pid 1 installed no stack handler"),
             rank(1, step=39, frame=None, collective=None, why="no stack: pid 2 installed no stack handler"),
             rank(2, step=40, frame=None, collective=None, why="no stack: pid 3 installed no stack handler")]
    found = blame.judge(views)
    assert [v.rank for v in found.ranks] == [1]
    assert found.sentence.startswith("rank 1 on node1 stopped stepping at step 39 (no stack: pid 2 ")
    assert found.sentence.endswith("; ranks 0, 2 reached step 40")


def test_ranks_that_all_wait_alike_name_nobody():
    found = blame.judge([rank(0), rank(1), rank(2)])
    assert found.ranks == () and found.sentence == "no rank stands out: ranks 0, 1, 2 wait in all_reduce at step 412"
    found = blame.judge([rank(0, frame="/w/t.py:3 in f", collective=None),
                         rank(1, frame="/w/t.py:3 in f", collective=None)])
    assert found.ranks == () and found.sentence == "no rank stands out: ranks 0, 1 stopped stepping at step 412"
    assert blame.judge([]).sentence == ""


def test_a_beat_carries_the_views_and_malformed_rows_are_left_out():
    views = [rank(0), rank(2, frame=None, collective=None, why="no stack")]
    rows = blame.to_beat(views)
    assert blame.from_beat("node1", rows + [["x"], "y", [1, 2, 3, 4, 5, 6]]) == views
    assert blame.from_beat("node1", "not a list") == []


def test_views_of_a_dump_pair_each_rank_with_its_last_step():
    dumped = {"trainer-0": {"frame": C10D, "ranks": [{"pid": 10, "rank": 0, "frame": C10D, "collective": "all_reduce"},
                                                     {"pid": 11, "rank": 1, "why": "no stack: x"}]},
              "trainer-1": {"frame": "/w/a.py:1 in f", "ranks": [{"pid": 12, "rank": 2, "frame": "/w/a.py:1 in f"}]}}
    views = blame.views_of("n", dumped, {"trainer-0": {0: 5, 1: 4}, "trainer-1": {None: 7}})
    assert [(v.name, v.rank, v.step, v.collective) for v in views] == [
        ("trainer-0", 0, 5, "all_reduce"), ("trainer-0", 1, 4, None), ("trainer-1", 2, 7, None)]


STACK = """fabtrain: trainer-0 pid 12 rank 1
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait
  File "/usr/lib/python3.12/threading.py", line 1000 in _bootstrap

Current thread 0x00007f0000000000 (most recent call first):
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 2811 in all_reduce
  File "/v/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/w/train.py", line 40 in main
  File "/w/train.py", line 50 in <module>
"""


def test_a_stack_file_gives_the_main_threads_top_frame_and_its_collective():
    frames = stacks.main_frames(STACK)
    assert stacks.top_frame(STACK) == "/v/site-packages/torch/distributed/distributed_c10d.py:2811 in all_reduce"
    assert stacks.collective(frames) == "all_reduce"
    assert stacks.collective(stacks.main_frames('  File "/w/loader.py", line 88 in __getitem__\n')) is None


# Stack files that real processes dumped (faulthandler, all threads), their paths shortened: the ranks of 3-rank DDP
# jobs on gloo (tests/programs/ddp_stuck.py under fabtrain, tests/local/test_backward_blame.py; the first line is
# the agent's) and of FSDP jobs on gloo (fully_shard and FullyShardedDataParallel, rank 1 spinning).
STACKS = Path(__file__).parent.parent / "data" / "stacks"
WHERE = [  # file, what the main thread waits in (None: it does not wait for the others), where it stands
    ("ddp-backward.txt", "backward", "graph.py:979 in _engine_run_backward"),  # DDP's reducer, from C++
    ("skip-goes-on-to-backward.txt", "backward", "graph.py:979 in _engine_run_backward"),
    ("skip-others-all-reduce.txt", "all_reduce", "distributed_c10d.py:3252 in all_reduce"),
    ("fsdp1-forward-all-gather.txt", "all_gather", "distributed_c10d.py:4287 in all_gather"),
    ("fsdp2-forward-all-gather.txt", "all_gather_single", "distributed_c10d.py:4394 in all_gather_single"),
    ("fsdp2-backward-all-gather.txt", "all_gather_single", "distributed_c10d.py:4394 in all_gather_single"),
    ("ddp-spin.txt", None, "ddp_stuck.py:61 in spin_forever"),
    ("fifo.txt", None, "ddp_stuck.py:65 in read_fifo"),  # asleep in open() (state S)
    ("dataloader-waits-for-its-worker.txt", None, "dataloader.py:1291 in _try_get_data"),  # not selectors.py
    ("dataloader-inline-getitem.txt", None, "ddp_stuck.py:51 in __getitem__"),  # not threading.py's wait
]


@pytest.mark.parametrize("name, waits_in, where", WHERE)
def test_real_stacks_say_whether_the_rank_waits_for_the_others_and_where_it_stands(name, waits_in, where):
    text = (STACKS / name).read_text()
    assert stacks.collective(stacks.main_frames(text)) == waits_in
    assert blame.short(stacks.top_frame(text)) == where


def test_frames_that_only_pass_a_call_on_are_looked_through_and_only_the_innermost_count():
    text = (STACKS / "ddp-backward.txt").read_text()
    user = '  File "/ws/code/train.py", line 77 in <module>'
    hooked = '  File "/ws/jobs/J/stacks/hook/_fabtrain_progress_frameworks.py", line 47 in backward\n'
    head, _, tail = text.rpartition('  File "/ws/jobs/')  # the main thread's last frame: the program's
    wrapped = stacks.main_frames(head + hooked + '  File "/ws/jobs/' + tail)
    assert wrapped[3][2] == "backward" and stacks.collective(wrapped) == "backward"
    # the hook's callback that marks the end of the backward's computation, caught running inside the engine
    callback = '  File "/ws/jobs/J/stacks/hook/_fabtrain_progress_frameworks.py", line 130 in mark\n'
    current = text.index("Current thread")
    first = text.index("\n", current) + 1
    inside = stacks.main_frames(text[:first] + callback + text[first:])
    assert inside[0][2] == "mark" and stacks.collective(inside) == "backward"
    # A rank running its model's forward inside FSDP's (or DDP's) forward, or inside torch.distributed.elastic's
    # `record`, does not wait for anyone: the frames outward of its own code do not count.
    fsdp = (STACKS / "fsdp1-forward-all-gather.txt").read_text().splitlines()
    at = next(i for i, line in enumerate(fsdp) if "fully_sharded_data_parallel.py" in line)
    model = ['  File "/ws/code/model.py", line 12 in spin_forever', '  File "/ws/code/model.py", line 20 in forward',
             '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789 in _call_impl']
    assert stacks.collective(stacks.main_frames("\n".join(fsdp[:1] + model + fsdp[at:]))) is None
    elastic = ['  File "/ws/code/train.py", line 5 in main',
               '  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/'
               '__init__.py", line 367 in wrapper', user]
    assert stacks.collective(stacks.main_frames("\n".join(elastic))) is None
    # a DDP's forward waiting in its buffers' broadcast; a forward of torch's own modules under it is not
    ddp = ['  File "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 2010 in '
           '_default_broadcast_coalesced',
           '  File "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1960 in _sync_buffers',
           '  File "/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1600 in forward', user]
    assert stacks.collective(stacks.main_frames("\n".join(ddp))) == "_default_broadcast_coalesced"
    linear = '  File "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 134 in forward'
    assert stacks.collective(stacks.main_frames("\n".join([linear] + ddp[2:]))) is None
    # torch.distributed.checkpoint writing its files is not waiting; its collectives are
    dcp = ('  File "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/filesystem.py", line 300 in '
           '_write_item')
    assert stacks.collective(stacks.main_frames("\n".join([dcp, user]))) is None


def views_of_files(*names):
    out = []
    for r, name in enumerate(names):
        text = (STACKS / name).read_text()
        waits_in = stacks.collective(stacks.main_frames(text))
        out.append(RankView("n0", "trainer-%d" % r, r, 10, stacks.top_frame(text), waits_in))
    return out


@pytest.mark.parametrize("stuck, frame", [
    ("ddp-spin.txt", "ddp_stuck.py:61 in spin_forever"), ("fifo.txt", "ddp_stuck.py:65 in read_fifo"),
    ("dataloader-waits-for-its-worker.txt", "dataloader.py:1291 in _try_get_data")])
def test_the_rank_the_others_wait_for_in_backward_is_named(stuck, frame):
    found = blame.judge(views_of_files("ddp-backward.txt", stuck, "ddp-backward.txt"))
    assert [v.rank for v in found.ranks] == [1]
    assert found.sentence == "rank 1 on n0 stopped stepping at step 10 in `%s`; ranks 0, 2 wait in backward" % frame


def test_a_rank_that_skipped_a_collective_and_waits_in_the_next_one_is_named_where_the_others_are_not():
    found = blame.judge(views_of_files("skip-others-all-reduce.txt", "skip-goes-on-to-backward.txt",
                                       "skip-others-all-reduce.txt"))
    assert [v.rank for v in found.ranks] == [1]
    assert found.sentence == ("rank 1 on n0 stopped stepping at step 10 waiting in backward, where the others are not "
                              "(`graph.py:979 in _engine_run_backward`); ranks 0, 2 wait in all_reduce")
    # ... also when its step is ahead of theirs (the collective it skipped came before its optimizer's step)
    views = [rank(0, step=9), rank(1, step=10, frame="/v/torch/autograd/graph.py:979 in _engine_run_backward",
                                   collective="backward"), rank(2, step=9), rank(3, step=9)]
    found = blame.judge(views)
    assert [v.rank for v in found.ranks] == [1]
    assert found.sentence.endswith("; ranks 0, 2, 3 wait in all_reduce at step 9"), found.sentence
    # Two ranks, each waiting in another place: either may have gone astray; the steps rule as before.
    found = blame.judge(views[:2])
    assert [v.rank for v in found.ranks] == [0]
    # Every rank in backward: nobody stands out.
    everyone = blame.judge(views_of_files("ddp-backward.txt", "ddp-backward.txt", "ddp-backward.txt"))
    assert everyone.ranks == () and everyone.sentence == "no rank stands out: ranks 0, 1, 2 wait in backward at step 10"


def test_rank_processes_are_the_topmost_of_each_rank_and_a_launcher_is_not_one(monkeypatch):
    # torchrun (RANK 0 from fabtrain) with two workers, RANK 0 and 1; worker 1 forked a DataLoader worker
    env = {1: b"RANK=0\0LOCAL_RANK=0\0", 2: b"RANK=0\0LOCAL_RANK=0\0TORCHELASTIC_RUN_ID=x\0",
           3: b"RANK=1\0LOCAL_RANK=1\0TORCHELASTIC_RUN_ID=x\0", 4: b"RANK=1\0LOCAL_RANK=1\0TORCHELASTIC_RUN_ID=x\0"}
    parents = {1: 0, 2: 1, 3: 1, 4: 3}
    monkeypatch.setattr(stacks.procfs, "stat", lambda pid: type("P", (), {"ppid": parents[pid]})())
    assert stacks.rank_processes([1, 2, 3, 4], environ=env.get) == {2: 0, 3: 1}
    # a plain program (no launcher between): the program is its rank
    assert stacks.rank_processes([1], environ=env.get) == {1: 0}


def write(path, t, *records):
    """Append records as written at time t (the file's mtime: when the agent counts them)."""
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.utime(path, (t, t))


def test_a_rank_that_stops_stepping_stalls_its_process_though_another_rank_writes(tmp_path):
    path, p = str(tmp_path / "m.jsonl"), Progress(floor=0)
    write(path, 100, {"rank": 0, "step": 1, "source": "auto"}, {"rank": 1, "step": 1, "source": "auto"})
    p.records(path)
    assert p.last_record == 100
    write(path, 101, {"rank": 0, "step": 2, "source": "auto"}, {"rank": 1, "step": 1, "source": "auto"})
    p.records(path)  # rank 1 wrote the same step again: no progress for it, so none for the process
    assert p.last_record == 100 and p.ranks[0].changed == 101
    write(path, 102, {"rank": 1, "step": 2, "source": "auto", "data_time": 0.5, "comm_time": 0.01})
    p.records(path)
    assert p.last_record == 101 and p.ranks[1].step == 2
    assert p.ranks[1].mean_timings() == {"data_time": 0.5, "comm_time": 0.01}
    # a program's own records (no source) are progress by being written, the same step or not
    write(path, 103, {"rank": 0, "step": 2}, {"rank": 1, "step": 2})
    p.records(path)
    assert p.last_record == 103
    # a rank whose process has ended is not watched (a torchrun whose rank 1 finished)
    p.live_ranks = {0}
    write(path, 104, {"rank": 0, "step": 3, "source": "auto"})
    p.records(path)
    assert p.last_record == 104
    # a record cut in two by the reader is taken once it is whole
    with open(path, "a") as f:
        f.write('{"rank": 0, "step": 4, "sou')
    os.utime(path, (105, 105))
    p.records(path)
    assert p.ranks[0].step == 3
    write(path, 106, {"rank": 9})  # ends the cut record ('rce' missing: not JSON... it is left out)
    with open(path, "a") as f:
        f.write(json.dumps({"rank": 0, "step": 5, "source": "auto"}) + "\n")
    os.utime(path, (107, 107))
    p.records(path)
    assert p.ranks[0].step == 5 and p.ranks[0].changed == 107


def test_fab_status_and_the_banner_say_the_blame_after_the_failure_and_prometheus_marks_a_straggler():
    from types import SimpleNamespace

    from fabtrain.controller.jobstate import JobState, Straggler, Verdict
    from fabtrain.controller.verdict_text import sentence
    from fabtrain.dashboard.prometheus import render

    said = "rank 3 on n1 stopped stepping at step 12 in `t.py:5 in spin`; ranks 0, 1, 2 wait in all_reduce"
    v = Verdict(JobState.FAILED, "trainer-1 on n1 hung: no progress for 5 s", on_failure="kill-job", blame=said)
    assert sentence(v, 0) == (f"JOB FAILED: trainer-1 on n1 hung: no progress for 5 s; {said}; torn down on every "
                              "node (on_failure kill-job)")
    behind = Straggler("n1", "trainer-1", rank=3, cause="data loading", ratio=4.2)
    assert behind.mark == "STRAGGLER rank 3: data loading 4.2x the median"
    snap = SimpleNamespace(cluster="c", nodes=[], progress={}, dropped={},
                           verdict=Verdict(JobState.RUNNING, "", job_id="J", stragglers=(behind,)))
    text = render(snap, 0)
    assert 'fabtrain_straggler{cluster="c",node="n1",process="trainer-1",rank="3",cause="data loading"} 1' in text
    assert 'fabtrain_straggler_ratio{cluster="c",node="n1",process="trainer-1",rank="3",cause="data loading"} 4.2' \
        in text


def test_a_rank_in_its_exit_progresses_while_its_process_works_and_stalls_once_it_does_not(tmp_path):
    """The hook's last record says the interpreter exits: its teardown writes no record, so CPU time and log output
    count for that rank, as before a first record; for a rank busy evaluating they do not."""
    path, p = str(tmp_path / "m.jsonl"), Progress(floor=0)
    write(path, 100, {"rank": 0, "step": 20, "source": "auto"}, {"rank": 1, "step": 20, "source": "auto"})
    p.records(path)
    busy = {"source": "auto", "step": 20, "between_steps": True}
    write(path, 101, {"rank": 0, **busy, "busy": "exiting", "busy_at": 101},
          {"rank": 1, **busy, "busy": "exiting", "busy_at": 101})
    p.records(path)
    assert p.last_record == 101
    p.cpu(10.0, 102, 1.0)
    p.cpu(10.5, 105, 1.0)  # half a second of CPU in the interval: activity at 105
    p.records(path)
    assert p.last_record == 105
    p.cpu(10.5, 109, 1.0)  # none since: its progress stays
    p.records(path)
    assert p.last_record == 105
    write(path, 110, {"rank": 1, **busy, "busy": "evaluating", "busy_at": 110})  # rank 1 is not exiting
    p.cpu(11.5, 112, 1.0)
    p.records(path)
    assert p.last_record == 110 and p.ranks[0].changed == 101  # rank 1's evaluation: its work, not the CPU
