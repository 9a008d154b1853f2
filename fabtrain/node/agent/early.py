"""A stop asked for while the agent still starts (its imports, job.json, its folders: a tenth of a second or more).

Until the agent's own handler is in (loop.Agent.setup), SIGTERM's default ends the process at once and
writes nothing: no health.json, no event, a node whose record of the job is missing. A Slurm step that ends
and a kubelet that evicts a pod send theirs that early. `catch` is the first thing the agent's main does;
`taken` hands what came to the agent, which then stops as for any SIGTERM once it is set up."""
import signal

_caught: list = []


def _note(signum, frame):
    _caught.append(signum)


def catch() -> None:
    stops = (signal.SIGTERM, signal.SIGINT)
    for sig in stops:
        signal.signal(sig, _note)
    # A starter that blocked them across its fork (none must be lost between the fork and here) left them
    # blocked: one pending is taken now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


def taken():
    """The first stop signal that came before the agent's own handler, or None."""
    return _caught[0] if _caught else None
