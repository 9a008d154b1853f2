"""What a Backend's verbs return: typed records (torch elastic's `RunResult`, Fabric's `GroupResult`).

A Backend never prints and never exits: fab's tasks say these records (controller/report.py words
them), the dashboard serves them as JSON, `fab watch` follows what `Follow` names. Each record says
what happened as data; `problem` is the one line a caller says when it did not all go well.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from fabtrain.contract.states import KILLERS
from fabtrain.remote.transport import Reply


@dataclass
class NodeReplies:
    """One reply a node (Fabric's GroupResult): partial failure is data, not a re-filter."""
    replies: list[Reply]
    problem: str | None = None  # said when some node failed

    @property
    def failed(self) -> list[Reply]:
        return [r for r in self.replies if not r.ok]

    @property
    def succeeded(self) -> list[Reply]:
        return [r for r in self.replies if r.ok]

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class Planned:
    """What a start would run: the plan fab would start on the nodes, or the file the place would be given."""
    plan: Any = None  # fabtrain.plan.plan.Plan, where fab starts the nodes itself
    notes: list[str] = field(default_factory=list)
    asked: bool = True  # the nodes were asked (interfaces, free ports)
    script: str | None = None  # the place's own file (Slurm's batch script), shown as is


@dataclass
class Checked:
    """Can the job run there: each node's check, the network's, the bus's, and the place's own word."""
    nodes: list  # controller.lifecycle.NodeCheck, one a node
    network: Any = None  # controller.preflight's NetworkCheck, where fab reaches the nodes
    bandwidth: Any = None  # the all-reduce's measure (fab check --bandwidth)
    place: list[str] = field(default_factory=list)  # the place's own check, a line each (Slurm's partition)
    place_ok: bool = True
    problem: str = "check: some nodes cannot run the job"

    @property
    def ok(self) -> bool:
        return (all(ch.ok for ch in self.nodes) and (self.network is None or self.network.ok)
                and not (self.bandwidth is not None and self.bandwidth.problems) and self.place_ok)


@dataclass
class Started:
    """A start: the job, each node's reply where fab started them (controller.lifecycle.StartResult), and
    why it failed. A place that is given the job (Slurm) says how far it got through `progress` instead."""
    job_id: str | None
    roles: tuple[str, ...]
    result: Any = None  # controller.lifecycle.StartResult, where fab started the nodes itself
    forced: bool = False  # --force: a running job was stopped first (result.stopped)
    refused: bool = False  # a job runs: nothing was started
    problem: str | None = None


@dataclass
class Stopped:
    """A stop (fab kill-all, the dashboard's Kill), by one of contract.states.KILLERS: each node's Kill reply
    where fab stopped the nodes itself, the place's own word where the place stopped them (Slurm's state of
    each job it cancelled), and the line to say when something may still be alive."""
    by: str = KILLERS[0]
    replies: list[Reply] = field(default_factory=list)
    place: list[str] = field(default_factory=list)
    problem: str | None = None

    @property
    def clean(self) -> bool:
        return self.problem is None

    @classmethod
    def of_nodes(cls, replies: list[Reply], by: str = KILLERS[0]) -> "Stopped":
        clean = all(r.ok and not r.value.left for r in replies)
        return cls(by, list(replies), problem=None if clean else "kill-all: some processes may still be alive (see above)")


@dataclass
class JobStatus:
    """fab status: each node's Status reply, the job's ports, and the place's own word on the job."""
    replies: list[Reply] = field(default_factory=list)
    waiting: str | None = None  # no node has the job yet and the place still holds it (queued): its line
    ports: tuple | None = None  # (chosen, auto, drawn): report.ports_text's
    place: list[str] = field(default_factory=list)  # under the table (Slurm's state of the job)
    pods: str | None = None  # where fab reaches no node (pods): kubectl's table instead of the nodes'
    pods_failed: bool = False
    problem: str = "status: the job has failed processes or unreachable nodes"  # said when it shows a failure


@dataclass
class Follow:
    """What fab watch and the dashboard follow: the job (None: the one the nodes run), and the place's own
    line on it (callable(snapshot) -> str or None, with `waiting`: the place still holds a job no node has
    yet), None where the place has no word of its own."""
    job_id: str | None = None
    place_line: Callable | None = None


@dataclass
class Written:
    """fab export: what was written, a line each."""
    lines: list[str]
