"""fabtrain's tasks. Each parses what was typed and calls the library (fabtrain/).

    fab check deploy start-pserver start-trainers     # start a job
    fab status | fab logs --follow | fab kill-all     # watch it, stop it

The cluster file is ./cluster.yaml, or $FABTRAIN_CLUSTER.
"""
import functools
import sys

from invoke import Exit, task

from fabtrain import backends, taskargs
from fabtrain.contract.states import STOP_GRACE
from fabtrain.controller import lifecycle, report
from fabtrain.errors import UserError, reader_gone
from fabtrain.remote.session import get_session
from fabtrain.taskargs import Number

taskargs.install()


# What a project's `from fabtrain.tasks import *` brings into its fabfile: the tasks only.
__all__ = ["plan", "provision", "check", "deploy", "split_data", "copy_data", "start_pserver",
           "start_trainers", "status", "watch", "logs", "kill_all", "dashboard", "export"]


def fabtask(fn=None, help: dict[str, str] | None = None, **numbers: Number):
    """A task whose user errors end in one line and exit code 2, never a traceback; piped into a reader
    that stops early (`| head`), it stops quietly (exit 141, as SIGPIPE ends other tools);
    `help` is one line for each option (`fab --help TASK`); `numbers` are its numeric options, checked
    when the command line is parsed."""
    if fn is None:
        return lambda body: fabtask(body, help=help, **numbers)

    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        try:
            try:
                return fn(c, *args, **kwargs)
            finally:
                sys.stdout.flush()  # a reader gone is found here, not in Python's flush at exit
        except UserError as e:
            name = fn.__name__.replace("_", "-")
            raise Exit("\n".join(f"fab {name}: {line}" for line in str(e).splitlines()), code=2) from None
        except KeyboardInterrupt:
            raise Exit("interrupted", code=130) from None
        except BrokenPipeError:
            raise Exit(code=reader_gone()) from None
    return task(wrapper, klass=taskargs.CheckedTask, numbers=numbers, help=help or {})


def fail_if(failed, message, code=1):
    if failed:
        raise Exit(message, code=code)


def say_replies(result, ok_text) -> None:
    """A line a node (report.replies_text), then the result's problem when a node failed."""
    text, failed = report.replies_text(result.replies, ok_text)
    print(text)
    fail_if(failed, result.problem)


def session(c):
    return get_session(config=c.config)


def backend(c):
    """The place this cluster file's job runs (fabtrain/backends/), with the session fab holds for it."""
    s = session(c)
    return backends.backend_for(s.cluster), s


@fabtask(help={"offline": "ask no node: interfaces shown as <iface of ADDR>, auto ports picked without asking"})
def plan(c, offline=False):
    """Print the exact commands each node would run (a dry run); asks the nodes their interfaces and free ports unless --offline."""
    place, s = backend(c)
    print(report.planned_text(place.plan(s, offline=offline)), end="")


@fabtask(help={"venv": "build <workspace>/venv on every node and install the requirements into it",
               "wheelhouse": "a directory of wheels on this machine: copied to every node and installed from with --no-index",
               "requirements": "a requirements file on this machine (default: requirements-node.txt)"})
def provision(c, venv=False, wheelhouse=None, requirements=None):
    """Make the workspace on every node; --venv builds a venv (--requirements FILE), --wheelhouse=DIR installs offline."""
    reqs = lifecycle.read_requirements(requirements) if requirements else None
    place, s = backend(c)
    say_replies(place.provision(s, venv=venv, wheelhouse=wheelhouse, requirements=reqs),
                lambda v: f"workspace {v.workspace}" + (f", venv {v.venv}" if v.venv else ""))


@fabtask(help={"bandwidth": "also run a short all-reduce across the nodes and report the bus bandwidth"})
def check(c, bandwidth=False):
    """Check every node can run the job: python, torch/CUDA, paddle, tools, disk, clock, ports, reachability; --bandwidth adds an all-reduce."""
    place, s = backend(c)
    checked = place.check(s, bandwidth=bandwidth)
    print(report.checked_text(checked, s.cluster))
    fail_if(not checked.ok, checked.problem)


@fabtask
def deploy(c):
    """Ship this project's code (job.code) and fabtrain's node runtime to every node (rsync)."""
    place, s = backend(c)
    say_replies(place.deploy(s), lambda v: f"code {report.code_text(v['code'])} synced ({v.get('files', 0)} files sent)")


