"""ON THE CONTROLLER: Slurm as another place to run a job's Plan.

script.py renders the Plan into one batch script (pure); commands.py runs
sbatch, squeue, scontrol and scancel on the login node (here, or over SSH);
jobs.py submits, waits, reads Slurm's state back and cancels. Inside the
allocation, fabtrain/node/allocation.py starts each node's part through the
same node ops, launcher and agent as on SSH nodes.
"""
