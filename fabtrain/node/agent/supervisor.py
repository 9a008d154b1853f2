"""Process contexts: the one place on a node that knows how to find and stop a job process.

A job process is three things: its launcher (fabtrain/node/launch.py, the
session and group leader, a child subreaper), its program (the launcher's
child, the pid fabtrain shows), and everything the program started, which
stays among the launcher's descendants even when it leaves the process group
or clears its environment. A `ProcessContext` follows one of them for the
agent (poll), and stops it (close: SIGTERM now, escalate: SIGKILL after the
grace), through the kill helpers (fabtrain/node/kill.py) that ``fab kill-all`` uses too.

Standard library only: node ops ship this module to nodes with no deployed code.
"""
from __future__ import annotations

import json
import os
import signal

from fabtrain.node import launch, procfs
from fabtrain.node.atomic import read_json
from fabtrain.node.coordination.stragglers import StepRate, in_collectives
from fabtrain.node.agent import checkpoints
from fabtrain.node.kill import send, signal_all, starter, trusted
from fabtrain.node.progress import EXITING
from fabtrain.contract.states import ProcessState, signal_of, state_of
from fabtrain.contract.jobfolder import JobFolder

CPU_PROGRESS = 0.01  # CPU seconds per second (1% of a core) that count as activity
RATE_WINDOW = 10.0  # seconds of records a step rate is measured over (the straggler rule's input)
NO_RECORD_WAIT = 2.0  # a launcher that outlives its program this long without recording an exit code is broken


TAIL = 64 * 1024  # bytes of new records read at most a step: a program that writes faster is read from its tail
PARSE_ALL = 16 * 1024  # below this many new bytes every record is read; above, only each rank's last
TIMINGS = ("step_time", "data_time", "compute_time", "comm_time")
SEND_SAMPLES = 4  # a rank's send backlog is told once this many samples are in (over RATE_WINDOW, or the last ones)


class RankSteps:
    """One rank's records in a metrics file: its last step, when it last made progress, its timings."""

    __slots__ = ("step", "changed", "auto", "timings", "total_steps", "busy", "ckpt", "saves", "resumed_from",
                 "framework", "sends")

    def __init__(self):
        self.step = None
        self.changed: float | None = None
        self.auto = False
        self.busy: str | None = None  # what the hook last saw it do between steps (evaluating, saving, ...)
        self.timings: list = []  # (time, {step_time, data_time, compute_time, comm_time}) over RATE_WINDOW
        self.sends: list = []  # (time, its processes' TCP send backlog, bytes received unread), while in collectives
        self.total_steps = None
        # Checkpoints (the hook's ckpt_* fields, agent/checkpoints.py): the last one, each path's last save
        # (path -> (step, at)), what this generation loaded before its first step.
        self.ckpt: dict | None = None
        self.saves: dict = {}
        self.resumed_from: str | None = None
        self.framework: str | None = None

    def take(self, rec: dict, at: float) -> None:
        """A new record of this rank. From the launcher's hook (``source: "auto"``) only a new step is
        progress; a record the program writes itself is progress by being written, as it always was."""
        step = rec.get("step")
        step = step if isinstance(step, (int, float)) and not isinstance(step, bool) else None
        self.auto = rec.get("source") == "auto"
        busy_at = rec.get("busy_at")
        if self.auto and rec.get("between_steps") and isinstance(busy_at, (int, float)) and \
                not isinstance(busy_at, bool):
            # Work done between steps (a forward, a batch, a save's bytes), at the time the hook saw it.
            self.changed, self.busy = max(self.changed or 0.0, min(at, float(busy_at))), str(rec.get("busy"))
        elif not self.auto or (step is not None and step != self.step) or self.changed is None:
            self.changed, self.busy = at, None
        if step is not None:
            self.step = step
        if isinstance(rec.get("total_steps"), int):
            self.total_steps = rec["total_steps"]
        if "ckpt_step" in rec or "resumed_from" in rec:
            checkpoints.take(self, rec)
        t = {k: float(rec[k]) for k in TIMINGS if isinstance(rec.get(k), (int, float))
             and not isinstance(rec.get(k), bool) and rec[k] >= 0}
        if t:
            self.timings.append((at, t))
            while self.timings and at - self.timings[0][0] > RATE_WINDOW:
                self.timings.pop(0)

    def mean_timings(self) -> dict:
        """Each timing's mean over the last RATE_WINDOW seconds of records."""
        out = {}
        for k in TIMINGS:
            xs = [t[k] for _, t in self.timings if k in t]
            if xs:
                out[k] = sum(xs) / len(xs)
        return out

    def send(self, backlog: int, at: float, unread: int = 0) -> None:
        """A sample of the TCP send backlog of this rank's processes, and of the bytes they hold received and
        unread (TcpQueues), kept over RATE_WINDOW (and at least the last SEND_SAMPLES, where the interval is long)."""
        self.sends.append((at, backlog, unread))
        while len(self.sends) > SEND_SAMPLES and at - self.sends[0][0] > RATE_WINDOW:
            self.sends.pop(0)

    def age(self, at: float) -> None:
        """Not sampled now: samples older than RATE_WINDOW go."""
        self.sends = [s for s in self.sends if at - s[0] <= RATE_WINDOW]

    def send_backlog(self) -> tuple | None:
        """(the share of samples in which its sends were backed up, the mean backlog in bytes, the share of
        samples in which it held bytes received and unread), once there are SEND_SAMPLES samples: the
        communication straggler's signal."""
        if len(self.sends) < SEND_SAMPLES:
            return None
        xs = [b for _, b, _ in self.sends]
        n = len(xs)
        return sum(1 for b in xs if b > 0) / n, sum(xs) / n, sum(1 for _, _, u in self.sends if u > 0) / n


