"""Progress records from unchanged programs: the hook every Python process of a job loads.

Node ops writes this file as ``<job_dir>/stacks/hook/_fabtrain_progress.py``
beside the launcher's ``sitecustomize.py`` (launch.STACK_HOOK), which imports
it first, so every Python program a job starts, and each of its Python
descendants (torchrun's workers), runs it. At import it costs one
``sys.meta_path`` entry and imports nothing: a framework is instrumented only
once the program imports it itself (``torch``, ``lightning`` /
``pytorch_lightning``, ``transformers``, ``accelerate``, ``paddle``).

What each rank then appends to ``$FABTRAIN_METRICS`` (one ``os.write`` of one
line, O_APPEND: ranks sharing a file never interleave; the fields and their
meaning: docs/progress.md) costs it a count a step: every optimizer step is
counted (the clock is read at looked-at steps only), and one step each
``INTERVAL`` seconds (the writer thread says when) is sampled: the
frameworks' timing patches are put in for that step only, its parts timed
(data, communication, forward, backward, optimizer) and its loss read (the sum
of the tensors ``backward()`` ran on since the step before: under gradient
accumulation, the step's mean loss; GradScaler's scaling undone). A record
ends each sampled step; a quiet thread writes a step left pending once the
rank stops stepping, and watches a rank whose step is ``LATE``: a batch, a
forward or a collective that finishes, or a checkpoint save's bytes, is work
done, and a record ``"between_steps": true`` with ``busy`` and ``busy_at``
says so each ``BUSY_EVERY`` seconds, so the watchdog tells a rank that
evaluates or saves from one that hangs.

A program's own records win: once the file holds a record of the program's
for this rank (no ``"source": "auto"``, and its ``rank`` this one or none),
this rank writes no more, and the views drop a trainer's auto records once it
has its own (contract/progress.py's `row` says which trainer a record belongs to).
``FABTRAIN_INSTRUMENT=0`` (job.watchdog.instrument: false) turns it all off.

The hook never changes what the program computes, its random numbers or its
output, and never breaks it: the first exception inside it is said in one
line on stderr (the rank's log) and the hook stops; the program goes on.
Standard library only.
"""
import os
import sys

INTERVAL = 0.5  # seconds between two records of one rank, at most (a record ends a sampled step: below)
QUIET = 0.1  # seconds between two looks of the writer thread; a step left pending is written once this quiet
# The writer thread never calls into the framework (no loss read) and ends before the interpreter does: a daemon
# thread inside torch's item() at finalization aborts the process (exit 134; 20 times of 20).
LATE = 1.0  # seconds without an optimizer step after which the rank's work between steps is watched (_watch)
BUSY_EVERY = 1.0  # seconds between two records of a rank that works without stepping (it evaluates, saves)
TICK = 0.05  # seconds between two looked-at steps, about (a step only counts; the clock is the writer thread's)
ENV_METRICS = "FABTRAIN_METRICS"
# These two are the contract's (fabtrain/contract/progress.py), copied: the hook runs inside the user's
# program, which cannot import fabtrain; tests/unit/test_contract.py holds them equal.
ENV_INSTRUMENT = "FABTRAIN_INSTRUMENT"  # "0": no instrumentation (job.watchdog.instrument: false)
HOOK_NAME = "_fabtrain_progress"  # this module's name in a program (the file node ops writes)
AUTO = "auto"
FRAMEWORKS = ("torch", "lightning", "transformers", "accelerate", "paddle", "checkpoint")
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
               "all_gather_object", "broadcast_object_list", "monitored_barrier")
# module -> what to instrument once it is imported (each name is the module's own, exactly)
WATCH = {"torch": "torch", "lightning.pytorch": "lightning", "pytorch_lightning": "lightning",
         "transformers.trainer": "transformers", "accelerate.accelerator": "accelerate", "paddle": "paddle",
         "torch.distributed.checkpoint": "checkpoint"}
