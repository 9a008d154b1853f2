"""fabtrain's tasks. Each parses what was typed and calls the library (fabtrain/).

    fab check deploy start-pserver start-trainers     # start a job
    fab status | fab logs --follow | fab kill-all     # watch it, stop it

The cluster file is ./cluster.yaml, or $FABTRAIN_CLUSTER.
"""
import functools
import sys

from invoke import Exit, task

from fabtrain.contract.states import STOP_GRACE
from fabtrain.controller import lifecycle, preflight, report, state
from fabtrain import taskargs
from fabtrain.errors import UserError, reader_gone
from fabtrain.plan.plan import make_plan, new_job_id
from fabtrain.remote.session import get_session
from fabtrain.slurm import jobs as slurm_jobs, tasks as slurm_tasks
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


def session(c):
    return get_session(config=c.config)


def fail_if(failed, message, code=1):
    if failed:
        raise Exit(message, code=code)


def replies_text(replies, ok_text):
    lines = [f"{r.node}: {ok_text(r.value)}" if r.ok else report.failed_line(r) for r in replies]
    return "\n".join(lines), any(not r.ok for r in replies)


@fabtask(help={"offline": "ask no node: interfaces shown as <iface of ADDR>, auto ports picked without asking"})
def plan(c, offline=False):
    """Print the exact commands each node would run (a dry run); asks the nodes their interfaces and free ports unless --offline."""
    s = session(c)
    if s.cluster.scheduler:  # the batch script, as submitted
        return slurm_tasks.plan(s)
    if offline:  # no node asked: auto ports picked blind, interfaces shown as what start will find
        network, notes = preflight.choose_ports(s.cluster, {}), ["--offline: interfaces and auto ports are found at start"]
    else:
        network, notes = preflight.plan_network(s)
    print(report.plan_text(make_plan(s.cluster, new_job_id(), network=network), notes, asked=not offline))


@fabtask(help={"venv": "build <workspace>/venv on every node and install the requirements into it",
               "wheelhouse": "a directory of wheels on this machine: copied to every node and installed from with --no-index",
               "requirements": "a requirements file on this machine (default: requirements-node.txt)"})
def provision(c, venv=False, wheelhouse=None, requirements=None):
    """Make the workspace on every node; --venv builds a venv (--requirements FILE), --wheelhouse=DIR installs offline."""
    reqs = lifecycle.read_requirements(requirements) if requirements else None
    replies = lifecycle.provision(session(c), venv=venv, wheelhouse=wheelhouse, requirements=reqs)
    text, failed = replies_text(replies, lambda v: f"workspace {v['workspace']}" + (f", venv {v['venv']}" if v["venv"] else ""))
    print(text)
    fail_if(failed, "provision failed on some nodes")


@fabtask(help={"bandwidth": "also run a short all-reduce across the nodes and report the bus bandwidth"})
def check(c, bandwidth=False):
    """Check every node can run the job: python, torch/CUDA, paddle, tools, disk, clock, ports, reachability; --bandwidth adds an all-reduce."""
    s = session(c)
    checks = lifecycle.check(s)
    print(report.check_text(checks) + "\n")
    if s.cluster.scheduler:  # the nodes are not known before the allocation: Slurm's side instead of the network
        fail_if(not (slurm_tasks.check(s) and all(ch.ok for ch in checks)), "check: the job cannot run on this Slurm cluster")
        return
    network = preflight.network_check(s)
    print(report.network_text(network, s.cluster))
    bus_ok = True
    if bandwidth:
        measured = preflight.bandwidth(s, network, {ch.node: ch.probe for ch in checks})
        print(("\n".join(measured.problems)) if measured.problems else report.bandwidth_text(measured))
        bus_ok = not measured.problems
    fail_if(not (all(ch.ok for ch in checks) and network.ok and bus_ok), "check: some nodes cannot run the job")


