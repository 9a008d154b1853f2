"""What a Slurm job's folder says between its attempts and to the controller: the lines Slurm writes into
the job's output when it ends a job early, and the file that names the attempt running.

The node side (fabtrain/node/attempts.py) reads the output to say why a requeued job's next attempt
began; the controller (fabtrain/slurm/jobs.py) reads it to name a lost node next to Slurm's state.
"""
import re

from fabtrain.contract.jobfolder import ATTEMPT, DRAWN_PORTS

# slurmstepd's line when Slurm ends a job early: "*** JOB 7 ON n1 CANCELLED AT <time> DUE TO PREEMPTION ***"
# (NODE FAILURE adds ", SEE SLURMCTLD LOG FOR DETAILS").
DUE_RE = re.compile(r"\*\*\* JOB \d+ ON (\S+) CANCELLED AT \S+ DUE TO ([A-Z ]+?)(?:, [^*]*)? \*\*\*")
NODE_FAILURE = "srun: error: Node failure on "  # srun's word on which node it lost
NODE_FAILURE_RE = re.compile(re.escape(NODE_FAILURE) + r"(\S+)")
ATTEMPT_FILE = ATTEMPT  # in the job folder (contract/jobfolder.py SlurmFolder): the attempt running
DRAWN_PORTS_FILE = DRAWN_PORTS  # in the job folder: {"ports": {setting: port}}, the `auto` ports drawn there


def lost_node(text):
    """The Slurm node srun said it lost (its last such line in a job's output), or None."""
    found = NODE_FAILURE_RE.findall(text)
    return found[-1] if found else None
