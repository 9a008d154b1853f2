"""A Kubernetes pod's entrypoint (`fab export --k8s`): the pod is a node of the job.

    python3 -m fabtrain.node.pod /etc/fabtrain ROLE --index-env JOB_COMPLETION_INDEX

The pod adapter (`Pod`) of THE hosted supervisor (node/hosted.py): it reads
the pod's part of the plan, <dir>/<ROLE>-<index>.json (its job.json, from the
Secret the export wrote; the index from the named variable), and the
supervisor starts it with node ops' start, as `fab start-*` does over SSH (the
same launcher, agent and coordinator), stays while any of it runs, and exits
with the agents' verdict: 0 when the job finished (a pserver the agents stop at
the end included: the pod Succeeded), 1 when it failed, 143 when it was stopped
first. A SIGTERM is Kubernetes' unless fabtrain's own stop marked the job
first (`sigterm_cause`): an evicted, preempted or drained pod reads "evicted
by Kubernetes" and is a lost node (restarted under on_failure: restart, left
behind under min_nodes), never "stopped by fab kill-all". The container's
working directory is the job's code; the image's own fabtrain is the agent's
runtime. As PID 1 it also reaps whatever is re-parented to it, and copies
every process's log to its stdout, each line prefixed [<pod's node>
<process>], for `kubectl logs`.
"""
import os
import sys

from fabtrain.contract import podpart
from fabtrain.node import hosted
from fabtrain.node.spawn import expand
from fabtrain.contract.jobfolder import JobFolder, job_folder
from fabtrain.contract.states import LOST, read_killer

EVICTED = "evicted by Kubernetes"
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fabtrain package in the image


def usage():
    sys.exit("usage: python3 -m fabtrain.node.pod JOB_FILES_DIR ROLE --index-env VARIABLE")


def read_part(files, role, index_env):
    index = os.environ.get(index_env, "")
    if not index.isdigit():
        sys.exit("fabtrain pod: %s is %r, not a pod index" % (index_env, index))
    try:
        return podpart.read(files, role, int(index))
    except OSError as e:
        sys.exit("fabtrain pod: cannot read the job spec in %s: %s" % (files, e.strerror or e))
    except (ValueError, KeyError, TypeError) as e:
        sys.exit("fabtrain pod: the job spec in %s gives no part to %s pod %s: %s" % (files, role, index, e))


def link(target, path):
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.symlink(target, path)


def prepare(job, code_dir):
    """The job's code is the image's (no snapshot to make); the agent runs from the image's fabtrain."""
    ws = os.path.abspath(os.path.expanduser(job["workspace"]))
    os.makedirs(ws, mode=0o700, exist_ok=True)
    jd = job_folder(ws, job["job_id"]).path
    link(code_dir, JobFolder(jd).code)
    if job.get("agent"):
        link(PACKAGE, os.path.join(expand(job["agent"]["cwd"], ws), "fabtrain"))
    return ws, jd


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


def sigterm_cause(jd):
    """What a SIGTERM to the pod means. Kubernetes says a disruption in the pod's `DisruptionTarget`
    condition, which the container cannot read without API access; fabtrain's own stop can be told
    apart instead: it writes the job's `killed` marker (node ops' kill) before any signal. So a SIGTERM
    without it is Kubernetes' (an eviction, a preemption, a drain, a deletion): the node is lost, never
    the user's stop (the `disrupted` marker, LOST)."""
    who = read_killer(JobFolder(jd).killed)
    if who:
        return hosted.Stop(who, by=who)
    return hosted.Stop(EVICTED, disruption=LOST)


class Pod(hosted.Host):
    """The pod's container, PID 1: what Kubernetes gives the node's part."""
    NAME = "pod"

    def __init__(self, files, role, index_env, code_dir):
        self.files, self.role, self.index_env, self.code_dir = files, role, index_env, code_dir
        self.follower = None

    def part(self):
        job = read_part(self.files, self.role, self.index_env)
        ws, _ = prepare(job, self.code_dir)
        self.follower = LogFollower(job, ws)
        agent = job["agent"] if job.get("watchdog", {}).get("enabled", True) else None
        return dict(job, workspace=ws), agent, sorted({p["role"] for p in job["processes"]})

    def said(self, reply, job):
        for failed in reply["failed"]:
            print("fabtrain pod: %s could not start (exit %s): %s" % (failed["name"], failed["exit_code"],
                                                                     " | ".join(failed["log"])), flush=True)
        print("fabtrain pod: %s of job %s started: %s" % (job["node"], job["job_id"], ", ".join(
            "%s (pid %d)" % (s["name"], s["pid"]) for s in reply["started"])), flush=True)

    def sigterm(self, jd):
        return sigterm_cause(jd)

    def tick(self, final=False):
        reap()
        if self.follower:
            self.follower.poll(final=final)


def main(argv):
    if len(argv) != 4 or argv[2] != "--index-env":
        usage()
    sys.exit(hosted.run(Pod(argv[0], argv[1], argv[3], os.getcwd())))


if __name__ == "__main__":
    main(sys.argv[1:])