@fabtask
def deploy(c):
    """Ship this project's code (job.code) and fabtrain's node runtime to every node (rsync)."""
    replies = lifecycle.deploy(session(c))
    text, failed = replies_text(replies, lambda v: f"code {report.code_text(v['code'])} synced ({v.get('files', 0)} files sent)")
    print(text)
    fail_if(failed, "deploy failed on some nodes")


@fabtask(help={"input": "what to split instead of job.data.input: a file, a directory, a URL of a tarball, or sample",
               "force": "split again even when the shards of this input are already there"})
def split_data(c, input=None, force=False):
    """Split job.data.input into one shard per trainer under job.data.dir (prepare.py)."""
    from fabtrain.controller import datacopy
    print(datacopy.split_data(session(c).cluster, input=input, force=force).summary())


@fabtask(help={"bwlimit": "rsync's bandwidth limit per node, in KB/s"}, bwlimit=Number(whole=True, lo=1, hi=10**9, unit="KB/s"))
def copy_data(c, bwlimit=None):
    """Copy each trainer's shards to its node (rsync), verify sha256, skip what matches; --bwlimit=KBPS."""
    from fabtrain.controller import datacopy
    replies = datacopy.copy_data(session(c), progress=lambda line: print(line, flush=True),
                                 bwlimit=bwlimit)
    text, failed = replies_text(replies, lambda v: (
        "shared data verified" if v.shared else
        f"{v.files} files verified, {len(v.sent)} sent ({v.bytes_sent} bytes, {v.wire_bytes} over the wire)" if v.sent else
        f"{v.files} files already in place and verified, nothing sent"))
    print(text)
    fail_if(failed, "copy-data failed on some nodes")


def _start(c, roles, force, resume_from=None, no_wait=False):
    if session(c).cluster.scheduler:
        return slurm_tasks.start(session(c), roles, no_wait=no_wait, resume_from=resume_from, force=force)
    result = lifecycle.start(session(c), roles, force=force, resume_from=resume_from)
    if force:
        print(report.force_text(result.stopped))
    refusal = report.running_refusal(result)
    if refusal:
        for r in result.replies:
            if not r.ok and not report.running_here(r):
                print(report.failed_line(r))
        raise Exit(refusal, code=1)
    print(report.start_text(result, roles))
    failed = any(not r.ok or r.value["failed"] for r in result.replies)
    undone = "; what had started was stopped (all or nothing)" if result.undone is not None else ""
    fail_if(failed, f"job {result.job_id}: could not start everything{undone}; see `fab status` and `fab logs`")


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
    s = session(c)
    replies = lifecycle.status(s, job_id=job, health=True)
    if s.cluster.scheduler and not any(r.ok and r.value.get("job_id") for r in replies):
        queued = slurm_tasks.status_line(s, replies, job)  # submitted, and no node has it yet
        if queued:
            print(queued)
            return
    lifecycle.require_job(replies, job)
    text, failed = report.status_text(replies)
    print(text)
    shown = {r.value["job_id"] for r in replies if r.ok and r.value["job_id"]}
    ports = state.recorded_ports(s.cluster.name, shown.pop()) if len(shown) == 1 else None
    if ports:
        print(report.ports_text({k: v for k, v in ports.items() if k != "auto"}, ports["auto"]))
    if s.cluster.scheduler:
        print(slurm_tasks.status_line(s, replies, job) or "slurm: no job submitted from here")
    fail_if(failed, "status: the job has failed processes or unreachable nodes")


@fabtask(help={"interval": "seconds between reads of the nodes",
               "timeout": "give up after this many seconds, with exit code 124", "job": "a job id (20261124-045501-5d89); default: the job the nodes started last"},
         interval=Number(whole=False, lo=0.1, hi=3600, unit="seconds"),
         timeout=Number(whole=False, lo=0.1, hi=10**7, unit="seconds"))
