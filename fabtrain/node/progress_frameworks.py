"""What torch, Lightning, Hugging Face's Trainer, accelerate and paddle add to the progress records.

Loaded by the hook (progress.py) only once the program imports one of them;
each function here gets the hook module (`core`) and the framework's module,
and patches what it constructs so the framework's own knowledge (its global
step, what it logs, its total steps) goes into the rank's records. A failure
here is the hook's: said once in the rank's log, and the program goes on.
Standard library only (the framework's classes come from the module given).
"""


def read_loss(core, r, losses):
    """The loss of `r`'s sampled step (Reporter._sample_ended), the sum of its backward()s' tensors: at once on
    the CPU. On a CUDA device (reading it would wait for the device) their sum is copied to host memory on the
    program's stream and read at a later record, once its event says it landed: a loss up to one record old."""
    if r.loss_copy is not None and r.loss_copy[2].query():
        value, at, r.loss_copy = core._number(r.loss_copy[1]), r.loss_copy[3], None
        if value is not None:
            r.values["loss"], r.loss_at = value, at
    values = [core._number(t) for t in losses]
    if None not in values:
        r.values["loss"], r.loss_at = sum(values), r.steps
        return
    t = losses[0]
    if r.loss_copy is None and getattr(t, "is_cuda", False) is True and t.numel() == 1 and \
            t.is_floating_point():
        cuda = core.sys.modules["torch"].cuda
        total = t.reshape(()).float()
        for other in losses[1:]:
            total = total + other.reshape(()).float()
        landed = cuda.Event()
        # total is kept until the copy has landed, so its memory is not reused before the copy reads it.
        r.loss_copy = (total, total.to("cpu", non_blocking=True), landed, r.steps)
        landed.record(cuda.current_stream(t.device))


_REPORTER = _DRIVERS = None  # the rank's Reporter and the frameworks whose callbacks write records (torch())


def _optimizer_step_code(self, args=None, kwargs=None):
    """After each optimizer step (with a closure, as Lightning's, its forward and backward ran inside): counted,
    the rest only when a sample ends or starts, a record is due or the rank was watched (Reporter.step, inlined:
    this runs every step). Not a closure: torch's profiler reads this frame as the optimizer's, and a closure's
    frame crashes it (with_stack=True)."""
    r = _REPORTER
    r.steps += 1
    if r.steps >= r.look_at:
        r.stepped(r.perf(), self, r.framework not in _DRIVERS, r.backward_end)


