"""Progress records from unchanged programs: the hook every Python process of a job loads.

Node ops writes this file as ``<job_dir>/stacks/hook/_fabtrain_progress.py``
beside the launcher's ``sitecustomize.py`` (launch.STACK_HOOK), which imports
it first, so every Python program a job starts, and each of its Python
descendants (torchrun's workers), runs it. At import it costs one
``sys.meta_path`` entry and imports nothing: a framework is instrumented only
once the program imports it itself (``torch``, ``lightning`` /
``pytorch_lightning``, ``transformers``, ``accelerate``, ``paddle``).

What each rank then appends to ``$FABTRAIN_METRICS`` (one ``os.write`` of one
line, O_APPEND: ranks sharing a file never interleave), the first step at
once and then at most every ``INTERVAL`` seconds (a quiet thread writes a
step still pending after that long, so a rank that stops stepping has its
last step on file within ``INTERVAL``)::

    {"ts", "step", "rank", "local_rank", "pid", "source": "auto", "framework",
     "step_time", "data_time", "compute_time", "comm_time",   # seconds, means over the steps recorded
     "forward_time", "backward_time", "optimizer_time",       # where seen (DDP forward, backward(), to step's end)
     "loss", "lr", "epoch", "samples_per_s", "total_steps",   # where known
     "child": true,                                           # a descendant of the process fabtrain started
     ...the framework's own logged names (Lightning, Hugging Face, accelerate)}

``rank`` is ``RANK`` (else ``FABTRAIN_RANK``), ``local_rank`` ``LOCAL_RANK``.
``step`` counts optimizer steps (``torch.optim``'s global step hooks,
``paddle.optimizer``'s ``step``), or is the framework's own global step.
``data_time`` is time in a DataLoader's ``__next__``; ``comm_time`` time in
``torch.distributed``'s collectives called from Python, and the time a
``backward()`` waits at its end, once its computation is done, for DDP's or
FSDP's gradient collectives (their reducer runs in C++: progress_frameworks' `_mark_compute_end`
says when the computation ended, in one step every ``SPLIT_EVERY`` seconds; the steps between are
split as that one was: `Split`); ``compute_time`` is the rest. In
synchronous training that wait is the time a rank waits for the slowest one:
what names a straggler (fabtrain/node/coordination/stragglers.py).
The loss is read only where that costs no device synchronisation: the
tensor ``backward()`` was called on, at once on the CPU and through an
asynchronous copy read a record later on a CUDA device, or what a
framework logs as a number.

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

INTERVAL = 0.5  # seconds between two records of one rank, at most
SPLIT_EVERY = 0.1  # seconds between two steps whose backward() calls have their end of computation marked (Split)
QUIET = 0.1  # seconds without a step after which a step left pending is written by the writer thread
# The writer thread never calls into the framework (it reads no loss: its record keeps the one the program's
# thread read last), and ends at the program's exit before the interpreter does: a daemon thread still there
# then (one inside torch's item() aborts 20 times of 20) can abort the process ("terminate called without an
# active exception", exit 134), and a job that finished would read as failed.
# Seconds between records of a rank that works without stepping (it evaluates: batches, forwards, collectives):
# the same step, marked "between_steps", so the watchdog sees it busy rather than hung.
BETWEEN_STEPS = 5.0
ENV_METRICS = "FABTRAIN_METRICS"
# These two are the contract's (fabtrain/contract/progress.py), copied: the hook runs inside the user's
# program, which cannot import fabtrain; tests/unit/test_contract.py holds them equal.
ENV_INSTRUMENT = "FABTRAIN_INSTRUMENT"  # "0": no instrumentation (job.watchdog.instrument: false)
HOOK_NAME = "_fabtrain_progress"  # this module's name in a program (the file node ops writes)
AUTO = "auto"
FRAMEWORKS = ("torch", "lightning", "transformers", "accelerate", "paddle")
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
               "all_gather_object", "broadcast_object_list", "monitored_barrier")
# module -> what to instrument once it is imported (each name is the module's own, exactly)
WATCH = {"torch": "torch", "lightning.pytorch": "lightning", "pytorch_lightning": "lightning",
         "transformers.trainer": "transformers", "accelerate.accelerator": "accelerate", "paddle": "paddle"}
PARTS = ("data_time", "comm_time", "forward_time", "backward_time", "optimizer_time")  # a step's timed parts
DATA, COMM, FORWARD, BACKWARD, OPTIMIZER = range(len(PARTS))
DRIVERS = ("lightning", "transformers")  # frameworks whose callbacks write the records (their own step)
MAX_NAMES = 32  # a framework's logged names kept in one record


def enabled(environ=os.environ):
    return bool(environ.get(ENV_METRICS)) and environ.get(ENV_INSTRUMENT, "1").strip().lower() not in (
        "0", "false", "no", "off")


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


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


def _batch_size(batch, depth=0):
    """The leading dimension of a batch: its first tensor's (a tensor, a list/tuple or a dict of them)."""
    if isinstance(batch, (list, tuple)):  # the commonest, (inputs, targets): first, as it has no shape to look up
        return _batch_size(batch[0], depth + 1) if batch and depth <= 2 else None
    shape = getattr(batch, "shape", None)
    if shape is not None:
        try:
            return int(shape[0]) if len(shape) else None
        except (TypeError, ValueError, IndexError):
            return None
    if isinstance(batch, dict) and batch and depth <= 2:
        return _batch_size(next(iter(batch.values())), depth + 1)
    return None


