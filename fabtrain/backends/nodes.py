"""SSH and local nodes (the cluster file's `nodes:` or `dist_ips:`): fab reaches every node itself.

fab starts each node's part through node ops over the node's connector, and
stops it the same way; the nodes and their addresses are known before the
start, so `fab plan` and `fab check` ask them.
"""
from __future__ import annotations

from invoke import Exit

from fabtrain.backends.backend import Backend, fail_if
from fabtrain.controller import lifecycle, preflight, report
from fabtrain.plan.plan import make_plan, new_job_id
from fabtrain.remote.session import Session


class NodesBackend(Backend):
    NAME = "nodes"

    def plan(self, session: Session, offline: bool = False) -> None:
        if offline:  # no node asked: auto ports picked blind, interfaces shown as what start will find
            network, notes = preflight.choose_ports(session.cluster, {}), ["--offline: interfaces and auto ports are found at start"]
        else:
            network, notes = preflight.plan_network(session)
        print(report.plan_text(make_plan(session.cluster, new_job_id(), network=network), notes, asked=not offline))

    def check(self, session: Session, bandwidth: bool = False) -> None:
        checks = lifecycle.check(session)
        print(report.check_text(checks) + "\n")
        network = preflight.network_check(session)
        print(report.network_text(network, session.cluster))
        bus_ok = True
        if bandwidth:
            measured = preflight.bandwidth(session, network, {ch.node: ch.probe for ch in checks if ch.probe})
            print(("\n".join(measured.problems)) if measured.problems else report.bandwidth_text(measured))
            bus_ok = not measured.problems
        fail_if(not (all(ch.ok for ch in checks) and network.ok and bus_ok), "check: some nodes cannot run the job")

    def start(self, session: Session, roles: tuple[str, ...], force: bool = False, resume_from: str | None = None,
              no_wait: bool = False) -> None:
        result = lifecycle.start(session, roles, force=force, resume_from=resume_from)
        if force:
            print(report.force_text(result.stopped))
        refusal = report.running_refusal(result)
        if refusal:
            for r in result.replies:
                if not r.ok and not report.running_here(r):
                    print(report.failed_line(r))
            raise Exit(refusal, code=1)
        print(report.start_text(result, roles))
        failed = any(not r.ok or r.value.failed for r in result.replies)
        undone = "; what had started was stopped (all or nothing)" if result.undone is not None else ""
        fail_if(failed, f"job {result.job_id}: could not start everything{undone}; see `fab status` and `fab logs`")

    def kill_all(self, session: Session, grace: float) -> None:
        text, clean = report.kill_text(lifecycle.kill_all(session, grace=grace))
        print(text)
        fail_if(not clean, "kill-all: some processes may still be alive (see above)")
