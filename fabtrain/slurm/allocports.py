"""`auto` ports on Slurm: drawn inside the allocation, where the nodes are known.

At submit nobody knows which nodes the job will get, so the batch script's
plan holds a token wherever an `auto` port goes (contract/portdraw.py) and
says where each is listened on (`draw_spec`). In the allocation each node's
step task reports the ports it has busy, node 0's draws among those free on
every node concerned, and each task fills the tokens in
(fabtrain/node/allocports.py).

Where do the tokens go? The plan derives numbers from its ports (trainer
endpoints at master_port + 1 + k, pserver blocks, a user's `{port}`), so
`symbolic` finds them by making the plan again with one setting's port moved
by SHIFT: every number that moved by exactly SHIFT comes from that port, at
its offset from it. Nothing else in the plan may change: a difference of any
other kind (a user's text that runs a port together with other digits) is
one line asking for a fixed port.
"""
from __future__ import annotations

import re

from fabtrain.config.cluster import Cluster
from fabtrain.contract import portdraw
from fabtrain.errors import UserError
from fabtrain.plan.plan import Network
from fabtrain.plan.ports import AUTO_WINDOW, auto_uses, configured_ports, port_uses

SHIFT = 1000  # how far the second plan moves a setting's port; the ports drawn at submit stay far below 65535
NUMBERS = re.compile(r"(\d+)")


def shifted(network: Network, setting: str) -> Network:
    """The same ports with `setting`'s moved by SHIFT: the plan made from it shows where that port goes."""
    return Network(ports={**network.ports, setting: network.ports[setting] + SHIFT}, auto=network.auto,
                   ifaces=network.ifaces)


def symbolic(data, moved: dict[str, object], ports: dict[str, int]):
    """`data` (the batch script's plan data, made with `ports`) with a token wherever an `auto` port goes;
    `moved`: the same data made with each auto setting's port moved by SHIFT."""
    return _walk(data, moved, ports, "plan")


def _walk(value, moved: dict, ports: dict, where: str):
    if isinstance(value, dict):
        for m in moved.values():
            _same(isinstance(m, dict) and m.keys() == value.keys(), where)
        if isinstance(value.get("name"), str) and "argv" in value:  # a process: named as the user knows it
            where = f"process {value['name']}"
        return {k: _walk(v, {s: m[k] for s, m in moved.items()}, ports, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        for m in moved.values():
            _same(isinstance(m, list) and len(m) == len(value), where)
        return [_walk(v, {s: m[i] for s, m in moved.items()}, ports, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, int) and not isinstance(value, bool):
        setting = _mover(value, moved, ports, where)
        return portdraw.number_token(setting, value - ports[setting]) if setting else value
    if isinstance(value, str):
        if all(m == value for m in moved.values()):
            return value
        parts = NUMBERS.split(value)
        split = {s: NUMBERS.split(m) if isinstance(m, str) else None for s, m in moved.items()}
        for p in split.values():
            _same(p is not None and len(p) == len(parts), where, value)
        out = []
        for i, part in enumerate(parts):
            if i % 2 == 0:  # the text between two numbers: the same in every plan
                _same(all(p[i] == part for p in split.values()), where, value)
                out.append(part)
                continue
            setting = _mover(int(part), {s: int(p[i]) for s, p in split.items()}, ports, where, value)
            # A port run together with other digits ("{rank}{master_port}", "{master_port}0") moves as a
            # longer number, or keeps a leading zero the token would drop: it cannot be placed.
            _same(setting is None or part == str(int(part)) and len(split[setting][i]) == len(part), where, value)
            out.append(portdraw.token(setting, int(part) - ports[setting]) if setting else part)
        return "".join(out)
    _same(all(m == value for m in moved.values()), where)
    return value


def _mover(value: int, moved: dict, ports: dict, where: str, text: str | None = None) -> str | None:
    """The one setting whose move moved this number (by SHIFT, the others leaving it), or None."""
    movers = [s for s, m in moved.items() if m != value]
    _same(len(movers) <= 1 and all(moved[s] == value + SHIFT for s in movers), where, text)
    if movers:
        _same(value >= ports[movers[0]], where, text)
    return movers[0] if movers else None


def _same(ok: bool, where: str, text: str | None = None) -> None:
    """The plans are made from the same settings: only a user's `text` (a command's argument, an environment
    value) can move otherwise, by running a port together with other digits; anything else is a bug."""
    if ok:
        return
    if text is not None:
        raise UserError(f"cluster.yaml: an auto port is run together with other digits in {where} "
                        f"({text[:80]!r}), where it cannot be drawn in the Slurm allocation; give that port a "
                        "fixed number (e.g. master_port: 29500)")
    raise RuntimeError(f"fabtrain: the Slurm plan's {where} changes with an auto port in a way that is not "
                       "the port itself: a bug in the plan, please report it")


def draw_spec(cluster: Cluster, auto: tuple[str, ...]) -> dict:
    """What the allocation draws with: each auto setting's uses, by node index (the plan's node order is the
    allocation's), at their offset from the port drawn; the ports the job's fixed settings hold; the window."""
    index = {n.name: i for i, n in enumerate(cluster.nodes)}
    configured = configured_ports(cluster)
    held = [[index[u.node], u.port, u.count] for u in port_uses(cluster, configured, unchecked=True)]
    return {"auto": [[setting, [[index[u.node], u.port, u.count] for u in auto_uses(cluster, setting)]]
                     for setting in auto],
            "held": held, "window": list(AUTO_WINDOW)}