PARTS = ("data_time", "comm_time", "forward_time", "backward_time", "optimizer_time")  # a step's timed parts
DATA, COMM, FORWARD, BACKWARD, OPTIMIZER = range(len(PARTS))
# What a rank busy between steps was last seen doing (the record's "busy"), by the part that saw it.
BUSY = {DATA: "loading data", COMM: "communicating", FORWARD: "evaluating"}
SAVING, EXITING = "saving a checkpoint", "exiting"  # EXITING: its interpreter exits (the agent counts CPU then)
DRIVERS = ("lightning", "transformers")  # frameworks whose callbacks write the records (their own step)
MAX_NAMES = 32  # a framework's logged names kept in one record


def enabled(environ=os.environ):
    return bool(environ.get(ENV_METRICS)) and environ.get(ENV_INSTRUMENT, "1").strip().lower() not in ("0", "false",
                                                                                                       "no", "off")


def _int(value):
    return int(value) if isinstance(value, str) and value.strip().lstrip("-").isdigit() else None


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v not in (
        float("inf"), float("-inf"))


def _number(v):
    """A plain number of a logged value (a Python number, a numpy scalar, a CPU tensor of one element);
    None for anything else, and for a tensor on a device (reading it would synchronise)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v if _finite(v) else None
    device = getattr(v, "device", None)  # torch: a torch.device; paddle: a string ("cpu", "gpu:0")
    if device is not None and (str(device).split(":")[0] if isinstance(device, str) else getattr(
            device, "type", "cpu")) != "cpu":
        return None
    try:
        if getattr(v, "numel", None) is not None and v.numel() != 1:
            return None
        item = getattr(v, "item", None)
        out = item() if item is not None else None
    except Exception:  # a value we cannot read is left out
        return None
    return out if _finite(out) and not isinstance(out, bool) else None


class Writer:
    """How a rank's records are written (Reporter's base): on the program's thread when a sampled step ends, and
    on the writer thread (a step left pending, a rank watched between steps); never both at once (the lock)."""

    def _start(self):
        import threading
        self.lock = threading.RLock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forked)
        import atexit
        atexit.register(self._exit)
        self._start_thread()

    def _exit(self):
        """At exit: the writer thread ended (a daemon thread left at finalization can abort it: QUIET), then a flush."""
        writer, self.thread = self.thread, None
        if writer is not None and writer.is_alive():
            self.wake.set()
            writer.join(1.0)
        self.flush()
        if self.on and self.steps and self.lock is not None:  # its exit is under way: work, not a hang
            with self.lock:
                self.active, self.busy = self.perf(), EXITING
                self._write(self.active, busy=True)

    def _start_thread(self):
        import threading
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._quiet_writer, name="fabtrain-progress", daemon=True)
        self.thread.start()

    def _forked(self):
        """In a forked child (a DataLoader worker): a fresh lock, and the writer thread again if it steps."""
        self.lock, self.thread, self.fd = __import__("threading").RLock(), None, None

    def _quiet_writer(self):
        """Watches the work of a rank whose step is LATE, writes a step left pending (a rank that steps writes its
        own records) and a busy rank's record. Never calls into the framework: QUIET."""
        me = self.thread
        while self.on and self.thread is me:
            self.wake.wait(self._next_look())
            self._look()
            self._watch()
            self.flush(due_only=True)

    def _look(self):
        """Steps seen; a record due (or due within a TICK: one look a record): the next step starts its sample."""
        with self.lock:
            now = self.perf()
            if self.steps != self.seen_steps:
                self.seen_steps, self.seen_at = self.steps, now
            if now + TICK >= self.due and self.steps > self.written_steps:
                self.due, self.look_at = min(self.due, now), 0

    def _progress_at(self):  # perf time by which the last step had ended: its own if looked at, else the look's
        return max(self.step_end if self.step_end is not None else float("-inf"), self.seen_at)

    def _next_look(self):
        """Seconds to the writer's next look: each QUIET while it watches; else once the step is LATE or the next
        record due (once asked for, not yet written: the one after it; one look a record, bench/hook_cost.py)."""
        if self.watching or not self.steps:
            return QUIET
        now = self.perf()
        at = min(self._progress_at() + LATE, self.due if self.due > now else now + INTERVAL)
        return min(max(at - now, 0.0) or QUIET, LATE)

    def _watch(self):
        """A step LATE: the patches put in (a batch, a forward, a collective that finishes is work done; a
        forward's end is seen by a one-shot hook put back at each look; a save's bytes are followed)."""
        if not self.on or self.lock is None:
            return
        try:
            now = self.perf()
            with self.lock:
                if not self.watching and self.steps and now - self._progress_at() >= LATE:
                    self.watching, self.look_at = True, 0
                    if self.patch is not None:
                        self.patch(True)
                if self.watching and self.rewatch is not None:
                    self.rewatch()
        except Exception as e:
            self.fail("watching between steps", e)

    rewatch = None  # the framework's: puts the one-shot forward hook back, follows a save's bytes (_watch)

    def flush(self, due_only=False):
        """Write the steps left pending (`due_only`: once INTERVAL since the last record and QUIET since the
        last step), or the record of a rank busy between steps (BUSY_EVERY, on the writer thread only)."""
        if not self.on or self.lock is None:
            return
        try:
            with self.lock:
                now = self.perf()
                if self.steps > self.written_steps and (not due_only or (
                        now - self.last_write >= INTERVAL and now - self._progress_at() >= QUIET)):
                    self._write(now)
                elif due_only and self.watching and self.active is not None and self.active != self.busy_written \
                        and self.active > self._progress_at() and now - self.last_write >= BUSY_EVERY:
                    self._write(now, busy=True)
        except Exception as e:
            self.fail("writing a record", e)

    def _base(self):
        rec = {"ts": round(self.wall(), 3),
               "step": self.framework_step if self.framework_step is not None else self.steps,
               "rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "source": AUTO,
               "framework": self.framework}
        return {**rec, "child": True} if self.child else rec

    def _record(self):
        """The record of the steps since the last one: their mean step time, the sampled step's parts (scaled to
        that mean: the parts' shares are the sample's; the last sample's where none ended since), samples/s, loss."""
        rec = self._base()
        # the mean of the steps up to the last one looked at (a step left pending after it has no time of its own)
        n, timed = self.end_steps - self.window_steps, self.timed or self.last_timed
        end = self.step_end
        mean = (end - self.window_start) / n if self.window_start is not None and n > 0 and end is not None \
            else self.mean if self.mean is not None else timed[1] if timed else None
        self.mean = mean
        if mean is not None:
            rec["step_time"] = round(mean, 6)
        if timed is not None and mean is not None:
            parts, seconds, samples = timed
            scale = mean / seconds if seconds > 0 else 0.0
            rec["data_time"] = round(parts[DATA] * scale, 6)
            rec["comm_time"] = round(parts[COMM] * scale, 6)
            rec["compute_time"] = round(max(0.0, mean - rec["data_time"] - rec["comm_time"]), 6)
            for part in (FORWARD, BACKWARD, OPTIMIZER):
                if parts[part]:
                    rec[PARTS[part]] = round(parts[part] * scale, 6)
            if self.samples_seen and mean > 0:
                rec["samples_per_s"] = round(samples / mean, 3)  # the sampled step's samples, each mean step
        self._lr()
        for key, v in self.values.items():
            if key not in rec:
                rec[key] = v
        if "loss" in rec and self.loss_at is not None and self.loss_at != self.steps:
            rec["loss_step"] = rec["step"] - (self.steps - self.loss_at)  # a step's loss not read: the last read
        return rec

    loss_at = mean = None  # self.steps of the step whose loss values["loss"] holds; the last record's step time

    def _write(self, now, busy=False, checkpoint=None):
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            if self.child is None:
                self.child = _launched_elsewhere()
        program_writes, self.seen = _program_record(self.fd, self.seen, self.rank)
        if program_writes:
            self.on = False  # its own records from now on: nothing more of ours
            if self.patch is not None:
                self.patch(False)
            return
        import json
        if busy:
            rec = self._base()
            rec.update(between_steps=True, busy=self.busy or "working",
                       busy_at=round(rec["ts"] - max(0.0, now - self.active), 3))
            if checkpoint:  # (progress_frameworks' saves)
                rec.update({k: v for k, v in self.values.items() if k.startswith("ckpt_")}, checkpoint=checkpoint)
            self.busy_written = self.active
        else:
            rec = self._record()
            self.written_steps, self.window_start, self.window_steps = self.steps, self.step_end, self.end_steps
            self.timed, self.due = None, now + INTERVAL
        os.write(self.fd, (json.dumps(rec, separators=(", ", ": ")) + "\n").encode())
        self.last_write = now


