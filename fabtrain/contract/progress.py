"""Progress records as the readers see them: which trainer a metrics record belongs to.

The writer is the launcher's progress hook (fabtrain/node/progress.py), which runs inside the user's
program and so imports nothing of fabtrain: it keeps its own copy of the two names below, and
tests/unit/test_contract.py holds the two copies equal.
"""

from fabtrain.contract.identity import Trainer

AUTO = "auto"  # a record's "source" when the hook wrote it, not the program
ENV_INSTRUMENT = "FABTRAIN_INSTRUMENT"  # "0": no instrumentation (job.watchdog.instrument: false)


def row(process, rec):
    """The trainer a metrics record of `process`'s file belongs to, for the views.

    A program's own records and the auto records of the process fabtrain
    started (or of local rank 0 among its descendants: torchrun's first
    worker) are the process's; another descendant's auto records are its own
    trainer, ``<process>.rank<rank>`` (torchrun's other workers). A Trainer (contract/identity.py)."""
    r = rec.get("rank")
    if rec.get("source") != AUTO or not rec.get("child") or rec.get("local_rank") in (None, 0) or \
            not isinstance(r, int) or isinstance(r, bool):
        return Trainer(process)
    return Trainer(process, r)


def process_of(name):
    """The process a trainer of the views is (row's inverse): "trainer-0.rank3" -> "trainer-0". For a reader
    that holds a trainer's name as text; a Trainer says it itself (`.process`)."""
    return Trainer.of(name).process
