"""A job's folder on a node, <workspace>/jobs/<job id>/, and its files by name.

    job.json        what runs here: the plan's part for this node (node ops' start writes it)
    events.jsonl    what happened: the agent's events and node ops' kill's (fabtrain.contract.events)
    health.json     the agent's latest snapshot (fabtrain.contract.records: HEALTH, every part of it)
    killed          the marker a user's stop (or a start that failed elsewhere) leaves: who, then why
                    (contract/states.py: killed_marker its text, read_marker reads it back)
    code/           the job's own copy of the deployed code (node/workspace.py snapshot_code; a pod's: a link)
    attempts/<K>/   a requeued Slurm job's files of attempt K (node/attempts.py)
    disrupted       the marker a node's platform leaves when it takes the node's part away: kind, then cause
                    (contract/states.py: disruption_marker, read_disruption)
    disrupted.before the same marker of this node's earlier part, kept by the supervisor that starts the part
                    again (a pod replacing an evicted one): the new agent reports that loss first (node/hosted.py)
    coordinator.json the coordinator's own state, on the node that hosts it (node/coordination/server.py)
    launch.py       the launcher (fabtrain.contract.launcher)
    run/            each process's run record (<name>.json) and exit record (<name>.exit); the agent's;
                    events.reserve, the room the agent keeps for its last events on a full disk; deadline,
                    the moment the agent would have begun its fence by, which the launchers' dead-man
                    reads (contract/launcher.py: deadline_text; a job whose agents fence only)
    logs/           each process's output, <name>.log
    metrics/        each trainer's metrics records, <name>.jsonl; beside it <name>.jsonl.load, the progress
                    hook's line for each checkpoint load before a rank's first step (loaded, or failed:
                    contract/checkpoints.py), which the agent reads when the process fails
    stacks/         the stacks dumped before a hang's teardown, <name>.txt

Node ops, the agent, a Slurm step and a pod name these files through JobFolder (job_folder: a job of a
workspace's JOBS); the controller names the ones it collects by their relative names (EVENTS, METRICS).
Two writers cannot import this module and name their files from the paths they are given: the launcher
(node/launch.py: run/<name>.exit, stacks/) and the progress hook in the user's program (LOAD).

A Slurm job's own folder (its batch shell's, on the filesystem every node shares; fabtrain/slurm/script.py
writes most of it) is SlurmFolder: the plan of every node, the agents' secret, the time-limit warning, the
ports drawn in the allocation, the attempt running, and Slurm's output.
"""
import os

from fabtrain.contract.events import read_events

JOBS = "jobs"  # <workspace>/jobs/: a folder a job
JOB = "job.json"
EVENTS = "events.jsonl"
HEALTH = "health.json"
KILLED = "killed"
DISRUPTED = "disrupted"
DISRUPTED_BEFORE = DISRUPTED + ".before"
COORDINATOR = "coordinator.json"
CODE, ATTEMPTS = "code", "attempts"
EVENTS_RESERVE = "events.reserve"  # in run/
DEADLINE = "deadline"  # in run/: the agent's fence deadline, for the launchers' dead-man (node/deadman.py)
RUN, LOGS, METRICS, STACKS = "run", "logs", "metrics", "stacks"
# The hook's loads beside a metrics file: $FABTRAIN_METRICS + LOAD (progress_frameworks._loads writes it so,
# from the path it is given: it cannot import this module).
LOAD = ".load"


class _Folder(object):
    """A folder whose files are named by the class: `path` and each file's path below it."""
    __slots__ = ("path",)

    def __init__(self, path):
        self.path = path

    def __repr__(self):
        return "%s(%r)" % (type(self).__name__, self.path)

    def _in(self, name):
        return os.path.join(self.path, name)


class JobFolder(_Folder):
    __slots__ = ()

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
    def disrupted(self):
        return os.path.join(self.path, DISRUPTED)

    @property
    def disrupted_before(self):
        return os.path.join(self.path, DISRUPTED_BEFORE)

    @property
    def coordinator(self):
        return os.path.join(self.path, COORDINATOR)

    @property
    def code(self):
        return os.path.join(self.path, CODE)

    @property
    def attempts(self):
        return os.path.join(self.path, ATTEMPTS)

    @property
    def events_reserve(self):
        return os.path.join(self.path, RUN, EVENTS_RESERVE)

    @property
    def run(self):
        return os.path.join(self.path, RUN)

    @property
    def deadline(self):
        return os.path.join(self.path, RUN, DEADLINE)

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


def job_folder(workspace, job_id):
    """The JobFolder of job `job_id` in `workspace` (an id already checked: fabtrain.contract.jobid)."""
    return JobFolder(os.path.join(workspace, JOBS, job_id))


# A Slurm job's folder (fabtrain/slurm/script.py: job_folder), shared by the nodes of its allocation.
PLAN = "plan.json"  # every node's job.json, as the batch shell wrote it, `@slurm-node-K@` for the addresses
SECRET = "secret"  # the agents' secret, never on a command line
TIME_LIMIT = "time-limit"  # left by the batch shell when Slurm's --signal warns of the time limit
BUSY = "busy-%d.json"  # node K's busy ports (node/allocports.py): {"node": K, "busy": [port, ...]}
DRAWN_PORTS = "ports.json"  # {"ports": {setting: port}}, the `auto` ports drawn in the allocation
ATTEMPT = "attempt.json"  # {"attempt", "attempts", "line"} of the attempt running
CAUSE = "requeue-cause-%d"  # the batch shell's, for attempt K: it requeued the job itself (the time limit)
OUTPUT = "slurm-%s.out"  # Slurm's output of the job, by its Slurm job id


class SlurmFolder(_Folder):
    __slots__ = ()

    plan = property(lambda self: self._in(PLAN))
    secret = property(lambda self: self._in(SECRET))
    time_limit = property(lambda self: self._in(TIME_LIMIT))
    drawn_ports = property(lambda self: self._in(DRAWN_PORTS))
    attempt = property(lambda self: self._in(ATTEMPT))

    def busy(self, index):
        return self._in(BUSY % index)

    def cause(self, attempt):
        return self._in(CAUSE % attempt)

    def output(self, slurm_job):
        return self._in(OUTPUT % slurm_job)