def torch(core, torch):
    """torch's optimizer steps counted (after each step of every optimizer, DDP's, FSDP's); `patch` puts in, for a
    sampled step or a rank watched between steps, the timers around DataLoader batches, backward(), DDP's forward
    and the collectives called through torch.distributed, and GradScaler's scale and update; checkpoint saves
    (torch.save) are followed whenever they run."""
    r = core.REPORTER
    perf = r.perf
    from torch.optim import optimizer as optim_mod

    # torch's step wrapper calls Optimizer._optimizer_step_code, an empty method (the profiler's entry, read anew
    # at each start), after each step of every optimizer: the count takes its place, so a step pays the count
    # alone; a post-hook (where that method is gone) costs a Python call more: ~1.5 us a step, bench/hook_cost.py.
    global _REPORTER, _DRIVERS
    _REPORTER, _DRIVERS = r, core.DRIVERS
    if callable(getattr(optim_mod.Optimizer, "_optimizer_step_code", None)):
        optim_mod.Optimizer._optimizer_step_code = _optimizer_step_code
    else:
        optim_mod.register_optimizer_step_post_hook(_optimizer_step_code)
    table = []  # (owner, name, original, wrapper): in place only while patched

    from torch.utils.data import dataloader
    base = dataloader._BaseDataLoaderIter
    orig_next = base.__next__

    def __next__(self):
        t0 = perf()
        batch = orig_next(self)
        r.batch(perf() - t0, t0, _batch_size(batch) if r.sampling else None)
        return batch
    table.append((base, "__next__", orig_next, core._wraps(orig_next, __next__)))

    orig_backward = torch.Tensor.backward
    engine = _autograd_engine(torch)

    def backward(self, *args, **kwargs):
        t0 = perf()
        compute_end, handle = [], None
        if engine is not None and r.sampling and getattr(self, "grad_fn", None) is not None:
            handle = _mark_compute_end(engine, self.grad_fn, compute_end, perf)
        try:
            out = orig_backward(self, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        end = perf()
        # The wait measured: from the end of its computation (none if DDP queued nothing after ours).
        r.backward(self, end - t0, t0, end - compute_end[0] if compute_end else 0.0)
        return out
    table.append((torch.Tensor, "backward", orig_backward, core._wraps(orig_backward, backward)))
    _grad_scaler(r, torch, table)

    dist = getattr(torch, "distributed", None)
    if dist is not None and getattr(dist, "is_available", lambda: False)():
        for name in core.COLLECTIVES:
            orig = getattr(dist, name, None)
            if callable(orig):
                table.append((dist, name, orig, core._wraps(orig, _timed(r, orig, core.COMM))))
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
            table.append((DDP, "forward", DDP.forward, core._wraps(DDP.forward, _timed(r, DDP.forward, core.FORWARD))))
        except ImportError:
            pass
        import atexit
        atexit.register(_let_collective_threads_finish, r)
    r.patch, r.rewatch = _patcher(table, r), _rewatch(core, r, torch)
    torch.save = core._wraps(torch.save, _saves(r, torch.save))
    torch.load = core._wraps(torch.load, _loads(r, torch.load))
    r.patch(True)  # the first step is sampled


def _patcher(table, r):
    """patch(on): every wrapper of `table` in place (on) or its original back; a name someone else has
    patched since is left as they left it. Off also takes the one-shot forward hook out (_rewatch)."""
    state = [False]

    def patch(on):
        if on == state[0]:
            return
        state[0] = on
        for owner, name, orig, wrapper in table:
            now = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if now is (orig if on else wrapper):
                setattr(owner, name, wrapper if on else orig)
        if not on and r.rewatch is not None:
            r.rewatch(False)
    return patch


def _rewatch(core, r, torch):
    """A one-shot global forward hook, put back at each look of the writer thread while the rank is watched:
    a module's forward that finishes is work done (evaluating, under no_grad or inference_mode too), seen at
    the cost of one hook call a look; and a save's bytes written since the last look (/proc/self/io)."""
    from torch.nn.modules import module as nn_module
    hold, quiet = [None], []

    def seen(module, args, output):
        r.active, r.busy = r.perf(), core.BUSY[core.FORWARD]
        h, hold[0] = hold[0], None
        if h is not None:
            h.remove()  # the module iterates a copy of the hooks: taking ours out here is safe

    def rewatch(on=True):
        if not on:
            h, hold[0] = hold[0], None
            if h is not None:
                h.remove()
            return
        if hold[0] is None:
            if not quiet:  # torch.compile's modules warn of any global hook: of this one, they need not
                import warnings
                warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
                quiet.append(True)
            hold[0] = nn_module.register_module_forward_hook(seen)
        if r.saves:
            written = _written_bytes()
            if written is not None and r.save_written is not None and written > r.save_written:
                r.active, r.busy = r.perf(), core.SAVING
            r.save_written = written
    return rewatch


def _saves(r, orig, where=lambda args, kwargs: args[1] if len(args) > 1 else kwargs.get("f"), step=None):
    """A checkpoint save (torch.save, DCP's save, a framework's; `where`: the file or folder it writes, `step`:
    the framework's step, from its arguments): work done while its bytes are written, and once the outermost
    one has returned, the rank's last checkpoint (_checkpointed: its step, path, bytes, seconds). A save on
    another thread than the program's (DCP's async_save writes each tensor with torch.save from its own) is
    part of one already counted."""
    import functools
    import threading

    @functools.wraps(orig)
    def save(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return orig(*args, **kwargs)
        outermost = not r.saves
        r.saves += 1
        written = r.save_written = _written_bytes()
        t0 = r.perf()
        r.active, r.busy = t0, "saving a checkpoint"
        if outermost and r.steps and r.on and r.lock is not None:
            # Said now, from the program's thread: torch.save opens its file holding the GIL, so a save stuck
            # there stops the writer thread too; its hang then counts from the save's start, and says so.
            with r.lock:
                r._write(t0, busy=True)
        try:
            out = orig(*args, **kwargs)
        finally:
            r.saves = max(0, r.saves - 1)
            r.active = r.perf()
        if outermost and r.on:
            try:
                path = _path(where(args, kwargs))
                after = _written_bytes()
                size = _size(path) if path else None
                _checkpointed(r, path, size if size is not None else after - written if after is not None and
                              written is not None else None, r.active - t0, out if _is_future(out) else None,
                              step(args, kwargs) if step is not None else None)
            except Exception as e:  # the save itself went as it goes without the hook
                r.fail("reading a checkpoint save", e)
        return out
    return save


def _checkpointed(r, path, size, seconds, future=None, step=None):
    """A checkpoint saved (its outermost save returned; `future`: an async save's, landed later): the rank's
    last checkpoint, in a record at once (after the first step) and in every record after it."""
    if r.lock is None:
        r._start()
    with r.lock:
        v = r.values
        for key in [k for k in v if k.startswith("ckpt_")]:
            del v[key]
        v.update(ckpt_step=step if step is not None else r.framework_step if r.framework_step is not None else r.steps,
                 ckpt_at=round(r.wall(), 3), ckpt_seconds=round(seconds, 3))
        v.update({k: x for k, x in (("ckpt_path", path), ("ckpt_bytes", size)) if x is not None})
        v.update({"ckpt_async": True} if future is not None else {})
        if r.steps:  # (before it, a record would end the watchdog's startup rule: docs/watchdog.md)
            r._write(r.perf(), busy=True, checkpoint="saved")
        if future is not None:
            at = v["ckpt_at"]

            def landed(_):  # on the saver's thread: a record that says when, and its bytes now written
                with r.lock:
                    if v.get("ckpt_at") == at and r.on:  # still the last checkpoint
                        size = _size(path) if path else None
                        v.update(ckpt_landed_at=round(r.wall(), 3), **({"ckpt_bytes": size} if size else {}))
                        r.active = r.perf()
                        r._write(r.active, busy=True, checkpoint="landed")
            future.add_done_callback(_guarded_by(r, landed))


def _guarded_by(r, fn):
    """fn, whose failure is the hook's (said once; the program goes on), never its caller's."""
    def run(*args):
        try:
            fn(*args)
        except Exception as e:
            r.fail("recording a checkpoint", e)
    return run


def _loads(r, orig, where=lambda args, kwargs: args[0] if args else kwargs.get("f")):
    """A load before the rank's first step (torch.load, DCP's load, a framework's resume): its first record's
    `resumed_from`, and as it returns or raises a line in $FABTRAIN_METRICS.load for the agent (not a record:
    one before the first step would end the startup rule). After the first step a load is not looked at."""
    import functools
    import json

    def loaded(args, kwargs, error):
        try:
            path = _path(where(args, kwargs)) or "(an open file or buffer)"
            if error is None and r.on:  # what this run resumed from: its first record says it
                r.values["resumed_from"] = path
            rec = {"ts": round(r.wall(), 3), "pid": __import__("os").getpid(), "rank": r.rank, "path": path,
                   "load": "loaded" if error is None else "failed",
                   "error": None if error is None else ("%s: %s" % (type(error).__name__, error))[:300]}
            with open(r.path + ".load", "a") as f:  # one line, one write (O_APPEND): ranks never interleave
                f.write(json.dumps(rec) + "\n")
        except Exception as e:
            r.fail("reading a checkpoint load", e)

    @functools.wraps(orig)
    def load(*args, **kwargs):
        if r.steps or r.failed:
            return orig(*args, **kwargs)
        try:
            out = orig(*args, **kwargs)
        except Exception as e:  # raised to the program as it was; the agent gets its file and its error
            loaded(args, kwargs, e)
            raise
        loaded(args, kwargs, None)
        return out
    return load


def _path(f):
    """A save's or load's file as a string: a path, or the name of an open file; None for a buffer."""
    import os
    if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
        f = os.fsdecode(os.fspath(f))
        return f or None
    name = getattr(f, "name", None) if f is not None else None
    if name is None:
        path = getattr(f, "path", None)  # DCP's FileSystemWriter / Reader
        return _path(path) if path is not None and not hasattr(path, "name") else None
    return name if isinstance(name, str) and name else None


def _size(path):
    """Bytes of a file, or of every file under a folder (DCP's checkpoint); None if it is not there."""
    import os
    try:
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        return os.path.getsize(path)
    except OSError:
        return None


def _is_future(out):
    return callable(getattr(out, "add_done_callback", None))


def _grad_scaler(r, torch, table):
    """GradScaler (torch.amp; torch.cuda.amp's is a subclass): the loss it scaled is the step's, not the scaled
    one backward() runs on; an update after a step it skipped (inf gradients: the optimizer did not step)
    starts the sample again, as that was no step."""
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:
        return
    orig_scale, orig_update = GradScaler.scale, GradScaler.update

    def scale(self, outputs):
        out = orig_scale(self, outputs)
        if r.sampling and out is not outputs:
            r.scaled = (out, outputs)
        return out

    def update(self, *args, **kwargs):
        r.skipped()
        return orig_update(self, *args, **kwargs)
    table.append((GradScaler, "scale", orig_scale, scale))
    table.append((GradScaler, "update", orig_update, update))


def checkpoint(core, dcp):
    """torch.distributed.checkpoint's saves, followed as torch.save's (DCP writes from its own threads too),
    and its loads; the checkpoint is its `checkpoint_id`, else its storage writer's or reader's path."""
    def where(key):
        return lambda args, kwargs: kwargs.get("checkpoint_id") or kwargs.get(key)
    for name in ("save", "async_save", "save_state_dict"):
        orig = getattr(dcp, name, None)
        if callable(orig):
            setattr(dcp, name, _saves(core.REPORTER, orig, where("storage_writer")))
    for name in ("load", "load_state_dict"):
        orig = getattr(dcp, name, None)
        if callable(orig):
            setattr(dcp, name, _loads(core.REPORTER, orig, where("storage_reader")))


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


def _written_bytes():
    """Bytes this process has written so far (/proc/self/io wchar: every thread's write calls); None: unknown."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


EXIT_GRACE = 0.02  # seconds the GIL is let go at exit at least, and then while another thread is runnable ...
EXIT_WAIT_MAX = 0.5  # ... up to this (_let_collective_threads_finish)


def _let_collective_threads_finish(r):
    """At exit, once the program trained: the GIL let go before the interpreter finalizes, EXIT_GRACE and
    then while another thread of the process waits for a CPU (up to EXIT_WAIT_MAX). A collective's worker
    thread (gloo's) drops its last reference to the work it ran a moment after the work is done; that
    reference holds a Python object (the context torch keeps with a backward), and its release needs the
    GIL: once finalization has begun the thread cannot take it and the process aborts ("terminate called
    without an active exception", exit 134; pytorch/pytorch#190489), even after the program destroyed its
    process group (which does not join gloo's threads). Busy cores can keep the thread from
    running for longer than any fixed wait, hence the second part. A mitigation of torch's race: measured
    without the hook, 11 pairs of ranks in 30 of tests/programs/ddp_exit.py (which exits right after its
    last step) had a rank abort; with it, none (tests/local/test_progress_exit.py)."""
    if not r.steps and r.sample_start is None:
        return
    from time import monotonic, sleep
    end = monotonic() + EXIT_WAIT_MAX
    sleep(EXIT_GRACE)
    while monotonic() < end and _another_thread_runnable():
        sleep(0.005)


def _another_thread_runnable():
    """A thread of this process other than this one in state R (running, or waiting for a CPU). Read here,
    not through fabtrain/node/procfs.py: this file runs inside the user's program, beside the hook, without
    the fabtrain package."""
    import os
    import threading
    try:
        me = str(threading.get_native_id())
        for tid in os.listdir("/proc/self/task"):
            if tid != me:
                with open("/proc/self/task/%s/stat" % tid, "rb") as f:
                    if f.read().rsplit(b")", 1)[-1].split()[:1] == [b"R"]:
                        return True
    except (OSError, ValueError):  # no /proc (not Linux), a thread gone meanwhile
        return False
    return False


def _autograd_engine(torch):
    """The autograd engine, where it takes end-of-backward callbacks (as DDP and FSDP queue theirs); else None."""
    try:
        engine = torch.autograd.Variable._execution_engine
    except AttributeError:
        return None
    return engine if callable(getattr(engine, "queue_callback", None)) else None


def _mark_compute_end(engine, grad_fn, into, perf):
    """When a backward's computation ends, before what runs after it: DDP's and FSDP's end-of-backward
    callbacks wait there for their gradient collectives (the time a rank waits for the slowest one). The
    root's pre-hook runs first in the backward and queues our callback then, ahead of theirs (queued once
    their last gradient is ready): it notes the time into `into`. Nothing of the gradients is touched."""
    def note():
        into.append(perf())

    def pre_hook(grad_outputs):
        try:
            engine.queue_callback(note)
        except Exception:  # no callback this time: the whole backward counts as compute
            pass
        return None
    try:
        return grad_fn.register_prehook(pre_hook)
    except Exception:  # a node that takes no hook: as above
        return None


def _timed(r, orig, part):
    perf = r.perf

    def call(*args, **kwargs):
        t0 = perf()
        out = orig(*args, **kwargs)
        r.add(part, perf() - t0, t0)
        return out
    return call


def _safe(r):
    """A callback the framework calls: whatever fails in it is the hook's failure, never the loop's."""
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                fn(*args, **kwargs)
            except Exception as e:
                r.fail("the %s callback" % r.framework, e)
        run.__name__ = fn.__name__
        return run
    return wrap


def _add_callback(core, trainer, cls, framework):
    try:
        if framework == "Lightning":
            if not any(type(c).__name__ == cls.__name__ for c in trainer.callbacks):
                trainer.callbacks.append(cls())
        else:
            trainer.add_callback(cls)
    except Exception as e:
        core.REPORTER.fail("adding the %s callback" % framework, e)


def lightning(core, module):
    r = core.REPORTER
    Trainer, Callback = module.Trainer, module.Callback

    class FabtrainProgress(Callback):
        """fabtrain's progress records (added by the launcher's hook; it changes nothing)."""

        @_safe(r)
        def on_train_start(self, trainer, pl_module):
            total = None
            try:
                total = trainer.estimated_stepping_batches
            except Exception:  # not known before the loop, or infinite
                total = None
            if not core._finite(total) or total <= 0:
                total = trainer.max_steps if core._finite(trainer.max_steps) and trainer.max_steps > 0 else None
            r.framework_values("lightning", trainer.global_step, {"total_steps": int(total)} if total else None)

        @_safe(r)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if r.framework_step == trainer.global_step and r.framework == "lightning":
                return  # no optimizer step in this batch (gradient accumulation)
            values = {"epoch": trainer.current_epoch}  # an int: every step (the logged tensors only when due)
            if r.timed is not None:  # a sampled step ended: a record is written now
                for source in (trainer.logged_metrics, trainer.progress_bar_metrics):
                    for key, v in list(source.items())[:core.MAX_NAMES]:
                        values[key] = v
                for key in ("train_loss", "loss"):
                    if key in values and core._number(values[key]) is not None:
                        values["loss"] = values[key]
                        break
            r.framework_values("lightning", trainer.global_step, values, write=True)

        @_safe(r)
        def on_train_end(self, trainer, pl_module):  # what it logged for its last step, for the last record
            values = dict(list(trainer.logged_metrics.items())[:core.MAX_NAMES])
            for key in ("train_loss", "loss"):
                if core._number(values.get(key)) is not None:
                    values["loss"] = values[key]
                    break
            r.framework_values("lightning", trainer.global_step, values)
            with r.lock:  # its last step on file already, with an earlier loss: said again, with this one
                if r.on and r.steps and r.steps == r.written_steps and r.loss_at == r.steps:
                    r._write(r.perf())

    orig_init = Trainer.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        _add_callback(core, self, FabtrainProgress, "Lightning")
    Trainer.__init__ = core._wraps(orig_init, __init__)
    # Its checkpoints (ModelCheckpoint calls it): torch.save into a buffer, then the buffer's bytes to the file.
    Trainer.save_checkpoint = _saves(r, Trainer.save_checkpoint,
                                     lambda args, kwargs: args[1] if len(args) > 1 else kwargs.get("filepath"),
                                     lambda args, kwargs: args[0].global_step)


def transformers(core, module):
    r = core.REPORTER
    from transformers import TrainerCallback

    class FabtrainProgress(TrainerCallback):
        """fabtrain's progress records (added by the launcher's hook; it changes nothing)."""

        @_safe(r)
        def on_train_begin(self, args, state, control, **kwargs):
            r.framework_values("transformers", state.global_step,
                               {"total_steps": state.max_steps} if state.max_steps and state.max_steps > 0 else None)

        @_safe(r)
        def on_log(self, args, state, control, logs=None, **kwargs):
            values = dict(logs or {})
            if "learning_rate" in values:
                values["lr"] = values["learning_rate"]
            r.framework_values("transformers", state.global_step, values)

        @_safe(r)
        def on_step_end(self, args, state, control, **kwargs):
            r.framework_values("transformers", state.global_step, {"epoch": state.epoch}, write=True)

    orig_init = module.Trainer.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        _add_callback(core, self, FabtrainProgress, "Hugging Face")
    module.Trainer.__init__ = core._wraps(orig_init, __init__)
    if callable(getattr(module.Trainer, "_save_checkpoint", None)):  # safetensors' writes, not torch.save's
        module.Trainer._save_checkpoint = _saves(r, module.Trainer._save_checkpoint, lambda args, kwargs: __import__(
            "os").path.join(args[0].args.output_dir, "checkpoint-%d" % args[0].state.global_step),
            lambda args, kwargs: args[0].state.global_step)
    if callable(getattr(module.Trainer, "_load_from_checkpoint", None)):  # resume_from_checkpoint
        module.Trainer._load_from_checkpoint = _loads(r, module.Trainer._load_from_checkpoint,
                                                      lambda args, kwargs: args[1] if len(args) > 1 else None)


def accelerate(core, module):
    r = core.REPORTER
    Accelerator = module.Accelerator
    orig_init, orig_log = Accelerator.__init__, Accelerator.log

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if r.framework == "torch":
            r.framework = "accelerate"

    def log(self, values, step=None, *args, **kwargs):
        out = orig_log(self, values, step, *args, **kwargs)
        values = dict(values) if isinstance(values, dict) else None
        for key in ("loss", "train_loss", "train/loss"):  # the loss it logs is the step's loss, as Lightning's
            if values and core._number(values.get(key)) is not None:
                values["loss"] = values[key]
                break
        r.framework_values("accelerate", None, values)
        return out
    Accelerator.__init__ = core._wraps(orig_init, __init__)
    Accelerator.log = core._wraps(orig_log, log)
