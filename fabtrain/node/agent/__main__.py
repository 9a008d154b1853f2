"""``python -m fabtrain.node.agent <job_dir> [--restarted]``"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from .early import catch
    catch()  # first: a SIGTERM while the agent starts is kept for it, not the default death (early.py)
    if not argv:
        print("usage: python -m fabtrain.node.agent <job_dir> [--restarted]", file=sys.stderr)
        return 2
    from fabtrain.contract.events import EventKind
    from .loop import Agent
    agent = None
    try:
        agent = Agent(argv[0], restarted="--restarted" in argv[1:])
        return agent.run()
    except SystemExit:
        raise
    except BaseException:
        # A bug, not a kill: say so, and do not let the keeper restart us into the same bug.
        import traceback  # here, not above: ~10 ms of every agent's start for a crash that should not happen
        traceback.print_exc()
        if agent is not None:
            try:
                agent.events.write(EventKind.AGENT_ERROR, "the agent crashed: %s"
                                   % traceback.format_exc().strip().splitlines()[-1])
                agent.shutdown(1)
            except Exception:
                pass
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
