"""One rank's start under `job.launcher: mpirun` (see fabtrain/plan/mpirun.py).

mpirun's daemon (orted) runs this on the rank's node, in the node's
workspace, with OMPI_COMM_WORLD_RANK set. It finds the rank's process spec in
the node's job.json (written by node ops' start, which may still be running
on this node: it waits for it), points stdin at /dev/null and stdout and
stderr at the rank's log, writes its run record, and becomes the launcher
(exec): the rank then runs exactly as a process started by node ops does.
"""
import json
import os
import sys
import time

from fabtrain.contract.launcher import SCRIPT
from fabtrain.contract.jobfolder import JobFolder, job_folder
from fabtrain.node import procfs, spawn

WAIT = 60.0  # seconds node ops' start may take on this node after mpirun reached it


def read_job(jd, deadline):
    path = JobFolder(jd).job_json
    while True:
        if os.path.exists(os.path.join(jd, SCRIPT)):  # written after job.json: both are there
            with open(path) as f:
                return json.load(f)
        if time.time() > deadline:
            sys.exit("fabtrain: %s did not appear within %g s: was the job started on this node?" % (path, WAIT))
        time.sleep(0.05)


def parent():
    """Who started this rank here: Open MPI's daemon (orted), or mpirun itself on its own node. sshd
    started the daemon without the job marker, and it outlives the job when mpirun dies badly: the
    record names it, so that the agent and kill-all end it (kill.starter)."""
    ppid = os.getppid()
    st, cmd = procfs.stat(ppid), procfs.cmdline(ppid)
    if st is None or not cmd:
        return None
    return {"pid": ppid, "create_time": st.create_time, "command": os.path.basename(cmd[0])}


def main(ws, job_id):
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    job = read_job(job_folder(ws, job_id).path, time.time() + WAIT)
    spec = next((p for p in job["processes"] if p.get("started_by") and p["rank"] == rank), None)
    if spec is None:
        sys.exit("fabtrain: rank %d is not a process of job %s on node %s: mpirun placed it on the wrong node"
                 % (rank, job_id, job["node"]))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FABTRAIN_")}
    argv, env, cwd = spawn.prepare(spec, ws, base_env)
    log = os.open(spawn.expand(spec["log"], ws), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(cwd)
    spawn.record(spec, ws, os.getpid(), starter=parent())
    os.execvpe(argv[0], argv, env)