@fabtask(help={"input": "what to split instead of job.data.input: a file, a directory, a URL of a tarball, or sample",
               "force": "split again even when the shards of this input are already there"})
def split_data(c, input=None, force=False):
    """Split job.data.input into one shard per trainer under job.data.dir (prepare.py)."""
    place, s = backend(c)
    print(place.split_data(s, input=input, force=force).summary())


@fabtask(help={"bwlimit": "rsync's bandwidth limit per node, in KB/s"}, bwlimit=Number(whole=True, lo=1, hi=10**9, unit="KB/s"))
def copy_data(c, bwlimit=None):
    """Copy each trainer's shards to its node (rsync), verify sha256, skip what matches; --bwlimit=KBPS."""
    place, s = backend(c)
    copied = place.copy_data(s, progress=lambda line: print(line, flush=True), bwlimit=bwlimit)
    say_replies(copied, lambda v: (
        "shared data verified" if v.shared else
        f"{v.files} files verified, {len(v.sent)} sent ({v.bytes_sent} bytes, {v.wire_bytes} over the wire)" if v.sent else
        f"{v.files} files already in place and verified, nothing sent"))


def _start(c, roles, force, resume_from=None, no_wait=False):
    place, s = backend(c)
    live = sys.stdout.isatty()

    def show(line: str, final: bool) -> None:  # a queued job's line redrawn in place on a terminal
        if live:
            print(f"\r\033[K{line}", end="\n" if final else "", flush=True)
        else:
            print(line, flush=True)

    started = place.start(s, roles, force=force, resume_from=resume_from, no_wait=no_wait, progress=show)
    for line in report.started_lines(started):
        print(line)
    fail_if(started.problem, started.problem)


@fabtask(help={"force": "if a job is running, stop it first (kill-all) and say which",
               "resume-from": "an earlier job's id: the new job starts from its checkpoints",
               "no-wait": "on Slurm: return once the job is submitted instead of waiting for it to run"})
def start_pserver(c, force=False, resume_from=None, no_wait=False):
    """Start the pservers of a new job (--force kills a running job; --resume-from=JOB resumes its checkpoints)."""
    _start(c, ("pserver",), force, resume_from, no_wait)


@fabtask(help={"force": "if a job is running, stop it first (kill-all) and say which",
               "no-wait": "on Slurm: return once the job is submitted instead of waiting for it to run"})
def start_trainers(c, force=False, no_wait=False):
    """Start the trainers (of the job whose pservers are up, or a new collective job); --force stops a running job first."""
    _start(c, ("trainer",), force, no_wait=no_wait)


@fabtask(help={"job": "a job id (20261124-045501-5d89); default: the job the nodes started last"})
def status(c, job=None):
    """Show every process of the job on every node; exit 1 if one failed."""
    place, s = backend(c)
    shown = place.status(s, job=job)
    text, failed = report.job_status_text(shown)
    print(text)
    fail_if(failed, shown.problem)


@fabtask(help={"interval": "seconds between reads of the nodes",
               "timeout": "give up after this many seconds, with exit code 124", "job": "a job id (20261124-045501-5d89); default: the job the nodes started last"},
         interval=Number(whole=False, lo=0.1, hi=3600, unit="seconds"),
         timeout=Number(whole=False, lo=0.1, hi=10**7, unit="seconds"))
def watch(c, interval=1.0, timeout=None, job=None):
    """Follow the job until it ends: node health, trainer progress, watchdog events; exit 0 finished, 1 failed, 3 killed, 124 --timeout."""
    from fabtrain.controller.watch import watch as follow
    place, s = backend(c)
    followed = place.watch(s, job=job)
    code = follow(s, interval=interval, timeout=timeout, job_id=followed.job_id, scheduler_line=followed.place_line)
    if code:
        raise Exit(code=code)


@fabtask(help={"lines": "how many of each log's last lines to print (with --follow, 0: only new ones)",
               "follow": "keep printing new lines until the job ends",
               "stacks": "print instead every thread's Python stack each process had when a hang stopped the job",
               "job": "a job id (20261124-045501-5d89); default: the job the nodes started last"},
         lines=Number(whole=True, lo=0, hi=10**7))
