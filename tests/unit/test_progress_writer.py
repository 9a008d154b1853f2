"""The progress hook's writer thread (fabtrain/node/progress.py) never calls into the framework.

It is a daemon thread; one that is inside a call that lets go of the GIL (a torch tensor's item()) when
the program exits is ended by the interpreter with pthread_exit, and the unwinding through torch's C++
aborts the process: "terminate called without an active exception", exit 134, a finished job read as
failed (seen in a 2-rank DDP test run; a daemon thread calling item() at exit aborts every time). So the
writer writes a quiet step with the loss the program's thread read last, and only the program's thread
(each record it writes, and at exit) reads the loss."""
from __future__ import annotations

import json
import threading

from fabtrain.node import progress
from tests.support.procscan import wait_for


class Loss:
    """A one-element CPU tensor as the hook reads it, noting which thread read it."""
    device = "cpu"

    def __init__(self, value):
        self.value, self.readers = value, []

    def detach(self):
        return self

    def numel(self):
        return 1

    def item(self):
        self.readers.append(threading.current_thread().name)
        return self.value


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_writer_thread_writes_a_quiet_step_without_reading_the_loss(tmp_path):
    path = tmp_path / "m.jsonl"
    r = progress.Reporter({progress.ENV_METRICS: str(path), "RANK": "0"})
    clock = [100.0]
    r.perf = lambda: clock[0]  # noqa: E731  (the test moves time on, not the machine's load)
    try:
        first, second, third = Loss(2.5), Loss(1.25), Loss(0.5)
        r.backward(first, 0.001, r.perf())
        r.step()  # the first record is due at once: the program's thread reads its loss
        assert [rec["loss"] for rec in records(path)] == [2.5] and first.readers == [threading.current_thread().name]
        r.backward(second, 0.001, r.perf())
        r.step()  # not due yet: left pending, then the rank is quiet

        def time_passes(until):  # the writer knows a rank quiet once two of its looks saw the same steps
            clock[0] += progress.QUIET / 2
            return until()
        clock[0] += progress.INTERVAL
        assert wait_for(lambda: time_passes(lambda: len(records(path)) == 2), timeout=5)  # the writer wrote it
        last = records(path)[-1]
        assert last["step"] == 2 and last["loss"] == 2.5 and last["loss_step"] == 1  # the last read, said so
        assert second.readers == []  # never read on the writer thread
        clock[0] += progress.INTERVAL  # over LATE since the last step: the writer's next look watches the rank
        assert wait_for(lambda: r.look_at == 0, timeout=5)  # so its next step is looked at
        r.step()  # a record is due: this step starts the sample
        r.backward(third, 0.001, r.perf())
        r.step()  # the sampled step: the program's thread reads its loss and writes
        assert records(path)[-1]["step"] == 4 and records(path)[-1]["loss"] == 0.5
        assert "fabtrain-progress" not in first.readers + second.readers + third.readers
    finally:
        r.on = False


def test_at_exit_the_writer_thread_ends_before_the_pending_step_is_written(tmp_path):
    """The exit handler ends the writer thread first: no daemon thread of the hook is left when the interpreter
    finalizes (one left there can abort the process, exit 134), and the last step is still written."""
    path = tmp_path / "m.jsonl"
    r = progress.Reporter({progress.ENV_METRICS: str(path), "RANK": "0"})
    try:
        r.backward(Loss(2.0), 0.001, r.perf())
        r.step()
        writer = r.thread
        assert writer is not None and writer.is_alive()
        r.backward(Loss(1.0), 0.001, r.perf())
        r.step()  # not due: pending
        r._exit()  # what atexit calls
        assert not writer.is_alive() and r.thread is None
        assert records(path)[-1]["step"] == 2
    finally:
        r.on = False
