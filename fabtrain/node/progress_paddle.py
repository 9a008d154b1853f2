"""What paddle adds to the progress records: its optimizers' steps, its backward() and its DataLoader's batches.

Loaded by the hook (progress.py) once the program imports paddle, as progress_frameworks.py is for the others:
paddle's patches are always in (every paddle step is sampled), as its loss is read at each step. Standard library
only (paddle's classes come from the module given).
"""


def paddle(core, paddle):
    r = core.REPORTER
    size = core._part("frameworks")._batch_size
    import paddle.optimizer as popt
    base = popt.Optimizer
    perf = r.perf
    for cls in {base} | {getattr(popt, n) for n in dir(popt)
                         if isinstance(getattr(popt, n), type) and issubclass(getattr(popt, n), base)}:
        orig = cls.__dict__.get("step")
        if orig is None or getattr(orig, "_fabtrain", False):
            continue

        def make(orig):
            def step(self, *args, **kwargs):
                t0 = perf()
                out = orig(self, *args, **kwargs)
                r.add(core.OPTIMIZER, perf() - t0, t0)
                r.framework = "paddle"
                _paddle_lr(r, self)
                r.step()
                # every step sampled (its wrappers are always in), so each is looked at
                r.sampling, r.sample_start, r.look_at = True, r.perf(), 0
                return out
            step = core._wraps(orig, step)
            step._fabtrain = True
            return step
        cls.step = make(orig)
    orig_backward = paddle.Tensor.backward

    def backward(self, *args, **kwargs):
        t0 = perf()
        out = orig_backward(self, *args, **kwargs)
        r.backward(self, perf() - t0, t0)
        return out
    paddle.Tensor.backward = core._wraps(orig_backward, backward)
    try:
        from paddle.io import DataLoader
        orig_iter = DataLoader.__iter__

        def __iter__(self):
            return _PaddleBatches(r, orig_iter(self), size)
        DataLoader.__iter__ = core._wraps(orig_iter, __iter__)
    except ImportError:
        pass


def _paddle_lr(r, optimizer):
    try:
        lr = optimizer.get_lr()
    except Exception:
        return
    if isinstance(lr, float) and lr == lr:
        r.values["lr"] = lr


class _PaddleBatches:
    """A paddle DataLoader's iterator, timed: the time waiting for each batch is data_time."""

    def __init__(self, r, it, size):
        self._r, self._it, self._size = r, it, size

    def __iter__(self):
        return self

    def __next__(self):
        r = self._r
        t0 = r.perf()
        batch = next(self._it)
        r.batch(r.perf() - t0, t0, self._size(batch) if r.sampling else None)
        return batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)