def logs(c, lines=20, follow=False, job=None, stacks=False):
    """Print the last lines of every process's log, prefixed [node role-rank], or follow them, or the stacks of a hang.

    --lines N of each log (default 20); --follow streams until the job ends; --stacks prints instead
    every thread's stack each process had when a hang stopped the job."""
    if stacks and follow:
        raise UserError("--stacks and --follow do not go together: stacks are saved once, before a hang's teardown")
    if lines == 0 and not follow and not stacks:
        raise UserError("--lines 0 shows nothing: give 1 or more (with --follow, 0 shows only new lines)")
    place, s = backend(c)
    read = place.logs(s, lines=lines, follow=follow, job=job, stacks=stacks, out=sys.stdout)
    for r in read.failed:
        print(report.failed_line(r), file=sys.stderr)
    fail_if(not read.ok, read.problem)


@fabtask(help={"grace": "seconds between SIGTERM and SIGKILL"}, grace=Number(whole=False, lo=0, hi=3600, unit="seconds"))
def kill_all(c, grace=STOP_GRACE):
    """Stop every fabtrain process on every node: SIGTERM, --grace seconds, SIGKILL, sweep."""
    place, s = backend(c)
    stopped = place.kill_all(s, grace=grace)
    print(report.stopped_text(stopped))
    fail_if(not stopped.clean, stopped.problem)


@fabtask(help={"port": "the port to serve on", "host": "the address to serve on (keep 127.0.0.1; use an SSH tunnel)",
               "interval": "seconds between reads of the nodes", "job": "a job id (20261124-045501-5d89); default: the job the nodes started last"},
         port=Number(whole=True, lo=1, hi=65535), interval=Number(whole=False, lo=0.1, hi=3600, unit="seconds"))
def dashboard(c, port=8265, host="127.0.0.1", interval=1.0, job=None):
    """Serve the web dashboard on --host (127.0.0.1) --port (8265); prints its URL with the token."""
    from fabtrain.dashboard.serve import serve
    place, s = backend(c)
    if job:  # a job no node has would be an empty page, served until interrupted
        place.status(s, job=job)
    serve(s, host=host, port=port, interval=interval, job_id=job)


@fabtask(help={"tensorboard": "write every trainer's metrics as TensorBoard event files under this directory",
               "job": "with --tensorboard: only this job (default: every job the nodes remember)",
               "k8s": "write the job as Kubernetes manifests into this directory (asks no node)",
               "k8s-kind": "with --k8s: job (an indexed Job a role and a Service), jobset or pytorchjob (Kubeflow's)",
               "jobset": "with --k8s: one JobSet (gang admission with Kueue), as --k8s-kind jobset",
               "slurm": "write the Slurm batch script to this file (submit it with sbatch FILE)"})
def export(c, tensorboard=None, job=None, k8s=None, k8s_kind="job", jobset=False, slurm=None):
    """Write metrics as TensorBoard files (--tensorboard=DIR, --job ID), or the job as Kubernetes manifests (--k8s=DIR; --jobset: one JobSet) or a Slurm batch script (--slurm=FILE)."""
    from fabtrain.plan.kubernetes import check_kind
    check_kind(k8s_kind)  # typed wrong is said even without --k8s
    if jobset:
        if k8s_kind not in ("job", "jobset"):
            raise UserError(f"--jobset and --k8s-kind {k8s_kind} do not go together: give one of them")
        k8s_kind = "jobset"
    # The flag names the place whose files are written, whatever place the cluster file describes.
    if k8s or slurm:  # k8s reads only cluster.yaml: no node is asked
        exported = (backends.KUBERNETES.export(session(c), k8s, kind=k8s_kind) if k8s else
                    backends.SLURM.export(session(c), slurm))
        for line in exported.lines:
            print(line)
        return
    if not tensorboard:
        raise UserError("say where: --tensorboard=DIR, --k8s=DIR or --slurm=FILE")
    place, s = backend(c)
    result = place.tensorboard(s, tensorboard, job=job)
    for line in result.runs + result.checkpoints:
        print(f"{tensorboard}/{line}")
    for line in result.unreachable:
        print(f"unreachable (its part is missing): {line}", file=sys.stderr)
    fail_if(not result.runs, "export: no trainer metrics found" + (f" for job {job}" if job else ""))
