"""Who a record speaks of, as typed values: a process of a job, and a trainer of the views (a process, or a rank of it).

A process is named by the plan, "<role>-<index>" ("trainer-3", "pserver-0"), or by its part in the job
("agent"). A trainer of the views is a process, or, under torchrun, one of its ranks whose records the
progress hook wrote into the process's file: "<process>.rank<rank>" ("trainer-0.rank3";
contract/progress.py's `row` makes it). Both are text on the wire and on disk, as they always were; here
the text is read once, when the value is made, into the parts the readers use (`role`, `index`;
`process`, `rank`). Each is a str, so a record that holds one is written, compared and sorted as before.
Standard library only.
"""

RANK = ".rank"  # between a process and its rank in a trainer's name


class Process(str):
    """A job process's name, with its role and index: Process("trainer-3").role == "trainer", .index == 3;
    Process("agent").role == "agent", .index is None."""

    def __new__(cls, name):
        self = str.__new__(cls, name)
        role, _, index = name.rpartition("-")
        self.role, self.index = (role, int(index)) if role and index.isdigit() else (role or name, None)
        return self

    @classmethod
    def of(cls, name):
        """`name` as a Process (itself where it is one already)."""
        return name if isinstance(name, cls) else cls(name)

    def __reduce__(self):
        return (type(self), (str(self),))


class Trainer(str):
    """A trainer of the views: a process (rank None: the process's own records), or rank `rank` of it."""

    def __new__(cls, process, rank=None):
        process = Process.of(process)
        self = str.__new__(cls, process if rank is None else "%s%s%d" % (process, RANK, rank))
        self.process, self.rank = process, rank
        return self

    @classmethod
    def of(cls, name):
        """A trainer's name as a Trainer (itself where it is one already): "trainer-0.rank3" -> rank 3 of
        trainer-0; a name that names no rank is the process's own."""
        if isinstance(name, cls):
            return name
        process, sep, rank = name.rpartition(RANK)
        return cls(process, int(rank)) if sep and rank.isdigit() else cls(name)

    @property
    def role(self):
        return self.process.role

    def __reduce__(self):
        return (type(self), (self.process, self.rank))
