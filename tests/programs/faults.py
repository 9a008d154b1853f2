"""The faults a test program acts out, from its command line: one parser for every stand-in program.

A fault is a repeatable option ``--FAULT NAME[:ARG[:ARG]]`` whose NAME is the
process it applies to, ``<role>-<rank>`` as FABTRAIN_ROLE and FABTRAIN_RANK
say (or ``*``, every process); `mine` gives this process its arguments.
"""
import argparse
import os

role, rank = os.environ.get("FABTRAIN_ROLE", "trainer"), int(os.environ.get("FABTRAIN_RANK", "0"))
me = f"{role}-{rank}"


def parser(*faults: str) -> argparse.ArgumentParser:
    """--period S (seconds between records) and every fault flag, each repeatable."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--period", type=float, default=0.2)
    for flag in faults:
        ap.add_argument(flag, action="append")
    return ap


def mine(spec):
    """The fault's arguments if it applies to this process (a list, maybe empty), else None."""
    for item in spec or []:
        name, _, rest = item.partition(":")
        if name in (me, "*"):
            return rest.split(":") if rest else []
    return None