class Split:
    """Which backward() calls have their end of computation marked (progress_frameworks'
    `_mark_compute_end`: the autograd engine calls back into Python, 15 to 30 us of CPU a backward here):
    those of one step every SPLIT_EVERY seconds (all until a first step ends). The steps between are
    split as that step was, in proportion: a step's backwards differ (under gradient accumulation
    only the last waits for DDP's all-reduce), its steps hardly."""

    def __init__(self):
        self.marking = True  # the backwards of the step under way are marked
        self.marked_at = float("-inf")  # perf time the last marked step ended
        self.share = 0.0  # of the last marked step's backward time, the share spent waiting
        self.waited = self.seconds = 0.0  # the step under way's, while marked

    def backward(self, seconds, waited):
        """Of a backward's `seconds`, the time it waited: `waited` as measured (a marked backward; longer than
        the call is the whole call), or None: its share as in the last marked step."""
        if waited is None:
            return seconds * self.share
        waited = min(max(0.0, waited), seconds)
        self.waited, self.seconds = self.waited + waited, self.seconds + seconds
        return waited

    def step_ended(self, now):
        if self.marking:
            self.share = self.waited / self.seconds if self.seconds > 0 else self.share
            self.marked_at = now
        self.waited = self.seconds = 0.0
        self.marking = now - self.marked_at >= SPLIT_EVERY


