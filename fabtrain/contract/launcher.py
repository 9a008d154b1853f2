"""The launcher's command line: what job.json's `launch` holds, and how a process list recognises one.

The plan builds it on the controller; node ops, the agent and a rank's start read it on the node;
fabtrain/node/launch.py is the program it runs (written into the job folder, run with -I -S, so it
imports nothing of fabtrain and this form lives here).
"""

SCRIPT = "launch.py"  # the launcher's name in the job folder


def launch_command(python, job_dir, exit_path, argv, subreaper=True):
    """The launch argv of one process:

        python -I -S <job_dir>/launch.py --exit <exit_path> [--no-subreaper] -- ARGV...
    """
    flags = ["--exit", exit_path] + ([] if subreaper else ["--no-subreaper"])
    return [python, "-I", "-S", job_dir + "/" + SCRIPT] + flags + ["--"] + list(argv)


def is_launcher(argv):
    """A command line that is the launcher's."""
    return "--exit" in argv[:8] and any(a.endswith("/" + SCRIPT) for a in argv[:4])
