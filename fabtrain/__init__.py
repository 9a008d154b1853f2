"""fabtrain: launch, watch and stop distributed training on a few Linux servers over SSH.

Where each part runs says where it lives:

    config/      cluster.yaml -> Cluster                        (controller)
    plan/        Cluster -> Plan, pure data                     (controller)
    remote/      connectors, node-ops protocol, rsync            (controller)
    controller/  the tasks' library: lifecycle, collector, ...   (controller)
    backends/    the places a job runs: nodes, Slurm, Kubernetes (controller)
    node/        node ops, launcher, agent, coordinator          (each node; stdlib only)
    data/        prepare.py's library: split, manifest           (wherever data is prepared)
    dashboard/   the Flask dashboard                             (controller)
    tasks.py     the Fabric tasks: `from fabtrain.tasks import *` in a project's fabfile.py
"""