class Progress:
    """What counts as a process's progress (docs/watchdog.md, "The hang rule")."""

    def __init__(self, floor: float, records_size: int = 0):
        self.floor = floor  # its start, or a restarted agent's
        self.records_size = records_size  # a restarted job's metrics file holds the last generation's records
        self.first_record: float | None = None
        self.last_record: float | None = None
        self.last_activity = floor
        self.cpu_seen: float | None = None
        self.cpu_percent = 0.0
        self.steps = StepRate(RATE_WINDOW)
        self.ranks: dict = {}  # rank (the records' `rank`; None: records without one) -> RankSteps
        self.live_ranks: set | None = None  # the RANKs of the program's live processes (None: not known)
        self.partial = b""  # the start of a record not yet ended by its newline

    def records(self, path: str | None) -> None:
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        if st is not None and st.st_size < self.records_size:
            self.records_size, self.ranks, self.partial = 0, {}, b""  # the program started its file anew
        if st is None or st.st_size <= self.records_size:
            self.last_record = self.stalest(self.last_record)
            return
        at = max(st.st_mtime, self.floor)
        lines = self.read_new(path, st.st_size)
        self.records_size = st.st_size
        self.take(lines, at)
        self.first_record = self.first_record or at
        self.last_record = self.stalest(at)
        self.last_activity = max(self.last_activity, at)

    def read_new(self, path: str, size: int) -> list:
        """The whole records appended since the last read (at most the last TAIL bytes of them)."""
        start = max(self.records_size, size - TAIL)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(size - start)
        except OSError:
            return []
        if start > self.records_size:
            self.partial = b""
            data = data.split(b"\n", 1)[1] if b"\n" in data else b""
        data = self.partial + data
        complete, _, self.partial = data.rpartition(b"\n")
        self.partial = self.partial[-TAIL:]
        return complete.split(b"\n") if complete else []

    def take(self, lines: list, at: float) -> None:
        """Each rank's records among `lines`: all of them when few, else from the end, each rank's last."""
        seen: set = set()
        every = sum(len(x) for x in lines) <= PARSE_ALL
        for line in (lines if every else reversed(lines)):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            rank = rec.get("rank") if isinstance(rec.get("rank"), int) and not isinstance(rec.get("rank"), bool) \
                else None
            if not every and rank in seen:
                continue
            seen.add(rank)
            self.ranks.setdefault(rank, RankSteps()).take(rec, at)
            if not every and self.ranks.keys() <= seen:
                break
        steps = [r.step for r in self.watched() if r.step is not None]
        if steps:
            self.steps.add(at, min(steps))

    def watched(self) -> list:
        """The ranks the hang rule watches: those whose process is alive (a rank of a torchrun that has
        exited is not hung), every one where that is not known."""
        live = self.live_ranks
        return [r for k, r in self.ranks.items() if not live or k is None or k in live]

    def stalest(self, default: float | None) -> float | None:
        """The process's last progress: that of its rank that progressed least recently (the process
        is hung once ANY of its ranks stops), else the last record. A rank whose hook said its interpreter
        exits has progressed as late as the process's last activity, too: a teardown (modules freed, threads
        joined, a program's own atexit upload) writes no record but uses CPU or writes its log, which on a
        busy machine may take longer than hang_timeout; an exit blocked for good (a deadlock) does neither."""
        times = [max(r.changed, self.last_activity) if r.busy == EXITING else r.changed
                 for r in self.watched() if r.changed is not None]
        return min(times) if times else default

    def output(self, path: str | None) -> None:
        try:
            self.last_activity = max(self.last_activity, os.stat(path).st_mtime) if path else self.last_activity
        except OSError:
            pass

    def cpu(self, seconds: float, now: float, interval: float) -> None:
        if self.cpu_seen is not None:
            delta = seconds - self.cpu_seen
            self.cpu_percent = round(100.0 * max(0.0, delta) / max(1e-3, interval), 1)
            if delta >= max(CPU_PROGRESS * interval, 1.0 / procfs.CLK_TCK):
                self.last_activity = max(self.last_activity, now)
        self.cpu_seen = seconds


