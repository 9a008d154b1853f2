"""Node ops' replies: the frame that carries them, and the refusals a node answers with.

A request's reply is the line after SENTINEL on the node-side process's stdout:
{"ok": true, "result": ...} or {"ok": false, "error": "one line", "code": ..., "detail": {...}}.
`error` is what the user reads; `code` (one of the refusal codes below, or absent) is what a caller
acts on, with `detail` holding what it acts with: the controller branches on the code, never on the
words.
"""
from fabtrain.contract import jobid

SENTINEL = "@@fabtrain-reply@@"  # the line before each reply: what comes before it is an op's streamed output

# A start's line, before its reply, on the node that hosts the coordinator, when the controller asks
# for it ("tell_listening"; not a Slurm allocation's or a pod's start, whose stdout is the user's): its
# agent listens.
COORDINATOR_LISTENS = "@@fabtrain-coordinator-listens@@"

# -- refusal codes -------------------------------------------------------------------------------
JOB_RUNNING = "job_running"  # a start refused: another job runs here; detail {"job_id", "processes": [names]}


class UserFacing(Exception):
    """A refusal to report as one line, not a crash; `code` and `detail` for the refusals a caller acts on."""

    def __init__(self, message, code=None, detail=None):
        super().__init__(message)
        self.code = code
        self.detail = detail


def job_running(job_id, processes):
    """The refusal of a start while another job's processes still run on the node."""
    return UserFacing("job %s is still running here (%s); stop it with `fab kill-all` or pass --force"
                      % (job_id, ", ".join(processes)), JOB_RUNNING, {"job_id": job_id, "processes": list(processes)})


def running_job(detail):
    """(job id, [process names]) from a JOB_RUNNING refusal's detail; None where a node sent something else."""
    if not isinstance(detail, dict):
        return None
    job_id, processes = detail.get("job_id"), detail.get("processes")
    if not jobid.is_job_id(job_id) or not isinstance(processes, list) or not all(isinstance(p, str) for p in processes):
        return None
    return job_id, processes


def refused(e):
    """The reply that says a refusal."""
    reply = {"ok": False, "error": str(e)}
    if e.code:
        reply.update(code=e.code, detail=e.detail or {})
    return reply
