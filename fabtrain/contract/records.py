"""The fields of the records a node writes and the controller reads back, defined once.

Each record is a table, field -> type. The node's writers build their records from these tables
(`record` refuses a field a table does not name), and the controller's checks
(fabtrain/controller/records.py) are made from the same tables, so a field the agent writes is a
field the controller keeps: they cannot drift apart again (an agent once wrote each process's
`launcher_pid` and `step_rate` while the controller's checks knew only an older `wrapper_pid`, and
both were dropped on their way to `fab status` and the dashboard).

The types, which the controller's checks turn into checkers:

    number   a finite int or float        integer  an int               flag    true/false
    name     a short name (node, process) rank     an int, or text      state   a ProcessState's value
    signal   a signal's name              reason   a sentence           text    a line of text
"""

NUMBER, INTEGER, FLAG, NAME, RANK, STATE, SIGNAL, REASON, TEXT = (
    "number", "integer", "flag", "name", "rank", "state", "signal", "reason", "text")

# health.json's "processes": the agent's view of each process of the job on its node.
HEALTH_PROCESS = {
    "name": NAME, "role": NAME, "rank": RANK, "pid": INTEGER, "launcher_pid": INTEGER, "state": STATE,
    "exit_code": INTEGER, "signal": SIGNAL, "cpu_percent": NUMBER, "rss": NUMBER, "children": NUMBER,
    "zombies": INTEGER,
    "last_progress": NUMBER,  # when it last showed progress: a metrics record, else CPU or I/O
    "last_record": NUMBER,  # when it last wrote a metrics record
    "step_rate": NUMBER,  # steps a second over the straggler window, while it runs
    "hung": FLAG, "killed_by_agent": REASON, "gpu_mem": NUMBER,
    # checkpoints (the progress hook's, node/agent/checkpoints.py): its last step, its last checkpoint, what
    # this generation loaded before its first step, and a restarted one's `resumed` sentence
    "step": NUMBER, "ckpt_step": NUMBER, "ckpt_at": NUMBER, "ckpt_path": TEXT, "ckpt_bytes": NUMBER,
    "ckpt_seconds": NUMBER, "resumed_from": TEXT, "resumed": REASON,
}

# health.json's "agent": the agent itself.
HEALTH_AGENT = {"pid": INTEGER, "rss": NUMBER, "cpu_percent": NUMBER, "started": NUMBER, "restarted": FLAG,
                "keeper_pid": INTEGER, "launcher_pid": INTEGER}

# One process in node ops' `status` and `collect` replies (fabtrain/node/ops.py process_record).
STATUS_PROCESS = {"name": NAME, "state": STATE, "pid": INTEGER, "program_pid": INTEGER, "launcher_pid": INTEGER,
                  "exit_code": INTEGER, "signal": SIGNAL, "started_at": NUMBER, "uptime": NUMBER,
                  "zombies": INTEGER, "last_line": TEXT,
                  "left_behind": INTEGER,  # its processes still alive under its launcher after its exit
                  "reason": REASON}  # why it ended where no exit code says (its launcher died)

# events.jsonl's named fields (fabtrain.contract.events): an event may carry others, kept where they
# are plain values. "pids" is a list of integers; "stacks" {process: {"frame"} | {"why"}}.
EVENT = {"kind": NAME, "ts": NUMBER, "node": NAME, "name": NAME, "role": NAME, "rank": RANK, "reason": REASON,
         "signal": SIGNAL, "exit_code": INTEGER, "pid": INTEGER, "peer": NAME, "origin": NAME,
         "on_failure": NAME, "generation": INTEGER, "backoff": NUMBER,
         "restarts_left": INTEGER, "blame": REASON}

# A trainer's metrics/<name>.jsonl line (the user's program writes it: workload/ shows how); other
# fields are kept where they are plain values.
# The launcher's progress hook (fabtrain/node/progress.py) writes the same records with "source": "auto",
# its rank's place (local_rank, pid, child) and the step's timings (seconds, means since its last record).
METRIC = {"ts": NUMBER, "step": NUMBER, "epoch": NUMBER, "loss": NUMBER, "samples_per_s": NUMBER,
          "eval_loss": NUMBER, "lr": NUMBER, "role": NAME, "rank": RANK,
          "local_rank": INTEGER, "pid": INTEGER, "source": NAME, "framework": NAME, "child": FLAG,
          "between_steps": FLAG, "total_steps": NUMBER, "step_time": NUMBER, "data_time": NUMBER,
          "compute_time": NUMBER, "comm_time": NUMBER, "forward_time": NUMBER, "backward_time": NUMBER,
          "optimizer_time": NUMBER, "busy": REASON, "busy_at": NUMBER, "loss_step": NUMBER}
# The metrics the run history keeps of a past job, a series each.
SERIES = ("ts", "step", "epoch", "loss", "samples_per_s", "eval_loss", "lr", "step_time", "data_time",
          "compute_time", "comm_time")


def record(fields, **values):
    """A record of table `fields` (every field of it, None where not given); a field the table does not
    name is a bug in the writer, and raises."""
    unknown = set(values) - set(fields)
    if unknown:
        raise TypeError("not fields of this record: %s" % ", ".join(sorted(unknown)))
    return {field: values.get(field) for field in fields}
