"""Checkpoints in the views: each trainer's last checkpoint and the work a failure now would lose, and what
a restart resumed from, as `fab status`, `fab watch`, the dashboard and /metrics show them (one place).

A trainer's last checkpoint comes from its latest metrics record (the progress hook's `ckpt_*` fields:
the collector keeps them, fabtrain/contract/checkpoints.py says them) or, in `fab status`, from the
agent's health.json (the same fields per process); what a restart resumed from is the agent's `resumed`
sentence (node/agent/checkpoints.py), in health.json and as the `resumed` event.
"""
from __future__ import annotations

from fabtrain.contract import checkpoints as words
from fabtrain.contract.checkpoints import at_risk, last_checkpoint, number
from fabtrain.contract.states import LIVE

LIVE_STATES = tuple(str(s) for s in LIVE)


def view(rec: dict, now: float) -> dict | None:
    """A trainer's last checkpoint as the dashboard's trainers table and /metrics take it: step, at, age,
    path, bytes, seconds (to save), async, landed_at, and the work at risk: steps_since, seconds_since."""
    ck = last_checkpoint(rec)
    if ck is None:
        return None
    steps, seconds = at_risk(ck, rec.get("step"), now)
    return {**ck, "age": seconds, "steps_since": steps, "seconds_since": seconds,
            "text": words.checkpoint_text(ck, rec.get("step"), now)}


def cell(rec: dict, now: float) -> str:
    """fab watch's column: `1200 (14m ago, 1.2 GiB in 3.1s), +310 steps` or `-`."""
    ck = last_checkpoint(rec)
    if ck is None:
        return "-"
    steps, seconds = at_risk(ck, rec.get("step"), now)
    said = [x for x in ((words.seconds_text(seconds) + " ago") if seconds is not None else None,
                        words.size_text(ck["bytes"]),
                        ("in " + words.seconds_text(ck["seconds"])) if ck["seconds"] is not None else None) if x]
    text = words.step_text(ck["step"]) + (" (%s)" % ", ".join(said) if said else "")
    return text + (", +%d steps" % steps if steps is not None else "")


def health_lines(healths: list[tuple[str, dict | None, float]]) -> list[str]:
    """fab status's lines of the nodes' health.json ((node, health, the node's time now) each): each process's
    last checkpoint and what a failure now would lose, the processes that saved the same one (every rank of a
    torch.distributed.checkpoint save) in one line; nothing for a process that saved none."""
    said: dict[tuple, list] = {}
    for node, health, now in healths:
        for p in (health or {}).get("processes") or []:
            ck = last_checkpoint(p)
            if ck is not None:
                said.setdefault((ck["path"], ck["step"]), []).append((f"{p['name']} on {node}", p, ck, now))
    out = []
    for group in said.values():
        who, p, ck, now = group[0]
        live = p.get("state") in LIVE_STATES  # an ended process loses nothing more
        names = ", ".join(g[0] for g in group[:3]) + (f" and {len(group) - 3} more" if len(group) > 3 else "")
        out.append(f"checkpoint: {names}: {words.checkpoint_text(ck, p.get('step'), now, live)}")
    return out


def resumed_lines(healths: list[tuple[str, dict | None]]) -> list[str]:
    """The agents' `resumed` sentences of the running generation, each once, with the processes it is of."""
    said: dict[str, list[str]] = {}
    for node, health in healths:
        for p in (health or {}).get("processes") or []:
            if isinstance(p.get("resumed"), str) and p["resumed"]:
                said.setdefault(p["resumed"], []).append(f"{p['name']} on {node}")
    return [f"{', '.join(who)}: {text}" for text, who in said.items()]


def none_yet(healths: list[tuple[str, dict | None]]) -> str | None:
    """A line when trainers have stepped and none has saved a checkpoint: all of their work is at risk."""
    procs = [p for _, h in healths for p in (h or {}).get("processes") or [] if p.get("role") == "trainer"]
    stepped = [p for p in procs if number(p.get("step")) is not None]
    if not stepped or any(last_checkpoint(p) is not None for p in procs):
        return None
    most = max(p["step"] for p in stepped)
    return (f"checkpoint: none seen yet (saves through torch.save, torch.distributed.checkpoint, Lightning and "
            f"Hugging Face are): a failure now loses every step ({words.step_text(most)})")