class Reporter(Writer):
    """One rank's progress. Every optimizer step is counted (`step`: a few attribute writes); the parts of one
    step in each record's window are timed (a sampled step: the frameworks' patches are in place only for it),
    and its loss read: the sum of the tensors backward() ran on since the step before (under gradient
    accumulation, each micro-batch's loss over K: the step's mean loss)."""

    def __init__(self, environ=os.environ):
        from time import perf_counter, time
        self.perf, self.wall = perf_counter, time
        self.path = environ.get(ENV_METRICS)
        self.rank = _int(environ.get("RANK"))
        if self.rank is None:
            self.rank = _int(environ.get("FABTRAIN_RANK"))
        self.local_rank = _int(environ.get("LOCAL_RANK"))
        self.on = True
        self.failed = False
        self.fd = None
        self.seen = 0  # bytes of the file read for the program's own records
        self.child = None  # a descendant of the process the launcher started (decided at the first record)
        self.framework = "torch"
        self.lock = None
        self.thread = None
        self.patch = None  # the framework's: patch(True) puts the timing patches in, patch(False) takes them out
        self.steps = 0  # optimizer steps of this rank
        self.framework_step = None  # the framework's own global step, where it has one
        self.last_write = float("-inf")  # perf time of the last record
        self.due = float("-inf")  # perf time from which the next step is sampled (a record is due)
        self.step_end, self.end_steps = None, 0  # perf time of the last looked-at step's end, and its count
        self.look_at = 0  # self.steps from which a step is looked at (stepped): 0 each step, else one a TICK
        self.seen_steps, self.seen_at = 0, float("-inf")  # self.steps at the writer's last look, when it changed
        self.written_steps, self.window_start, self.window_steps = 0, None, 0  # at the last record (end_steps)
        self.values = {}  # loss, lr, epoch, total_steps, the framework's names: the latest known
        self.logged_loss_at = None  # self.steps when a framework logged its own loss (it wins for that step)
        self.loss_copy = None  # a CUDA loss on its way to the host: (tensor, host copy, its event)
        self.optimizer = None  # the last one stepped: its lr is read when a record is written
        self.samples_seen = False  # a batch's size was read: samples/s can be said
        # The sampled step: its start, its parts (PARTS index), batches' samples, losses, last backward's end.
        self.sampling, self.sample_start, self.sample = True, None, [0.0] * len(PARTS)
        self.sample_samples, self.losses, self.backward_end = 0, [], None
        self.timed = self.last_timed = None  # a sampled step for the next record, the last: (parts, seconds, samples)
        self.scaled = None  # (tensor GradScaler.scale returned, the loss it scaled): the loss is the latter
        # Work between steps, watched once a step is LATE: what was last done, when, and saves under way.
        self.watching, self.active, self.busy, self.busy_written = False, None, None, None
        self.saves, self.save_written = 0, None  # saves under way; bytes written when last looked (frameworks)

    def fail(self, where, exc):
        """The first failure inside the hook: one line in the rank's log, and no more of the hook."""
        if self.failed:
            return
        self.failed, self.on = True, False
        try:
            if self.patch is not None:
                self.patch(False)
        except Exception:
            pass
        try:
            os.write(2, ("fabtrain progress: %s failed (%s: %s); this process writes no more progress records, "
                         "the program goes on\n" % (where, type(exc).__name__, str(exc)[:200])).encode(
                             "utf-8", "replace"))
        except OSError:
            pass

    # -- what the instrumented calls tell it ------------------------------------------------

    def add(self, part, seconds, t0):
        """Time spent in one kind of call (PARTS index): the sampled step's, and work done between steps."""
        if self.sampling:
            if self.sample_start is None:
                self.sample_start = t0
            self.sample[part] += seconds
        self.active, self.busy = t0 + seconds, BUSY.get(part, self.busy)

    def batch(self, seconds, t0, size):
        """A batch of `size` samples (None: not known) waited for `seconds`."""
        self.add(DATA, seconds, t0)
        if self.sampling and size is not None:
            self.sample_samples += size
            self.samples_seen = True

    def backward(self, tensor, seconds, t0, waited=None):
        """A backward() call of the sampled step: `seconds`, `waited` of them at its end for gradient collectives
        (DDP's, FSDP's: comm_time, not compute). Its loss is kept detached (one kept with its graph keeps the graph
        alive: autograd reuses a leaf's cached gradient accumulator); one GradScaler scaled, as before its scaling."""
        if not self.sampling:
            return
        scaled = self.scaled
        if scaled is not None and scaled[0] is tensor:
            tensor = scaled[1]
        self.losses.append(tensor.detach() if hasattr(tensor, "detach") else tensor)
        waited = min(max(0.0, waited or 0.0), seconds)
        if self.sample_start is None:
            self.sample_start = t0
        self.sample[BACKWARD] += seconds - waited
        self.sample[COMM] += waited
        self.backward_end = t0 + seconds

    def skipped(self):
        """GradScaler's update after a step it skipped (inf gradients): the sample's losses and parts were not a
        step's; the sample starts again."""
        if self.sampling and self.losses:
            self.sample_start, self.sample, self.sample_samples, self.losses = self.perf(), [0.0] * len(PARTS), 0, []

    def step(self, optimizer=None, report=True, began=None):
        """An optimizer step ended: counted; the rest only when a sample ends or starts, or work was watched
        (`report`: False where a framework's callbacks write the records; `began`: perf time the optimizer's
        part began, the step's last backward's end). torch's post-hook inlines the counting (progress_frameworks)."""
        self.steps += 1
        if self.steps >= self.look_at:
            self.stepped(self.perf(), optimizer, report, began)

    def stepped(self, now, optimizer, report, began):
        if not self.on:
            return
        try:
            if self.lock is None:
                self._start()
            if optimizer is not None:
                self.optimizer = optimizer
            with self.lock:
                self.step_end, self.end_steps = now, self.steps
                if self.watching:
                    self.watching = False
                    self.busy = None
                if self.sampling:
                    self._sample_ended(now, began)
                    if report and now >= self.due:  # (paddle samples every step)
                        self._write(now)
                elif now >= self.due:
                    self.sampling, self.sample_start = True, now
                if self.patch is not None:
                    self.patch(self.sampling)
                mean = self.mean or (self.timed or self.last_timed or (0, 0))[1]  # a step's time, as last known
                self.look_at = 0 if self.sampling or now >= self.due or not mean else self.steps + int(TICK / mean)
        except Exception as e:
            self.fail("recording a step", e)

    def _sample_ended(self, now, began):
        parts, start = self.sample, self.sample_start if self.sample_start is not None else now
        if began is not None:
            parts[OPTIMIZER] += max(0.0, now - max(began, start))
        self.timed = self.last_timed = (parts, now - start, self.sample_samples)
        self.sampling, self.sample_start, self.sample, self.sample_samples = False, None, [0.0] * len(PARTS), 0
        losses, self.losses, self.scaled = self.losses, [], None
        if losses and self.logged_loss_at != self.steps:
            _part("frameworks").read_loss(sys.modules[__name__], self, losses)

    def framework_values(self, framework, step=None, values=None, write=False):
        """What a framework knows (its global step, logged names, total steps); `write`: its step ended, and a
        record is written if a sampled step ended since the last one."""
        if not self.on:
            return
        try:
            if self.lock is None:
                self._start()
            with self.lock:
                self.framework = framework
                if step is not None:
                    self.framework_step = int(step)
                for key, v in (values or {}).items():
                    n = _number(v)
                    if n is not None and isinstance(key, str) and 0 < len(key) <= 64 and \
                            (key in self.values or len(self.values) < MAX_NAMES):
                        self.values[key] = n
                        if key == "loss":
                            self.logged_loss_at = self.loss_at = self.steps
                if write and self.timed is not None:
                    self._write(self.perf())
        except Exception as e:
            self.fail("reading %s's values" % framework, e)

    def _lr(self):
        groups = getattr(self.optimizer, "param_groups", None)
        lr = groups[0].get("lr") if groups and isinstance(groups[0], dict) else None
        self.values.update({"lr": lr} if _finite(lr) else {})


