"""ON THE CONTROLLER: the places a job runs, one Backend each (backend.py says the verbs).

    nodes.py       SSH and local nodes (`nodes:` / `dist_ips:`): fab reaches every node itself
    slurm.py       a Slurm allocation (`scheduler:`): one batch script; fabtrain/slurm/ does the work
    kubernetes.py  pods (`fab export --k8s`): manifests a person applies

`backend_for(cluster)` chooses one from the cluster file, once: fab's tasks and
the dashboard call its verbs and never ask which place they have.
"""
from __future__ import annotations

from fabtrain.backends.backend import Backend
from fabtrain.backends.kubernetes import KubernetesBackend
from fabtrain.backends.nodes import NodesBackend
from fabtrain.backends.slurm import SlurmBackend

NODES, SLURM, KUBERNETES = NodesBackend(), SlurmBackend(), KubernetesBackend()


def backend_for(cluster) -> Backend:
    """The place the cluster file describes: `scheduler:` a Slurm allocation, `kubernetes:` pods, else nodes."""
    if cluster.scheduler:
        return SLURM
    if getattr(cluster, "kubernetes", None):  # the cluster file's `kubernetes:` section, where the config has one
        return KUBERNETES
    return NODES
