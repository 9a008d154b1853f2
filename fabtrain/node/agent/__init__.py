"""The node agent (watchdog): ``python -m fabtrain.node.agent <job_dir>``.

One per job per node, started with the job by node ops through the launcher.
It watches the job's processes and acts on what it sees, on every node at
once through the coordinator (coordination.py); see docs/watchdog.md.

    loop.py        the run loop: observe, decide, execute
    policy.py      the rules, pure: observation + ledger in, actions out
    progress.py    the hang rule's reading of progress (pure; policy.py asks it)
    jobjudge.py    the ranks judged: the rank to blame after a hang, the stragglers
    supervisor.py  process contexts: find, poll and stop a job process (through fabtrain/node/kill.py,
                   as `fab kill-all` does)
    link.py        the coordinator: hosting it on the first node, the client, its status lines
    relaunch.py    a restart's next generation on this node
    events.py      events.jsonl, its one writer
    snapshot.py    health.json and the heartbeat
    samplers.py    host and GPU readings
    keeper.py      the agent's own life: lock, run record, the keeper that restarts it
    early.py       a SIGTERM that comes while the agent still starts, kept for it (the first thing main does)

Kept small on purpose: standard library only (plus nvidia-ml-py where an
NVIDIA driver is present); no torch, no psutil.
"""
