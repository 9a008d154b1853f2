"""Errors a user can cause, and how they reach the terminal."""
import os
import sys

# The exit code of a command whose reader went away: a shell's for a process killed by SIGPIPE (128 + 13).
READER_GONE = 141


class UserError(Exception):
    """A mistake in something the user gave us: a file, a flag, a value.

    Caught at the edge (the fab task, the CLI) and printed as ONE line,
    with exit code 2 and no traceback. The message names what is wrong and
    where, e.g. ``cluster.yaml: nodes[1].port: must be 1..65535, got 70000``.
    """

    exit_code = 2

    def __str__(self) -> str:  # keep it to one line whatever was passed in
        return " ".join(str(self.args[0]).split()) if self.args else "error"


class UserErrors(UserError):
    """Every mistake found in one thing the user gave (a whole cluster file): one line each."""

    def __init__(self, errors):
        super().__init__(*errors)

    def __str__(self) -> str:
        return "\n".join(" ".join(str(e).split()) for e in self.args)

def reader_gone() -> int:
    """The reader of stdout went away (`fab status | head -3`): stop quietly, as `yes | head` does.

    Whatever is still buffered for stdout goes to /dev/null, so neither this
    write nor Python's flush at exit ends in a BrokenPipeError traceback.
    Returns the exit code to end with.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return READER_GONE
