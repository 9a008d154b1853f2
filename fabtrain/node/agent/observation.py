"""What the agent saw, as data: the input of the policy (policy.py's `decide`).

The loop (loop.py) fills an Observation from /proc, the job folder and its
connection to the coordinator; the policy reads it and never looks anywhere else.
"""
from __future__ import annotations

from fabtrain.contract.states import ProcessState
from fabtrain.node.structs import record


@record
class ProcFacts:
    """One job process of this node, as the supervisor saw it."""
    name: str
    role: str
    rank: int
    state: ProcessState = ProcessState.NOT_STARTED
    pid: int | None = None  # the program: the pid fabtrain shows
    launcher: int | None = None
    exit_code: int | None = None
    launcher_lost: bool = False  # the launcher died without recording an exit code
    last_record: float | None = None  # its last new metrics record (None: none yet)
    last_activity: float | None = None  # start, records, log output or CPU time
    # the rank that progressed least recently among those of its metrics records: (rank or None, its last
    # step or None, whether its records are the launcher's hook's (only a new step is progress then, or work the
    # hook saw between steps), what the hook last saw it do between steps or None)
    stalled: tuple | None = None
    stopped_since: float | None = None
    term_at: float | None = None  # when the agent sent it SIGTERM
    kill_signal: str | None = None
    close_reason: str | None = None
    fenced: bool = False  # its launcher's dead-man ended it: the agent let its fence deadline pass (node/deadman.py)
    leftovers: tuple = ()  # (pid, create time) still alive after it ended
    # (pid, create time) of the daemon that started it (Open MPI's orted), alive STARTER_WAIT after the
    # process ended and the job's end was known here: it should have left by itself
    starter: tuple | None = None
    zombies: tuple = ()  # (pid, parent pid, create time) of defunct descendants
    # (path, its step or None, seconds since the load or its first step, (path, step) of the checkpoint saved
    # before it or None) of the checkpoint it loaded, when it failed soon after loading one (agent/checkpoints.py's
    # load_failure): the restart policy's damaged-checkpoint rule
    loaded: tuple | None = None

    @property
    def started(self) -> bool:
        return self.state is not ProcessState.NOT_STARTED

    @property
    def ended(self) -> bool:
        return self.state.ended

    @property
    def live(self) -> bool:
        return self.started and not self.ended


@record
class Stray:
    """A process with this workspace's job marker that no live job process here owns."""
    pid: int
    ctime: float
    job: str
    role: str
    rank: str
    age: float
    job_running: bool  # its job still has a live process on this node


@record
class Peers:
    """The coordinator, as this agent's connection to it knows it."""
    ever_connected: bool = False
    connected: bool = False  # the connection is open now (the kernel on the other side answers)
    silent_for: float | None = None  # seconds since its last line
    lease_age: float | None = None  # seconds since the newest beat it answered was sent (fence.py)
    error: str | None = None
    seen: tuple = ()  # nodes whose agents have spoken to it
    trainers_running: int = 0
    deposed: str | None = None  # a job that elects: why the coordinator this agent hosts stepped down (tenure.py)


@record
class Observation:
    now: float
    procs: tuple = ()
    strays: tuple = ()
    orphans_alive: frozenset = frozenset()  # pids of the ledger's orphans still alive
    killed_by: str | None = None  # who stopped the job on a user's word (states.KILLERS): its `killed` marker
    disrupted: tuple = (None, None)  # (kind, cause) of its `disrupted` marker: the platform took this node
    peers: Peers = Peers()
    must_join: tuple = ()  # nodes whose agents must reach the coordinator
    startup_deadline: float | None = None
    disk_full: str | None = None  # "<path>" when the workspace's disk has no space left
