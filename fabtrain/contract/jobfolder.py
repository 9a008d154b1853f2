"""A job's folder on a node, <workspace>/jobs/<job id>/, and its files by name.

    job.json        what runs here: the plan's part for this node (node ops' start writes it)
    events.jsonl    what happened: the agent's events and node ops' kill's (fabtrain.contract.events)
    health.json     the agent's latest snapshot (fabtrain.contract.records: HEALTH_PROCESS, HEALTH_AGENT)
    killed          the marker a user's stop (or a start that failed elsewhere) leaves: who, then why
    launch.py       the launcher (fabtrain.contract.launcher)
    run/            each process's run record (<name>.json) and exit record (<name>.exit); the agent's
    logs/           each process's output, <name>.log
    metrics/        each trainer's metrics records, <name>.jsonl; beside it <name>.jsonl.load, the progress
                    hook's line for each checkpoint load before a rank's first step (loaded, or failed:
                    contract/checkpoints.py), which the agent reads when the process fails
    stacks/         the stacks dumped before a hang's teardown, <name>.txt

Node ops, the agent, a Slurm step and a pod name these files through JobFolder; the controller names
the ones it collects by their relative names (EVENTS, METRICS).
"""
import os

from fabtrain.contract.events import read_events

JOB = "job.json"
EVENTS = "events.jsonl"
HEALTH = "health.json"
KILLED = "killed"
RUN, LOGS, METRICS, STACKS = "run", "logs", "metrics", "stacks"
# The hook's loads beside a metrics file: $FABTRAIN_METRICS + LOAD (progress_frameworks._loads writes it so,
# from the path it is given: it cannot import this module).
LOAD = ".load"


class JobFolder:
    __slots__ = ("path",)

    def __init__(self, path):
        self.path = path

    def __repr__(self):
        return "JobFolder(%r)" % self.path

    @property
    def job_id(self):
        return os.path.basename(self.path)

    @property
    def job_json(self):
        return os.path.join(self.path, JOB)

    @property
    def events(self):
        return os.path.join(self.path, EVENTS)

    @property
    def health(self):
        return os.path.join(self.path, HEALTH)

    @property
    def killed(self):
        return os.path.join(self.path, KILLED)

    @property
    def run(self):
        return os.path.join(self.path, RUN)

    @property
    def logs(self):
        return os.path.join(self.path, LOGS)

    @property
    def metrics(self):
        return os.path.join(self.path, METRICS)

    @property
    def stacks(self):
        return os.path.join(self.path, STACKS)

    def run_record(self, name):
        return os.path.join(self.path, RUN, name + ".json")

    def exit_record(self, name):
        return os.path.join(self.path, RUN, name + ".exit")

    def log(self, name):
        return os.path.join(self.path, LOGS, name + ".log")

    def metrics_file(self, name):
        return os.path.join(self.path, METRICS, name + ".jsonl")

    def read_events(self, offset=0):
        """events.jsonl's records from byte `offset` on (fabtrain.contract.events.read_events)."""
        return read_events(self.events, offset)
