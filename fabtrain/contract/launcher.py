"""The launcher's command line: what job.json's `launch` holds, and how a process list recognises one.

The plan builds it on the controller; node ops, the agent and a rank's start read it on the node;
fabtrain/node/launch.py is the program it runs (written into the job folder, run with -I -S, so it
imports nothing of fabtrain and this form lives here).

The dead-man (docs/partitions.md, "The bound, and why it holds"): in a job whose agents fence
(min_nodes), each job process's launcher is given ``--deadline <job_dir>/run/deadline``, the file in
which the node's agent publishes the moment (CLOCK_MONOTONIC) by which it would have begun its fence
had nothing more come (node/deadman.py). Once that moment passes unrenewed (the agent stopped or
frozen), the launcher ends its program as a fence does and records so in the exit record: the code,
then FENCED. The texts of both files are defined here; launch.py reads them with copies of
`read_deadline` and of the exit record's words (tests/unit/test_deadman.py holds them equal).
"""

SCRIPT = "launch.py"  # the launcher's name in the job folder
DEADLINE_FLAG = "--deadline"
FENCED = "fenced"  # the exit record's second word: the launcher's dead-man ended the program
# The fence's own words (agent/policy.py's `peer_lost` and failure reasons say them)
FENCES_ITSELF = "this node fences itself: it stops its part of the job"
# Why a process its launcher's dead-man ended ended (its `killed` event, the fence's reason)
DEADMAN = ("its launcher ended it: the agent on this node let its fence deadline pass without renewing it "
           "(stopped or frozen)")


def launch_command(python, job_dir, exit_path, argv, subreaper=True, deadline=None):
    """The launch argv of one process:

        python -I -S <job_dir>/launch.py --exit <exit_path> [--no-subreaper] [--deadline FILE] -- ARGV...
    """
    flags = ["--exit", exit_path] + ([] if subreaper else ["--no-subreaper"]) + (
        [DEADLINE_FLAG, deadline] if deadline else [])
    return [python, "-I", "-S", job_dir + "/" + SCRIPT] + flags + ["--"] + list(argv)


def is_launcher(argv):
    """A command line that is the launcher's."""
    return "--exit" in argv[:8] and any(a.endswith("/" + SCRIPT) for a in argv[:4])


def deadline_text(at, grace):
    """run/deadline's text: the moment (CLOCK_MONOTONIC seconds) after which the launchers end their programs,
    and the grace between their SIGTERM and SIGKILL."""
    return "%.3f %g\n" % (at, grace)


def read_deadline(text):
    """(deadline, grace) from run/deadline's text, or None for anything else (no dead-man on a file it cannot
    read). launch.py has a copy of this (it imports nothing of fabtrain)."""
    try:
        at, grace = (float(x) for x in text.split())
    except ValueError:
        return None
    if not (at == at and abs(at) != float("inf") and 0 <= grace < 3600):  # NaN, inf: no deadline
        return None
    return at, grace


def exit_text(code, fenced=False):
    """An exit record's text: the code (the shell's way), then FENCED where the dead-man ended the program."""
    return "%d%s\n" % (code, " " + FENCED if fenced else "")