def _program_record(fd, seen, rank):
    """(the file holds a record of the program's own for `rank`, bytes read): read on from `seen`."""
    size = os.fstat(fd).st_size
    if size <= seen:
        return False, seen
    if size - seen > (1 << 20):  # far behind: look at the last part only
        seen = size - (1 << 20)
    data = os.pread(fd, size - seen, seen)
    end = data.rfind(b"\n")
    if end < 0:
        return False, seen
    seen += end + 1
    for line in data[:end].split(b"\n"):
        if not line.strip() or b'"source": "auto"' in line:
            continue
        import json
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("source") != AUTO and rec.get("rank", rank) in (rank, str(rank)):
            return True, seen
    return False, seen


def _launched_elsewhere():
    """True when this process is not the one the launcher started (its parent is no launch.py)."""
    try:
        with open("/proc/%d/cmdline" % os.getppid(), "rb") as f:
            argv = f.read().split(b"\0")[:8]
    except OSError:
        return False
    return not (b"--exit" in argv and any(a.endswith(b"/launch.py") for a in argv[:4]))


REPORTER = None


def _guarded(where):
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if REPORTER is not None:
                    REPORTER.fail(where, e)
        return run
    return wrap


# -- instrumenting each framework once it is imported ------------------------------------------------------


def _wraps(orig, wrapper):
    return __import__("functools").wraps(orig)(wrapper)


