"""The one way a job process is started on a node: node ops' `start`, and the agent's restart.

Both run a job.json process spec (``launch``, ``env``, ``cwd``, ``log``,
``run``) through the launcher (launch.py), append its output to its log and
write its run record; the agent, on `on_failure: restart`, starts the same
specs again as the next generation. Standard library only.
"""
import os
import select
import time

from fabtrain.contract.jobfolder import JobFolder
from fabtrain.node import atomic, gpulease, launch, procfs


def expand(value, ws):
    return value.replace("$WS", ws)


def program_of(record, procs, kids):
    """The program a launcher runs: from its record, or the first child it forked."""
    pid = record.get("program_pid")
    if pid and procfs.alive(pid, record.get("program_create_time"), procs):
        return pid
    children = [procs[k] for k in kids.get(record["pid"], ()) if k in procs and not procs[k].dead]
    return min(children, key=lambda p: (p.start_ticks, p.pid)).pid if children else None


def prepare(proc, ws, base_env, generation=0):
    """The argv, environment and working directory of a process spec on this node ($WS and ~ expanded).

    `generation` is the job's restart count (0 at `fab start-*`, g for the
    agents' g-th restart), after the Slurm attempts before this one
    (`restarts_before`, attempts.py): programs read it as torchrun's workers do.
    """
    env = dict(base_env)
    count = str(generation + int(proc.get("restarts_before", 0)))
    env.update(FABTRAIN_RESTART_COUNT=count, TORCHELASTIC_RESTART_COUNT=count)
    for k, v in proc["env"].items():
        v = expand(v, ws)
        if k == "PATH":
            v = v.replace("$PATH", base_env.get("PATH", "/usr/bin:/bin"))
            v = ":".join(os.path.expanduser(part) for part in v.split(":"))
        env[k] = v
    argv = [expand(a, ws) for a in proc["launch"]]
    argv[0] = os.path.expanduser(argv[0])
    cwd = expand(proc["cwd"], ws)
    if not os.path.isdir(cwd):
        os.makedirs(cwd, exist_ok=True)
    return argv, env, cwd


def record(proc, ws, pid, starter=None):
    """Write the run record of a process just started as `pid` (the launcher: its session and group leader).
    `starter`: the daemon that started it, where that is not fabtrain (mpirank.py; kill.starter)."""
    st = procfs.stat(pid)
    run = {"name": proc["name"], "role": proc["role"], "rank": proc["rank"], "pid": pid,
           "pgid": pid, "create_time": st.create_time if st else time.time(),
           "argv": [expand(a, ws) for a in proc["argv"]], "started_at": time.time()}
    if starter:
        run["starter"] = starter
    atomic.write_json(expand(proc["run"], ws), run)
    return run


def spawn(proc, ws, base_env, generation=0, leases=()):
    """Start one process through the launcher (its own session, nohup, line-buffered), stdin /dev/null.

    `leases`: descriptors of the job's GPU leases on this node (gpulease), inherited by the launcher so
    that the leases live as long as it does; the agent is also told their numbers, to hand them on."""
    argv, env, cwd = prepare(proc, ws, base_env, generation)
    if leases and proc["role"] == "agent":
        env[gpulease.FDS_ENV] = ",".join(str(fd) for fd in leases)
    log = os.open(expand(proc["log"], ws), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    ready, told = os.pipe()  # the launcher writes its program's pid on `told` (launch.READY_ENV)
    env[launch.READY_ENV] = str(told)
    try:
        import subprocess  # here: every node-side call imports this module, few of them spawn

        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, close_fds=True, pass_fds=tuple(leases) + (told,))
    except BaseException:
        os.close(ready)
        raise
    finally:
        os.close(log)
        os.close(told)
    p.ready_fd = ready  # read (and closed) by name_programs
    return p, record(proc, ws, p.pid)


def name_programs(started, ws, procs_by_name, deadline):
    """Add each launcher's program to its run record (the pid to show), once it has forked it.

    Each launcher writes its program's pid on the pipe spawn() gave it, and this sleeps in poll() on
    those pipes: no CPU while the launchers start. (It polled /proc every 10 ms before: on a machine
    where 64 nodes start at once, a launcher waits seconds for the CPU, and the polling of 64 node ops
    took more of it than the launchers needed.) A pipe that ends without a pid is a launcher that
    exited first; a launcher that has not answered by `deadline` keeps a record without the program's
    pid, which the agent and `fab status` find among its children."""
    pending = {p.ready_fd: (p, record) for p, record in started}
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLIN)
    try:
        while pending:
            left = deadline - time.time()
            if left <= 0:
                return
            for fd, _ in poller.poll(left * 1000):
                p, record = pending.pop(fd)
                poller.unregister(fd)
                data = os.read(fd, 64)
                os.close(fd)
                program = int(data) if data.strip().isdigit() else None
                st = procfs.stat(program) if program else None
                if st is not None and not st.dead:
                    record.update(program_pid=program, program_create_time=st.create_time)
                    atomic.write_json(expand(procs_by_name[record["name"]]["run"], ws), record)
    finally:
        for fd in pending:
            os.close(fd)


def clear_exit(job_dir, name):
    """A process's exit record from an earlier run of it (and any reservation left by a launcher killed
    outright), before it starts again: the launcher writes a new one when it ends."""
    run = JobFolder(job_dir).run
    for entry in os.listdir(run) if os.path.isdir(run) else ():
        if entry == name + ".exit" or entry.startswith(name + ".exit.pending."):
            try:
                os.unlink(os.path.join(run, entry))
            except OSError:
                pass
