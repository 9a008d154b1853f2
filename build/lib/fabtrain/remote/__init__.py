"""Carrying work to the nodes: connectors (local, SSH), host keys, the node-ops call protocol, rsync.

Runs on the controller. It never decides *what* to run: the plan and the
controller do.
"""
