"""THE job-id form, for the controller and the nodes alike.

A job id is made by `fabtrain.plan.plan.new_job_id` (UTC date, time and four
hex digits: 20261124-045501-5d89) and names a folder, <workspace>/jobs/<id>.
Every id fabtrain receives -- typed (`--job`, `--resume-from`), read from the
controller's state, sent in a node operation, read back from a node -- is held
to this form where it is received, so none can name a path outside jobs/ (`..`,
`/`, a NUL byte) or be anything but an id. Standard library only: the node
side imports it too, and never trusts the controller to have checked.
"""
import re

JOB_ID_RE = re.compile(r"\A[0-9]{8}-[0-9]{6}-[0-9a-f]{4}\Z")
EXAMPLE = "20261124-045501-5d89"
SHOWN = 64  # characters of a bad id quoted back: a 5,000-character one is still one short line


def is_job_id(value):
    return isinstance(value, str) and bool(JOB_ID_RE.match(value))


def problem(value):
    """None for a job id, else the one line that says it is not one."""
    if is_job_id(value):
        return None
    if isinstance(value, str):
        shown = repr(value[:SHOWN]) + ("... (%d characters)" % len(value) if len(value) > SHOWN else "")
    else:
        shown = repr(value)[:SHOWN]
    return "bad job id %s: a job id looks like %s" % (shown, EXAMPLE)


def checked(value, error, optional=False):
    """value if it is a job id (or None, where optional: the current job); else raises
    error(the one line) -- UserError on the controller, UserFacing on a node."""
    if optional and value is None:
        return None
    why = problem(value)
    if why:
        raise error(why)
    return value
