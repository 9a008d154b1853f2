"""What node and controller say to each other, defined once: both sides import it, neither is imported here.

Standard library only, and shipped to every node with the node runtime
(fabtrain.plan.runtime, fabtrain.remote.rpc), so the agent that writes a
record and the controller that reads it back use the same definition:

    states.py    how a process and a job are and end: ProcessState, JobState, exit codes, signal names
    jobid.py     the job-id form, checked wherever an id is received
    events.py    EventKind, the kinds of events.jsonl's records, and its named sets (outcomes, causes)
    slurm.py     what a Slurm job's output and folder say between attempts (why it ended, the attempt running)
    opreplies.py what each node op answers: the type the node builds its reply with and the controller reads it by
    portdraw.py  drawing `auto` ports (the controller's, and a Slurm allocation's), and the tokens a Slurm plan holds for them

Importing this package imports none of its modules: a node-side call pays only for what it uses.
"""

# The node runtime: the packages of fabtrain a node runs (with fabtrain/__init__.py), shipped by node ops'
# bundle (fabtrain.remote.rpc) and `fab deploy`, versioned by fabtrain.plan.runtime, written out by
# fabtrain.node.runtime.
RUNTIME_PACKAGES = ("contract", "node")
