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

and, for a record within a record (health.json is one): another table, `list_of(type, most)`, and a table's
OTHERS entry, the type of the fields it does not name (kept where they are of it, as a host's measures are).
tests/unit/test_contract_roundtrip.py writes every table's record whole and reads it back through the
controller's checks: a field one side has and the other drops fails it.
"""

NUMBER, INTEGER, FLAG, NAME, RANK, STATE, SIGNAL, REASON, TEXT = (
    "number", "integer", "flag", "name", "rank", "state", "signal", "reason", "text")
OTHERS = "*"  # a table's entry for the fields it does not name: their type


def list_of(kind, most=4096):
    """The type of a list of `kind` (a type's name, or a table), at most `most` items."""
    return ("list", kind, most)

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

# health.json (node/agent/snapshot.py writes it every interval; node ops' `status` and `collect` send it whole, and
# the controller keeps it through these tables): the node's measures, its GPUs, the job as the agent sees it, its
# link to the coordinator, the processes no job owns, the ranks behind, and after a hang the rank to blame.
HEALTH_HOST = {"cpu_percent": NUMBER, "load": list_of(NUMBER, 3), "mem_total": NUMBER, "mem_used": NUMBER,
               "mem_percent": NUMBER, "swap_percent": NUMBER, "disk_free": NUMBER, "disk_total": NUMBER,
               "disk_percent": NUMBER, "net_rx_bps": NUMBER, "net_tx_bps": NUMBER, OTHERS: NUMBER}
HEALTH_GPU = {"index": INTEGER, "name": NAME, "util": NUMBER, "mem_used": NUMBER, "mem_total": NUMBER,
              "temp": NUMBER, "power_w": NUMBER}
HEALTH_JOB = {"status": NAME, "reason": REASON, "origin": NAME, "on_failure": NAME, "generation": INTEGER,
              "restarts_left": INTEGER, "pending": FLAG,
              "out": list_of(NAME), "world_size": INTEGER,  # min_nodes: the nodes that left, the smaller world
              "back": REASON,  # min_nodes: "node3 back in generation 2 (WORLD_SIZE 3)", in that generation
              "spare": FLAG, "slot": NAME,  # a spare node's agent: it is one; the lost node whose slot it holds
              "kept": FLAG,
              "startup_deadline": NUMBER}  # when startup_timeout fails a start that has not come together
HEALTH_COORDINATOR = {"host": NAME, "port": INTEGER, "hosted_here": FLAG, "connected": FLAG, "last_contact": NUMBER,
                      "lease": NUMBER,  # when this node's lease from the coordinator runs from (node/coordination)
                      "fenced": REASON,  # why the coordinator refused this node for good (it left the job)
                      "pulses": INTEGER,  # the coordinator's pulses this agent answered (coordination/pulse.py)
                      "error": REASON, "lost": list_of(NAME), "done": list_of(NAME),
                      # a job that elects (agent/elect.py): the node whose coordinator it follows, and its term
                      "node": NAME, "term": INTEGER}
HEALTH_ORPHAN = {"pid": INTEGER, "name": NAME, "job_id": NAME, "reason": REASON}
# coordination/stragglers.py's rows: by rate (rate, median, since) or by the step's timings (rank, cause, ...)
HEALTH_STRAGGLER = {"node": NAME, "name": NAME, "rate": NUMBER, "median": NUMBER, "since": NUMBER, "rank": INTEGER,
                    "cause": NAME, "ratio": NUMBER, "seconds": NUMBER}
HEALTH_BLAME = {"text": REASON, "job": FLAG}  # job: named from every node's ranks (the coordinator's node)

# One process in node ops' `status` and `collect` replies (fabtrain/node/ops.py process_record).
STATUS_PROCESS = {"name": NAME, "state": STATE, "pid": INTEGER, "program_pid": INTEGER, "launcher_pid": INTEGER,
                  "exit_code": INTEGER, "signal": SIGNAL, "started_at": NUMBER, "uptime": NUMBER,
                  "zombies": INTEGER, "last_line": TEXT,
                  "left_behind": INTEGER,  # its processes still alive under its launcher after its exit
                  "reason": REASON,  # why it ended where no exit code says (its launcher died)
                  "reported_by": NAME}  # "agent": its state as its agent last wrote it (node/elsewhere.py)

# A hang's (or its teardown's) stacks in its event, a process each: {"frame": "path:line in function"} or
# {"why"} (none taken); with several processes under it (torchrun's ranks), `ranks` says each one's.
EVENT_STACK_RANK = {"pid": INTEGER, "rank": INTEGER, "frame": TEXT, "why": TEXT, "collective": NAME}
EVENT_STACK = {"frame": TEXT, "why": TEXT, "ranks": list_of(EVENT_STACK_RANK, 1024)}

# events.jsonl's named fields (fabtrain.contract.events): an event may carry others, kept where they
# are plain values, and those of EVENT_LISTS.
EVENT = {"kind": NAME, "ts": NUMBER, "node": NAME, "name": NAME, "role": NAME, "rank": RANK, "reason": REASON,
         "signal": SIGNAL, "exit_code": INTEGER, "pid": INTEGER, "peer": NAME, "origin": NAME,
         "on_failure": NAME, "generation": INTEGER, "backoff": NUMBER,
         "restarts_left": INTEGER, "blame": REASON}
EVENT_LISTS = {"pids": list_of(INTEGER), "stacks": {OTHERS: EVENT_STACK}}  # stacks: by process

# health.json itself: `events` are the agent's last few events, `peers` the coordinator's last word of each node.
HEALTH = {"ts": NUMBER, "node": NAME, "job_id": NAME, "interval": NUMBER, "host": HEALTH_HOST,
          "gpus": list_of(HEALTH_GPU, 64), "gpu_error": TEXT,  # why no GPU is measured, where one should be
          "processes": list_of(HEALTH_PROCESS, 1024), "agent": HEALTH_AGENT, "peers": {OTHERS: NUMBER},
          "job": HEALTH_JOB, "coordinator": HEALTH_COORDINATOR, "orphans": list_of(HEALTH_ORPHAN, 1024),
          "zombies": INTEGER, "events": list_of(EVENT, 64), "stragglers": list_of(HEALTH_STRAGGLER, 1024),
          "blame": HEALTH_BLAME}

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
    name is a bug in the writer, and raises, unless the table keeps OTHERS."""
    unknown = set(values) - set(fields)
    if unknown and OTHERS not in fields:
        raise TypeError("not fields of this record: %s" % ", ".join(sorted(unknown)))
    out = {field: values.get(field) for field in fields if field != OTHERS}
    out.update((field, values[field]) for field in sorted(unknown))
    return out
