"""Structs for node-side code: classes of named fields, frozen by default, without `dataclasses`.

Every agent defines ~20 of them when it starts (its policy's facts, ledger and
actions; the coordinator's board). Made by the dataclasses module they cost
~45 ms of CPU (it imports `inspect`, and generates each class's methods with
exec), half of what an agent spends importing itself: at a start, every node's
agent pays it at once, and where many nodes share a machine (64 sshd nodes on
2 cores in bench/scale.py) `fab start-trainers` waits behind it. Here a class
gets generic methods, in microseconds.

    @record                      frozen: equal by value, hashable, fields cannot be set
    class Stop:
        name: str
        reason: str = ""
        fields: dict = factory(dict)   # a fresh dict for each instance

    @record(frozen=False)        fields can be set; equal by value, not hashable
    replace(stop, reason="...")  a copy with some fields changed
    as_dict(stop)                {field: value}, shallow

Fields are the class's own annotations, in order (no inheritance between records).

Standard library only: node ops ship this module to nodes with no deployed code.
"""
from __future__ import annotations


class factory:
    """A field's default made anew for each instance (dataclasses' default_factory)."""
    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


def record(cls=None, *, frozen: bool = True):
    if cls is None:
        return lambda c: record(c, frozen=frozen)
    names = tuple(cls.__dict__.get("__annotations__", {}))
    defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}
    known = frozenset(names)
    kind = cls.__name__

    def __init__(self, *args, **kwargs):
        if len(args) > len(names):
            raise TypeError("%s() takes %d arguments, %d were given" % (kind, len(names), len(args)))
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in known or key in values:
                raise TypeError("%s() got %s argument %r" % (kind, "an unexpected" if key not in known else
                                                             "a second", key))
            values[key] = value
        for n in names:
            if n in values:
                value = values[n]
            elif n in defaults:
                value = defaults[n]
                if type(value) is factory:
                    value = value.make()
            else:
                raise TypeError("%s() missing required argument %r" % (kind, n))
            object.__setattr__(self, n, value)

    def values(self) -> tuple:
        return tuple(getattr(self, n) for n in names)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return values(self) == values(other)

    def __repr__(self):
        return "%s(%s)" % (kind, ", ".join("%s=%r" % (n, getattr(self, n)) for n in names))

    cls.__init__, cls.__eq__, cls.__repr__ = __init__, __eq__, __repr__
    cls.__record_fields__ = names
    if frozen:
        def __setattr__(self, name, value):
            raise AttributeError("cannot assign to field %r of a frozen %s" % (name, kind))

        def __delattr__(self, name):
            raise AttributeError("cannot delete field %r of a frozen %s" % (name, kind))

        cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__
        cls.__hash__ = lambda self: hash(values(self))
    else:
        cls.__hash__ = None
    return cls


def replace(obj, **changes):
    """A copy of a record with some fields changed (dataclasses.replace)."""
    return type(obj)(**{**as_dict(obj), **changes})


def as_dict(obj) -> dict:
    return {n: getattr(obj, n) for n in obj.__record_fields__}
