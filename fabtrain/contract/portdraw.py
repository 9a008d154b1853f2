"""Drawing `auto` ports, and the tokens a Slurm plan holds where a port drawn in the allocation goes.

One draw for both places a job's `auto` ports are chosen: the controller
before an SSH job starts (fabtrain/plan/ports.py, among the ports its probe
found free on the nodes), and inside a Slurm allocation (fabtrain/node/
allocports.py, among the ports every node of the allocation found free),
where no node is known at submit.

A Slurm plan is rendered at submit, so where an `auto` port goes it holds a
token instead (fabtrain/slurm/allocports.py puts them there): in a string
``@slurm-port:master_port+3@`` (master_port's port plus 3), and in place of
a number ``{"@slurm-port": "master_port", "+": 3}``. `fill` puts the ports
drawn in.

Standard library only: the node runtime ships it.
"""
import re

TOKEN_RE = re.compile(r"@slurm-port:([a-z_]+)\+(\d+)@")
NUMBER_KEY = "@slurm-port"  # a number's token: {"@slurm-port": setting, "+": offset}


def token(setting, plus):
    """The token of `setting`'s port plus `plus`, inside a string."""
    return "@slurm-port:%s+%d@" % (setting, plus)


def number_token(setting, plus):
    """The token of `setting`'s port plus `plus`, where the plan holds a number."""
    return {NUMBER_KEY: setting, "+": plus}


def fill(value, ports):
    """`value` (a plan's JSON data) with every port token replaced by the port drawn (`ports`: setting -> port).
    A KeyError names a setting the tokens use that `ports` lacks."""
    if isinstance(value, str):
        return TOKEN_RE.sub(lambda m: str(ports[m.group(1)] + int(m.group(2))), value)
    if isinstance(value, list):
        return [fill(v, ports) for v in value]
    if isinstance(value, dict):
        if set(value) == {NUMBER_KEY, "+"}:
            return ports[value[NUMBER_KEY]] + int(value["+"])
        return {k: fill(v, ports) for k, v in value.items()}
    return value


def draw(wanted, held, busy, window, rng):
    """The base port of each `auto` setting, free on every node it is used on.

    wanted: [(setting, [(where, offset, count), ...])] in the order to draw them: the setting's port plus
    `offset` and the `count - 1` after it are listened on at `where` (a node). held: {where: ports} the
    job's fixed ports hold; busy: {where: ports} a socket or another job holds. A base is tried at random
    in `window` first, then every one in order: two jobs started moments apart rarely pick alike (random,
    not the lowest free). Each port drawn is held for the settings after it.
    Returns {setting: port}; raises LookupError(setting) when the window has no room for one.
    """
    lo, hi = window
    held = {where: set(ports) for where, ports in held.items()}
    nothing = frozenset()
    chosen = {}
    for setting, uses in wanted:
        def free(base):  # each port looked up, no set built: a try is O(its ports), not O(window)
            for where, offset, count in uses:
                first = base + offset
                if first + count - 1 > hi:
                    return False
                taken, ours = busy.get(where, nothing), held.get(where, nothing)
                if any(p in taken or p in ours for p in range(first, first + count)):
                    return False
            return True
        tries = [rng.randint(lo, hi) for _ in range(200)]
        base = next((b for b in tries if free(b)), None)
        if base is None:
            base = next((b for b in range(lo, hi + 1) if free(b)), None)
        if base is None:
            raise LookupError(setting)
        chosen[setting] = base
        for where, offset, count in uses:
            held.setdefault(where, set()).update(range(base + offset, base + offset + count))
    return chosen