def watch(c, interval=1.0, timeout=None, job=None):
    """Follow the job until it ends: node health, trainer progress, watchdog events; exit 0 finished, 1 failed, 3 killed, 124 --timeout."""
    from fabtrain.controller.watch import watch as follow
    s = session(c)
    if s.cluster.scheduler and not job:  # the job submitted last, though it may still be queued
        job = slurm_jobs.submitted_job(s)
    code = follow(s, interval=interval, timeout=timeout, job_id=job,
                  scheduler_line=slurm_jobs.ShownLine(s) if s.cluster.scheduler else None)
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
    replies = lifecycle.logs(session(c), lines=lines, follow=follow, job_id=job, stacks=stacks)
    lifecycle.require_job(replies, job)
    for r in replies:
        if not r.ok:
            print(report.failed_line(r), file=sys.stderr)
    fail_if(any(not r.ok for r in replies), "logs: some nodes could not be read")


@fabtask(help={"grace": "seconds between SIGTERM and SIGKILL"}, grace=Number(whole=False, lo=0, hi=3600, unit="seconds"))
def kill_all(c, grace=STOP_GRACE):
    """Stop every fabtrain process on every node: SIGTERM, --grace seconds, SIGKILL, sweep."""
    if session(c).cluster.scheduler:  # scancel, pending jobs too; each node stops its own processes
        return slurm_tasks.kill_all(session(c), grace=grace)
    text, clean = report.kill_text(lifecycle.kill_all(session(c), grace=grace))
    print(text)
    fail_if(not clean, "kill-all: some processes may still be alive (see above)")


@fabtask(help={"port": "the port to serve on", "host": "the address to serve on (keep 127.0.0.1; use an SSH tunnel)",
               "interval": "seconds between reads of the nodes", "job": "a job id (20261124-045501-5d89); default: the job the nodes started last"},
         port=Number(whole=True, lo=1, hi=65535), interval=Number(whole=False, lo=0.1, hi=3600, unit="seconds"))
def dashboard(c, port=8265, host="127.0.0.1", interval=1.0, job=None):
    """Serve the web dashboard on --host (127.0.0.1) --port (8265); prints its URL with the token."""
    from fabtrain.dashboard.serve import serve
    s = session(c)
    if job:  # a job no node has would be an empty page, served until interrupted
        lifecycle.require_job(lifecycle.status(s, job_id=job), job)
    serve(s, host=host, port=port, interval=interval, job_id=job)


@fabtask(help={"tensorboard": "write every trainer's metrics as TensorBoard event files under this directory",
               "job": "with --tensorboard: only this job (default: every job the nodes remember)",
               "k8s": "write the job as Kubernetes manifests into this directory (asks no node)",
               "k8s-kind": "with --k8s: job (an indexed Job and a Service) or pytorchjob (Kubeflow's)",
               "slurm": "write the Slurm batch script to this file (submit it with sbatch FILE)"})
def export(c, tensorboard=None, job=None, k8s=None, k8s_kind="job", slurm=None):
    """Write metrics as TensorBoard files (--tensorboard=DIR, --job ID), or the job as Kubernetes manifests (--k8s=DIR) or a Slurm batch script (--slurm=FILE)."""
    from fabtrain.controller.export import export_tensorboard
    from fabtrain.plan.kubernetes import check_kind
    check_kind(k8s_kind)  # typed wrong is said even without --k8s
    if k8s:  # reads only cluster.yaml: no node is asked
        from fabtrain.config.cluster import load_cluster
        from fabtrain.controller.kubeexport import export_kubernetes
        for path in export_kubernetes(load_cluster(), k8s, kind=k8s_kind):
            print(path)
        return
    if slurm:
        if not session(c).cluster.scheduler:
            raise UserError("--slurm: cluster.yaml has no scheduler section")
        return slurm_tasks.export_script(session(c), slurm)
    if not tensorboard:
        raise UserError("say where: --tensorboard=DIR, --k8s=DIR or --slurm=FILE")
    result = export_tensorboard(session(c), tensorboard, job_id=job)
    for line in result.runs:
        print(f"{tensorboard}/{line}")
    for line in result.unreachable:
        print(f"unreachable (its part is missing): {line}", file=sys.stderr)
    fail_if(not result.runs, "export: no trainer metrics found" + (f" for job {job}" if job else ""))