def _part(part):
    """progress_<part>.py: beside this file in a program (node ops writes every part), else the package's."""
    if __name__ != HOOK_NAME:
        from importlib import import_module
        return import_module("fabtrain.node.progress_" + part)
    name = HOOK_NAME + "_" + part
    if name not in sys.modules:
        from importlib.util import module_from_spec, spec_from_file_location
        spec = spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py"))
        module = module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _framework(kind):
    @_guarded("instrumenting " + kind)
    def instrument(module):
        getattr(_part("paddle" if kind == "paddle" else "frameworks"), kind)(sys.modules[__name__], module)
    return instrument


INSTRUMENT = {kind: _framework(kind) for kind in FRAMEWORKS}


class _Finder:
    """A `sys.meta_path` entry that finds nothing itself: it lets the real finder find a watched module and
    instruments the module once it has been executed."""

    def __init__(self):
        self.busy = set()

    def find_spec(self, name, path=None, target=None):
        if name not in WATCH or name in self.busy or not REPORTER.on:
            return None
        self.busy.add(name)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self.busy.discard(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        try:
            orig = loader.exec_module

            def exec_module(module):
                try:
                    del loader.exec_module  # the loader as it was
                except AttributeError:
                    pass
                orig(module)
                if REPORTER.on:
                    INSTRUMENT[WATCH[name]](module)
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader that takes no attribute: not instrumented
            pass
        return spec


@_guarded("starting")
def install():
    global REPORTER
    if REPORTER is not None or not enabled():
        return
    REPORTER = Reporter()
    sys.meta_path.insert(0, _Finder())


def sources():
    """The hook's files as node ops writes them beside the launcher's sitecustomize.py: {file name: text}."""
    from importlib import import_module
    return {HOOK_NAME + ".py": _text(sys.modules[__name__]), **{HOOK_NAME + "_%s.py" % part: _text(import_module(
        "fabtrain.node.progress_" + part)) for part in ("frameworks", "paddle")}}


def _text(module):
    loader = getattr(module, "__loader__", None)  # node ops' bundle (fabtrain.remote.rpc) has no file to read
    text = loader.get_source(module.__name__) if hasattr(loader, "get_source") else None
    if text:
        return text
    with open(module.__file__) as f:
        return f.read()


if __name__ == HOOK_NAME:
    install()
