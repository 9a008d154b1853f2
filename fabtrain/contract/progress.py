"""Progress records as the readers see them: which trainer a metrics record belongs to.

The writer is the launcher's progress hook (fabtrain/node/progress.py), which runs inside the user's
program and so imports nothing of fabtrain: it keeps its own copy of the two names below, and
tests/unit/test_contract.py holds the two copies equal.
"""

AUTO = "auto"  # a record's "source" when the hook wrote it, not the program
ENV_INSTRUMENT = "FABTRAIN_INSTRUMENT"  # "0": no instrumentation (job.watchdog.instrument: false)


def row(process, rec):
    """The trainer a metrics record of `process`'s file belongs to, for the views.

    A program's own records and the auto records of the process fabtrain
    started (or of local rank 0 among its descendants: torchrun's first
    worker) are the process's; another descendant's auto records are its own
    trainer, ``<process>.rank<rank>`` (torchrun's other workers)."""
    if rec.get("source") != AUTO or not rec.get("child") or rec.get("local_rank") in (None, 0):
        return process
    r = rec.get("rank")
    return "%s.rank%s" % (process, r) if isinstance(r, int) and not isinstance(r, bool) else process


def process_of(name):
    """The process a trainer of the views is (row's inverse): "trainer-0.rank3" -> "trainer-0"."""
    process, sep, rank = name.rpartition(".rank")
    return process if sep and rank.isdigit() else name
