"""UserFacing: what a node op raises for a refusal the user reads as one line, not a crash.

Its own module so that every node module (workspace, jobid's callers, history,
ops) can refuse without importing the ops."""


class UserFacing(Exception):
    """A refusal to report as one line, not a crash."""