class Reporter:
    """One rank's progress: what the instrumented calls tell it, written as records."""
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
        self.steps = 0  # optimizer steps of this rank
        self.framework_step = None  # the framework's own global step, where it has one
        self.last_write = float("-inf")  # perf time of the last record
        self.step_end = self.backward_end = None  # perf time of the last step's end, the last backward()'s
        self.first_activity = None  # perf time of the first timed call: the first step's start
        self.active = None  # perf time of the latest timed call (a batch, a forward, a collective, ...)
        self.values = {}  # loss, lr, epoch, total_steps, the framework's names: the latest known
        self.loss_tensor = None
        self.loss_copy = None  # a CUDA loss on its way to the host: (tensor, host copy, its event)
        self.optimizer = None  # the last one stepped: its lr is read when a record is written
        self.samples_seen = False  # a batch's size was read: samples/s can be said
        # What happened since the last step's end, by PARTS index (the step it belongs to takes it when it
        # ends), and the batches' samples: lists, so a step costs a few list operations.
        self.pending, self.pending_samples = [0.0] * len(PARTS), 0
        self.split = Split()  # which backward() calls are marked, and how the others are split
        self._reset_window()

    def _reset_window(self):
        self.n = 0  # steps in the window
        self.step_time = 0.0  # summed over the window's timed steps
        self.timed_steps = 0  # steps with a step_time in the window
        self.sums = [0.0] * len(PARTS)
        self.samples = 0

    # -- failures ---------------------------------------------------------------------------

    def fail(self, where, exc):
        """The first failure inside the hook: one line in the rank's log, and no more of the hook."""
        if self.failed:
            return
        self.failed, self.on = True, False
        try:
            os.write(2, ("fabtrain progress: %s failed (%s: %s); this process writes no more progress records, "
                         "the program goes on\n" % (where, type(exc).__name__, str(exc)[:200])).encode(
                             "utf-8", "replace"))
        except OSError:
            pass

    # -- what the instrumented calls tell it ------------------------------------------------

    def add(self, part, seconds, t0):
        """Time spent in one kind of call (PARTS index) since the last step."""
        if self.first_activity is None:
            self.first_activity = t0
        self.pending[part] += seconds
        self.active = t0

    def batch(self, seconds, t0, batch):
        if not self.on:
            return
        try:
            if self.first_activity is None:
                self.first_activity = t0
            self.pending[DATA] += seconds
            self.active = t0
            size = _batch_size(batch)
            if size is not None:
                self.pending_samples += size
                self.samples_seen = True
        except Exception as e:
            self.fail("reading a batch", e)

    def backward(self, tensor, seconds, t0, waited=None):
        """A backward() call of `seconds`, `waited` of them at its end for gradient collectives (DDP's, FSDP's:
        they are comm_time, not compute); None: not marked, split as the last marked step's were (Split)."""
        # Detached: a tensor kept with its graph keeps the graph's nodes alive, and autograd then reuses
        # a leaf's cached gradient accumulator, with its old shape, for the next forward (a program that
        # swaps a leaf's data between steps, as the reference pserver trainer does, fails its backward).
        self.loss_tensor = tensor.detach() if hasattr(tensor, "detach") else tensor
        waited = self.split.backward(seconds, waited)
        if self.first_activity is None:  # add(), twice, inline: this runs every step
            self.first_activity = t0
        self.pending[BACKWARD] += seconds - waited
        self.pending[COMM] += waited
        self.active, self.backward_end = t0, t0 + seconds

    def step(self, optimizer=None, report=True, began=None):
        """An optimizer step ended: close the step's timing; write a record if one is due (`report`:
        False where a framework reports its own steps; `began`: perf time the optimizer's part began, the
        step's backward's end, or the last step's end if later: a second optimizer after one backward)."""
        if not self.on:
            return
        try:
            now = self.perf()
            if began is not None:
                self.pending[OPTIMIZER] += now - (began if self.step_end is None else max(began, self.step_end))
            if self.lock is None:
                self._start()
            with self.lock:
                self.steps += 1
                self.n += 1
                start = self.step_end if self.step_end is not None else self.first_activity
                if start is not None:
                    self.step_time += now - start
                    self.timed_steps += 1
                self.sums = [a + b for a, b in zip(self.sums, self.pending)]
                self.pending = [0.0] * len(PARTS)
                self.samples += self.pending_samples
                self.pending_samples = 0
                self.step_end = now
                self.split.step_ended(now)
                if optimizer is not None:
                    self.optimizer = optimizer
                if report and now - self.last_write >= INTERVAL:
                    self._read_loss()
                    self._write(now)
        except Exception as e:
            self.fail("recording a step", e)

    def framework_values(self, framework, step=None, values=None, write=False):
        """What a framework knows (its global step, logged names, total steps); `write`: its step ended."""
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
                now = self.perf()
                if write and self.n and (now - self.last_write >= INTERVAL):
                    self._write(now)
        except Exception as e:
            self.fail("reading %s's values" % framework, e)

    def _lr(self):
        groups = getattr(self.optimizer, "param_groups", None)
        if groups:
            lr = groups[0].get("lr") if isinstance(groups[0], dict) else None
            if _finite(lr):
                self.values["lr"] = lr

    def _read_loss(self, program_thread=True):
        """The loss of the last backward(): read at once on the CPU. On a CUDA device (reading it would wait
        for the device) a copy to pinned host memory is started on the program's stream and read at a later
        record, once its event says it landed: a loss up to one INTERVAL old. `program_thread`: False in a flush
        (at exit): no copy started, as no later record would read it."""
        if self.loss_copy is not None and self.loss_copy[2].query():
            value, self.loss_copy = _number(self.loss_copy[1]), None
            if value is not None:
                self.values["loss"] = value
        t = self.loss_tensor
        if t is None:
            return
        value = _number(t)
        if value is not None:
            self.values["loss"] = value
        elif program_thread and self.loss_copy is None and getattr(t, "is_cuda", False) is True and \
                t.numel() == 1 and t.is_floating_point():
            cuda = sys.modules["torch"].cuda
            stream = cuda.current_stream(t.device)
            landed = cuda.Event()
            # t is kept until the copy has landed, so its memory is not reused before the copy reads it.
            self.loss_copy = (t, t.reshape(()).to("cpu", non_blocking=True), landed)
            landed.record(stream)
        elif not program_thread:
            return  # left for the program's next step
        self.loss_tensor = None

    # -- writing ------------------------------------------------------------------------------

    def _start(self):
        import threading
        self.lock = threading.Lock()
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

    def _start_thread(self):
        import threading
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._quiet_writer, name="fabtrain-progress", daemon=True)
        self.thread.start()

    def _forked(self):
        """In a forked child (a DataLoader worker): a fresh lock, and the writer thread again if it steps."""
        import threading
        self.lock = threading.Lock()
        self.thread = None
        self.fd = None

    def _quiet_writer(self):
        """Writes a step left pending once INTERVAL has passed since the last record and the rank has not
        stepped for QUIET (a rank that steps writes its own records). Never calls into the framework: QUIET."""
        me = self.thread
        while self.on and self.thread is me:
            self.wake.wait(QUIET)
            self.flush(due_only=True, read_loss=False)

    def flush(self, due_only=False, read_loss=True):
        """Write the step left pending (`due_only`: once due); `read_loss`: False on the writer thread (QUIET)."""
        if not self.on or self.lock is None:
            return
        try:
            with self.lock:
                now = self.perf()
                if self.n and (not due_only or (now - self.last_write >= INTERVAL and now - self.step_end >= QUIET)):
                    if read_loss and self.framework not in DRIVERS:  # (a driving framework's callbacks read theirs)
                        self._read_loss(program_thread=False)  # the last step's, not the last record's
                    self._write(now)
                elif due_only and self.steps and now - self.last_write >= BETWEEN_STEPS and self.active is not None \
                        and self.active > self.last_write:
                    self._write(now, between_steps=True)
        except Exception as e:
            self.fail("writing a record", e)

    def _record(self):
        rec = {"ts": round(self.wall(), 3),
               "step": self.framework_step if self.framework_step is not None else self.steps,
               "rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "source": AUTO,
               "framework": self.framework}
        if self.child:
            rec["child"] = True
        s, timed, n = self.sums, self.timed_steps, self.n
        if timed:
            step_time = self.step_time / timed
            rec["step_time"] = round(step_time, 6)
            rec["data_time"] = round(s[DATA] / n, 6)
            rec["comm_time"] = round(s[COMM] / n, 6)
            rec["compute_time"] = round(max(0.0, step_time - rec["data_time"] - rec["comm_time"]), 6)
            for part in (FORWARD, BACKWARD, OPTIMIZER):
                if s[part]:
                    rec[PARTS[part]] = round(s[part] / n, 6)
            if self.samples_seen and self.step_time > 0:
                rec["samples_per_s"] = round(self.samples / self.step_time, 3)
        self._lr()
        for key, v in self.values.items():
            if key not in rec:
                rec[key] = v
        return rec

    def _write(self, now, between_steps=False):
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            if self.child is None:
                self.child = _launched_elsewhere()
        program_writes, self.seen = _program_record(self.fd, self.seen, self.rank)
        if program_writes:
            self.on = False  # its own records from now on: nothing more of ours
            return
        import json
        rec = self._record() if not between_steps else {
            "ts": round(self.wall(), 3), "step": self.framework_step if self.framework_step is not None else self.steps,
            "rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "source": AUTO,
            "framework": self.framework, "between_steps": True, **({"child": True} if self.child else {})}
        line = json.dumps(rec, separators=(", ", ": ")) + "\n"
        os.write(self.fd, line.encode())
        self.last_write = now
        if not between_steps:
            self._reset_window()

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
    import functools
    return functools.wraps(orig)(wrapper)


def _frameworks():
    """progress_frameworks.py: beside this file in a program (node ops writes both), else the package's."""
    if __name__ != HOOK_NAME:
        from fabtrain.node import progress_frameworks
        return progress_frameworks
    name = HOOK_NAME + "_frameworks"
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
        getattr(_frameworks(), kind)(sys.modules[__name__], module)
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
    from fabtrain.node import progress_frameworks
    return {HOOK_NAME + ".py": _text(sys.modules[__name__]), HOOK_NAME + "_frameworks.py": _text(progress_frameworks)}


def _text(module):
    loader = getattr(module, "__loader__", None)  # node ops' bundle (fabtrain.remote.rpc) has no file to read
    text = loader.get_source(module.__name__) if hasattr(loader, "get_source") else None
    if text:
        return text
    with open(module.__file__) as f:
        return f.read()


if __name__ == HOOK_NAME:
    install()