class ProcessContext:
    """One process of the job on this node (a job.json `processes` entry)."""

    def __init__(self, spec: dict, job_dir: str, workspace: str, floor: float | None = None, records_from: int = 0):
        self.name, self.role, self.rank = spec["name"], spec["role"], spec["rank"]
        self.workspace = workspace
        self.trusted = False  # its record named a live launcher of ours when loaded: its group is ours
        self.launcher_up = False
        self.run_path = JobFolder(job_dir).run_record(self.name)
        self.exit_path = JobFolder(job_dir).exit_record(self.name)
        self.metrics_path = (spec.get("metrics") or "").replace("$WS", workspace) or None
        self.log_path = (spec.get("log") or "").replace("$WS", workspace) or None
        self.floor = floor  # a restarted agent counts progress from its own start
        self.records_from = records_from  # metrics bytes of earlier generations: not this one's progress
        self.record: dict | None = None
        self.launcher: int | None = None
        self.starter: tuple[int, float] | None = None  # (pid, create time) of Open MPI's daemon that started it
        self.program: int | None = None
        self.program_ctime: float | None = None
        self.family: dict[int, float] = {}  # pid -> create time: everything seen under the launcher
        self.state = ProcessState.NOT_STARTED
        self.exit_code: int | None = None
        self.fenced = False  # its launcher's dead-man ended it (the exit record says FENCED: node/launch.py)
        self.ended_at: float | None = None
        self.launcher_lost = False
        self.program_gone_at: float | None = None
        self.progress: Progress | None = None
        self.rank_of: dict[int, tuple] = {}  # pid -> (create time, its RANK or None)
        self.stopped_since: float | None = None
        self.members: list[int] = []
        self.tree: list[int] = []
        self.zombies: list[tuple[int, int, float]] = []
        self.rss = 0
        self.gpu_mem: int | None = None
        self.close_reason: str | None = None
        self.kill_signal: str | None = None
        self.term_at: float | None = None
        # on_failure restart (agent/checkpoints.py): the job's generation this context runs, what the one
        # before left of this process (its last step, its checkpoints, what it loaded), whether the
        # `resumed` event is written, and what a failed end loaded (computed once, when it failed)
        self.generation = 0
        self.before: dict | None = None
        self.resumed: str | None = None
        self.load_failure: tuple | bool | None = None

    # -- what it is now ------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.record is not None

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def live(self) -> bool:
        return self.started and not self.ended

    @property
    def pid(self) -> int | None:
        """The pid fabtrain shows: the program, or its launcher until the program is known."""
        return self.program or self.launcher

    def launcher_alive(self, procs: dict) -> bool:
        return self.trusted and procfs.alive(self.launcher, self.record.get("create_time"), procs)

    def watched_pids(self) -> list[int]:
        """Pids whose end the agent should hear of at once (pidfds): the program while it runs, the
        launcher until it has gone (it outlives the program while anything the program started lives)."""
        pids = [self.program] if self.live and self.program else []
        if self.launcher and self.launcher_up:
            pids.append(self.launcher)
        return pids

    # -- poll ----------------------------------------------------------------------------

    def poll(self, procs: dict, kids: dict, now: float, tick: bool, interval: float) -> None:
        if self.record is None and not self._load(now, procs):
            return
        launcher_alive = self.launcher_up = self.launcher_alive(procs)
        self._find_program(procs, kids, launcher_alive)
        self._remember_family(procs, kids, launcher_alive)
        if self.ended:
            return
        program_alive = procfs.alive(self.program, self.program_ctime, procs)
        code = launch.read_exit(self.exit_path)
        if code is not None or not launcher_alive:
            self._end(now, code, launcher_alive)
            return
        if not program_alive and self.program is not None:
            # Between the program's end and its launcher's record: a moment, unless the launcher is broken.
            self.program_gone_at = self.program_gone_at or now
            if now - self.program_gone_at > NO_RECORD_WAIT:
                self._end(now, None, launcher_alive)
                return
        main = procs[self.program] if program_alive else procs[self.launcher]
        self.state = state_of(True, main.state)
        self.stopped_since = (self.stopped_since or now) if self.state is ProcessState.STOPPED else None
        self.tree = [p for p in ([self.program] + procfs.descendants(self.program, kids)) if p in procs] \
            if program_alive else []
        self.zombies = [(p, procs[p].ppid, procs[p].create_time) for p in self.tree
                        if procs[p].dead and procs[p].ppid != 1]
        live_tree = [p for p in self.tree if not procs[p].dead]
        self.rss = sum(procs[p].rss for p in live_tree)
        self.progress.live_ranks = self._live_ranks(live_tree, procs, now)
        self.progress.output(self.log_path)
        if tick or self.progress.cpu_seen is None:
            self.progress.cpu(sum(procs[p].cpu for p in live_tree), now, interval)
        self.progress.records(self.metrics_path)  # last: an exiting rank's progress is the activity just seen

    def sample_sends(self, queues, at: float) -> None:
        """On a tick: the TCP send backlog of each live rank of a running trainer that spends any time in
        collectives (stragglers.in_collectives), summed over the processes whose RANK it is (rank_of).
        Nothing is read for a program of one rank; the samples of a rank not sampled now age out."""
        if self.progress is None:
            return
        ranks = {}
        for rank, r in self.progress.ranks.items():
            if self.live and self.role == "trainer" and rank is not None and in_collectives(r.mean_timings()):
                ranks[rank] = r
            elif r.sends:
                r.age(at)
        pids = {pid: seen[1] for pid, seen in self.rank_of.items() if seen[1] in ranks}
        if not pids:
            return
        per: dict = {}
        for pid, (backlog, unread) in queues.sample(pids).items():
            was = per.get(pids[pid], (0, 0))
            per[pids[pid]] = (was[0] + backlog, was[1] + unread)
        for rank, (backlog, unread) in per.items():
            ranks[rank].send(backlog, at, unread)

    def _live_ranks(self, pids: list, procs: dict, now: float) -> set | None:
        """The RANKs in the environments of the program's live processes (torchrun's workers each have
        theirs), each read once (again while the process is young: a fork not yet exec'd shows its
        parent's); None where none has one."""
        ranks, cache = set(), {}
        for pid in pids:
            seen = self.rank_of.get(pid)
            ctime = procs[pid].create_time
            if seen is None or seen[0] != ctime or now - ctime < 2.0:
                raw = procfs.parse_environ(procfs.environ_raw(pid)).get(b"RANK")
                seen = (ctime, int(raw) if raw and raw.isdigit() else None)
            cache[pid] = seen
            if seen[1] is not None:
                ranks.add(seen[1])
        self.rank_of = cache
        return ranks or None

    def _load(self, now: float, procs: dict) -> bool:
        record = read_json(self.run_path)
        if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
            return False
        if record["pid"] not in procs or record.get("program_pid", record["pid"]) not in procs:
            # Started after this step's look at /proc (node ops starts the coordinator's agent
            # before the job), and not yet below a pid the table follows: read the launcher and
            # what it runs now, or they would look as if they had ended.
            procs.update(procfs.below([record["pid"]]))
        self.trusted = trusted(record, procs, self.workspace)
        if not self.trusted and procfs.alive(record["pid"], None, procs) and \
                procfs.alive(record["pid"], record.get("create_time"), procs):
            return False  # alive but not ours (no marker, not its own group): a planted record; wait for ops'
        self.record, self.launcher = record, record["pid"]
        self.starter = starter(record, procs)  # checked once, while it is known to be what the record says
        self.program = record.get("program_pid")
        self.program_ctime = record.get("program_create_time")
        self.state = ProcessState.RUNNING
        self.progress = Progress(max(record.get("started_at") or now, self.floor or 0), self.records_from)
        return True

    def _find_program(self, procs: dict, kids: dict, launcher_alive: bool) -> None:
        if self.program is not None or not launcher_alive:
            return
        children = [procs[k] for k in kids.get(self.launcher, ()) if k in procs]
        if children:  # the first child the launcher forked: later ones are re-parented orphans
            first = min(children, key=lambda p: (p.start_ticks, p.pid))
            self.program, self.program_ctime = first.pid, first.create_time

    def _remember_family(self, procs: dict, kids: dict, launcher_alive: bool) -> None:
        for pid in list(self.family):
            if not procfs.alive(pid, self.family[pid], procs):
                del self.family[pid]
        # Only a group we saw our launcher lead is ours to scan (never a pgid a record merely claims).
        self.members = procfs.group(self.launcher, procs) if self.trusted else []
        # A group member born after the end may be a new group that reuses the pid: not ours.
        found = {pid for pid in self.members if self.ended_at is None or procs[pid].create_time <= self.ended_at}
        if launcher_alive:  # whatever is under the launcher is ours, however it got there
            found.update(procfs.descendants(self.launcher, kids))
        found.discard(self.launcher)
        for pid in found:
            p = procs.get(pid)
            if p is not None and not p.dead:
                self.family.setdefault(pid, p.create_time)

    def _end(self, now: float, code: int | None, launcher_alive: bool) -> None:
        self.ended_at = now
        self.exit_code = code
        self.fenced = code is not None and launch.read_exit_record(self.exit_path)[1]
        self.launcher_lost = code is None and not launcher_alive
        before_boot = (self.record.get("create_time") or now) < procfs.BOOT_TIME
        self.state = state_of(False, exit_code=code, before_boot=before_boot)
        self.tree, self.zombies, self.rss = [], [], 0
        if self.progress:
            self.progress.cpu_percent = 0.0

    def leftovers(self, procs: dict) -> list[tuple[int, float]]:
        """Live family members once the process has ended: what it left behind."""
        if not self.ended:
            return []
        return [(pid, ctime) for pid, ctime in sorted(self.family.items())
                if pid != self.launcher and procfs.alive(pid, ctime, procs)]

    def starter_alive(self, procs: dict) -> tuple[int, float] | None:
        """The daemon that started it (kill.starter), while it lives."""
        return self.starter if self.starter and procfs.alive(*self.starter, procs) else None

    @property
    def signal(self) -> int | None:
        return signal_of(self.exit_code)

    # -- stop ----------------------------------------------------------------------------

    def targets(self, procs: dict) -> list[int]:
        """Everything of this process to signal, its launcher excepted (it stays to record the exit)."""
        live = {pid for pid, ctime in self.family.items() if procfs.alive(pid, ctime, procs)}
        if self.program and procfs.alive(self.program, self.program_ctime, procs):
            live.add(self.program)
        live.discard(self.launcher)
        return sorted(live)

    def close(self, reason: str, now: float, procs: dict) -> None:
        """SIGTERM (and SIGCONT) to everything of it; the grace starts now."""
        if self.term_at is not None or not self.live:
            return
        self.close_reason, self.kill_signal, self.term_at = reason, "SIGTERM", now
        targets = self.targets(procs) or ([self.launcher] if self.launcher else [])
        signal_all(targets, signal.SIGTERM)

    def escalate(self, procs: dict) -> None:
        """SIGKILL to whatever of it survived the grace."""
        self.kill_signal = "SIGKILL"
        targets = self.targets(procs) or ([self.launcher] if self.launcher else [])
        signal_all(targets, signal.SIGKILL)

    def kill_launcher(self) -> None:
        """A launcher that cannot even record the exit code after its program is gone."""
        if self.launcher:
            send(self.launcher, signal.SIGKILL)


