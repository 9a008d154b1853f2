"""A pod's entrypoint (`fab export --k8s`): the pod is a node of the job.

    python3 -m fabtrain.node.pod /etc/fabtrain ROLE --index-env JOB_COMPLETION_INDEX

reads the pod's part of the plan, <dir>/<ROLE>-<index>.json (its job.json,
from the Secret the export wrote; the index from the named variable), starts
it with node ops' start, as `fab start-*` does over SSH (the same launcher,
agent and coordinator), stays while any of it runs, and exits with the job's
outcome: 0 when the agents say the job finished (a pserver the agents stop at
the end included), 1 when it failed, 143 when the pod was told to stop (SIGTERM:
the pod's processes are stopped as `fab kill-all` stops them). A non-zero exit
fails the pod, and so its Job. The container's working directory is the job's
code; the image's own fabtrain is the agent's runtime. As PID 1 it also
reaps whatever is re-parented to it, and copies every process's log to its
stdout, each line prefixed [<pod's node> <process>], for `kubectl logs`.
"""
import json
import os
import signal
import sys
import time

from fabtrain.contract.states import STOP_GRACE
from fabtrain.contract.events import EventKind
from fabtrain.contract.jobfolder import JobFolder
from fabtrain.node import ops
from fabtrain.node.spawn import expand

POLL = 0.2
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fabtrain package in the image


def usage():
    sys.exit("usage: python3 -m fabtrain.node.pod JOB_FILES_DIR ROLE --index-env VARIABLE")


def read_part(files, role, index_env):
    index = os.environ.get(index_env, "")
    if not index.isdigit():
        sys.exit("fabtrain pod: %s is %r, not a pod index" % (index_env, index))
    path = os.path.join(files, "%s-%s.json" % (role, index))
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit("fabtrain pod: cannot read this pod's part %s: %s" % (path, getattr(e, "strerror", None) or e))


def link(target, path):
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.symlink(target, path)


def prepare(job, code_dir):
    """The job's code is the image's (no snapshot to make); the agent runs from the image's fabtrain."""
    ws = os.path.abspath(os.path.expanduser(job["workspace"]))
    os.makedirs(ws, mode=0o700, exist_ok=True)
    link(code_dir, os.path.join(ws, "jobs", job["job_id"], "code"))
    if job.get("agent"):
        link(PACKAGE, os.path.join(expand(job["agent"]["cwd"], ws), "fabtrain"))
    return ws, os.path.join(ws, "jobs", job["job_id"])


class LogFollower:
    """Each process's log on the container's stdout, line by line, prefixed [<node> <name>]: `kubectl logs`."""

    def __init__(self, job, ws):
        self.prefix = job["node"]
        self.logs = [(p["name"], expand(p["log"], ws)) for p in job["processes"] + ([job["agent"]] if job.get("agent") else [])]
        self.offsets = {}
        self.partial = {}

    def poll(self, final=False):
        for name, path in self.logs:
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(name, 0))
                    data = f.read(1 << 20)
            except OSError:
                continue  # not started yet
            self.offsets[name] = self.offsets.get(name, 0) + len(data)
            lines = (self.partial.pop(name, b"") + data).split(b"\n")
            if lines[-1] and not final:
                self.partial[name] = lines[-1]
            for line in lines[:-1] + ([lines[-1]] if final and lines[-1] else []):
                sys.stdout.write("[%s %s] %s\n" % (self.prefix, name, line.decode("utf-8", "replace")))
        sys.stdout.flush()


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def outcome(jd, job, ws):
    # No events (watchdog disabled): the exit codes say it.
    kinds = {ev.get("kind") for ev in JobFolder(jd).read_events()}
    if EventKind.JOB_FAILED in kinds:
        return 1
    if EventKind.FINISHED in kinds:
        return 0
    for proc in job["processes"]:
        try:
            with open(expand(proc["exit"], ws)) as f:
                if f.read().strip() != "0":
                    return 1
        except OSError:
            return 1  # never recorded: its launcher was killed
    return 0


def run(files, role, index_env, code_dir):
    job = read_part(files, role, index_env)
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    ws, jd = prepare(job, code_dir)
    watchdog = job.get("watchdog", {})
    payload = {"job": dict(job, workspace=ws), "roles": sorted({p["role"] for p in job["processes"]})}
    if watchdog.get("enabled", True):
        payload["agent"] = job["agent"]
    reply = ops.op_start(payload)
    for failed in reply["failed"]:
        print("fabtrain pod: %s could not start (exit %s): %s" % (failed["name"], failed["exit_code"],
                                                                 " | ".join(failed["log"])), flush=True)
    print("fabtrain pod: %s of job %s started: %s" % (job["node"], job["job_id"], ", ".join(
        "%s (pid %d)" % (s["name"], s["pid"]) for s in reply["started"])), flush=True)
    stopped, follower = False, LogFollower(job, ws)
    while True:
        reap()
        follower.poll()
        if stop and not stopped:
            stopped = True
            ops.op_kill({"workspace": ws, "grace": watchdog.get("grace", STOP_GRACE), "node": job["node"]})
        if not ops.live_job_processes(jd):
            break
        time.sleep(POLL)
    reap()
    follower.poll(final=True)
    return 128 + signal.SIGTERM if stopped else outcome(jd, job, ws)


def main(argv):
    if len(argv) != 4 or argv[2] != "--index-env":
        usage()
    sys.exit(run(argv[0], argv[1], argv[3], os.getcwd()))


if __name__ == "__main__":
    main(sys.argv[1:])
