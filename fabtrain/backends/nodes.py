"""SSH and local nodes (the cluster file's `nodes:` or `dist_ips:`): fab reaches every node itself.

fab starts each node's part through node ops over the node's connector, and
stops it the same way; the nodes and their addresses are known before the
start, so `fab plan` and `fab check` ask them.
"""
from __future__ import annotations

from typing import Callable

from fabtrain.backends.backend import Backend
from fabtrain.backends.results import Checked, Planned, Started, Stopped
from fabtrain.contract.states import KILLERS
from fabtrain.controller import lifecycle, preflight, report
from fabtrain.plan.plan import make_plan, new_job_id
from fabtrain.remote.session import Session


class NodesBackend(Backend):
    NAME = "nodes"

    def plan(self, session: Session, offline: bool = False) -> Planned:
        if offline:  # no node asked: auto ports picked blind, interfaces shown as what start will find
            network, notes = preflight.choose_ports(session.cluster, {}), ["--offline: interfaces and auto ports are found at start"]
        else:
            network, notes = preflight.plan_network(session)
        return Planned(make_plan(session.cluster, new_job_id(), network=network), notes, asked=not offline)

    def check(self, session: Session, bandwidth: bool = False) -> Checked:
        checks = lifecycle.check(session)
        network = preflight.network_check(session)
        measured = None
        if bandwidth:
            measured = preflight.bandwidth(session, network, {ch.node: ch.probe for ch in checks if ch.probe})
        return Checked(checks, network=network, bandwidth=measured)

    def start(self, session: Session, roles: tuple[str, ...], force: bool = False, resume_from: str | None = None,
              no_wait: bool = False, progress: Callable[[str, bool], None] | None = None) -> Started:
        result = lifecycle.start(session, roles, force=force, resume_from=resume_from)
        refusal = report.running_refusal(result)
        if refusal:
            return Started(result.job_id, roles, result, forced=force, refused=True, problem=refusal)
        failed = any(not r.ok or r.value.failed for r in result.replies)
        undone = "; what had started was stopped (all or nothing)" if result.undone is not None else ""
        problem = f"job {result.job_id}: could not start everything{undone}; see `fab status` and `fab logs`"
        return Started(result.job_id, roles, result, forced=force, problem=problem if failed else None)

    def kill_all(self, session: Session, grace: float, by: str = KILLERS[0]) -> Stopped:
        return Stopped.of_nodes(lifecycle.kill_all(session, grace=grace, by=by), by)