class Markers:
    """Which processes carry this workspace's job marker; each process's environment is read once.

    `refresh` runs every step over every process of the machine, so what it does for
    each is a set operation or one comparison: only a pid not seen before, or one
    whose start time changed (a reused pid), has its environment read. Given the
    pids the table just read (`read`), only those are compared."""

    def __init__(self, workspace: str):
        self.ws = workspace.encode()
        self.mark = procfs.marker(workspace)
        self.seen: dict[int, float] = {}  # pid -> the start time its environment was read for
        self.carrying: dict[int, tuple] = {}  # pid -> (job id, role, rank), marked processes only

    def refresh(self, procs: dict, read=None) -> None:
        for pid in self.seen.keys() - procs.keys():
            del self.seen[pid]
            self.carrying.pop(pid, None)
        seen = self.seen
        candidates = procs.keys() if read is None else set(read) & procs.keys()
        for pid in [pid for pid in candidates if seen.get(pid) != procs[pid].create_time]:
            self.seen[pid] = procs[pid].create_time
            raw = procfs.environ_raw(pid)
            # Most processes are not ours: a search of the raw bytes, the dict only for a carrier
            # (where 200 local nodes share a machine, parsing every new process's environment was
            # 40% of an agent's CPU).
            env = procfs.parse_environ(raw) if procfs.carries(raw, self.mark) else {}
            if env.get(b"FABTRAIN_WORKSPACE") == self.ws:
                self.carrying[pid] = (env.get(b"FABTRAIN_JOB_ID", b"?").decode(),
                                      env.get(b"FABTRAIN_ROLE", b"?").decode(), env.get(b"FABTRAIN_RANK", b"?").decode())
            else:
                self.carrying.pop(pid, None)

    def marked(self) -> list[int]:
        return list(self.carrying)


def job_running(run_dir: str, procs: dict) -> bool:
    """A job still has a process on this node whose launcher lives and has not recorded an exit."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return False
    for name in names:
        if name.endswith(".json"):
            record = read_json(os.path.join(run_dir, name))
            if isinstance(record, dict) and procfs.alive(record.get("pid"), record.get("create_time"), procs) \
                    and launch.read_exit(os.path.join(run_dir, name[:-5] + ".exit")) is None:
                return True
    return False
