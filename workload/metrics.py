"""Metrics as JSON lines: the job's progress, and the heartbeat fabtrain watches for hangs.

One object a line, flushed at once:
  {"ts": 1763790000.1, "role": "trainer", "rank": 0, "step": 120, "epoch": 0,
   "loss": 5.21, "samples_per_s": 812.0, "lr": 0.01, ...}
"""
import json
import math
import os
import time


class MetricsWriter:
    def __init__(self, path, role, rank):
        self.role, self.rank = role, rank
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")
        self.last_write = 0.0

    def write(self, **fields):
        record = {"ts": round(time.time(), 3), "role": self.role, "rank": self.rank}
        record.update({k: _plain(v) for k, v in fields.items()})
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        self.last_write = time.monotonic()
        return record

    def seconds_since_write(self):
        return time.monotonic() - self.last_write

    def close(self):
        if self.file:
            self.file.close()


def _plain(value):
    """JSON has no NaN/inf; a diverged loss is written as null rather than breaking the reader."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    return value


def read_metrics(path):
    """Every record of a metrics file (for tests and the benchmark)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class TrainingLog:
    """A trainer's progress: a metrics record every `log_every` steps and at least every
    HEARTBEAT_S seconds (the hang-detection heartbeat), and a readable line on stdout."""

    HEARTBEAT_S = 1.0
    PRINT_EVERY_S = 2.0

    def __init__(self, writer, who, log_every, lr):
        self.writer, self.who, self.log_every, self.lr = writer, who, log_every, lr
        self.loss_sum, self.steps, self.samples = 0.0, 0, 0
        self.since = time.monotonic()
        self.last_print = 0.0
        self.last_loss = None

    def step(self, step, epoch, loss, samples, **extra):
        """Count one finished step (`step` = steps done so far)."""
        self.loss_sum += loss
        self.steps += 1
        self.samples += samples
        if step % self.log_every == 0 or self.writer.seconds_since_write() >= self.HEARTBEAT_S:
            self._write(step, epoch, extra)

    def _write(self, step, epoch, extra):
        elapsed = max(time.monotonic() - self.since, 1e-9)
        self.last_loss = self.loss_sum / self.steps
        record = self.writer.write(step=step, epoch=epoch, loss=self.last_loss,
                                   samples_per_s=self.samples / elapsed, lr=self.lr, **extra)
        if time.monotonic() - self.last_print >= self.PRINT_EVERY_S:
            self.last_print = time.monotonic()
            more = "".join(f" {k} {v}" for k, v in extra.items())
            print(f"{self.who}: step {step} pass {epoch} loss {record['loss']} "
                  f"{record['samples_per_s']:.0f} samples/s{more}", flush=True)
        self.loss_sum, self.steps, self.samples = 0.0, 0, 0
        self.since = time.monotonic()

    def heartbeat(self, step, epoch, **extra):
        """A record during long work that is not a training step (evaluation), so the job does not look hung."""
        if self.writer.seconds_since_write() >= self.HEARTBEAT_S:
            # no samples_per_s: no training was measured (a 0 would read as the rate the job trained at)
            self.writer.write(step=step, epoch=epoch, loss=self.last_loss, lr=self.lr, **extra)

    def evaluation(self, step, epoch, loss_sum, count, **extra):
        eval_loss = loss_sum / count if count else None
        self.writer.write(step=step, epoch=epoch, loss=self.last_loss, lr=self.lr,
                          eval_loss=eval_loss, eval_samples=count, **extra)
        print(f"{self.who}: pass {epoch} done at step {step}: eval_loss {eval_loss} on {count} test examples",
              flush=True)
