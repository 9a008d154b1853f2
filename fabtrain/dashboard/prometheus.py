"""/metrics: the collector's view in Prometheus text format (version 0.0.4).

Gauges, and two counters (records dropped as malformed, per node; the job's
restarts under on_failure restart); every
series named fabtrain_*. States are one-hot gauges with a `state` label (as
kube-state-metrics does), so a Grafana panel can show "which processes are
not running" with a plain selector. The job's state is the collector's
verdict, the one `fab status` and `fab watch` show.
"""
from __future__ import annotations

import math

from fabtrain.contract.states import JobState
from fabtrain.contract.states import ProcessState

from fabtrain.controller import checkpoints

from .api import number, process_role

PROCESS_STATES = tuple(s.value for s in ProcessState)
JOB_STATES = tuple(s.value for s in JobState)


def _escape(value) -> str:
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Writer:
    def __init__(self):
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, name: str, help_text: str, labels: dict, value, kind: str = "gauge") -> None:
        value = number(value) if not isinstance(value, bool) else value
        if value is None:
            return
        family = self.families.setdefault(name, (help_text, kind, []))
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        family[2].append(f"{name}{{{label_text}}} {_fmt(value)}" if labels else f"{name} {_fmt(value)}")

    def text(self) -> str:
        out = []
        for name, (help_text, kind, samples) in self.families.items():
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)
        return "\n".join(out) + "\n"


def render(snap, now: float) -> str:
    w = _Writer()
    cluster_name = snap.cluster
    verdict = snap.verdict
    for n in snap.nodes:
        node = {"cluster": cluster_name, "node": n.name}
        w.add("fabtrain_node_up", "1 if the controller reached the node at its last poll", node, n.up is True)
        if n.last_seen is not None:
            w.add("fabtrain_node_last_seen_timestamp_seconds", "When the controller last reached the node", node, n.last_seen)
        _health(w, node, n.health or {}, now)
        for p in n.processes:
            seen = verdict.process(n.name, p["name"])
            current = seen.state.value if seen else p["state"]
            pl = node | {"process": p["name"], "role": process_role(p["name"])[0]}
            for s in PROCESS_STATES:
                w.add("fabtrain_process_state", "1 for the process's current state (running, sleeping, stopped, "
                      "zombie, exited, killed, lost, not started)", pl | {"state": s}, current == s)
            code = seen.exit_code if seen else p.get("exit_code")
            if current in ("exited", "killed") and code is not None:
                w.add("fabtrain_process_exit_code", "Exit code of a process that ended (128+N: killed by signal N)", pl, code)
    for pname, prog in snap.progress.items():
        pl = {"cluster": cluster_name, "node": prog.node, "process": pname}
        rec = prog.last
        w.add("fabtrain_trainer_step", "Latest step reported in the metrics file", pl, rec.get("step"))
        w.add("fabtrain_trainer_epoch", "Latest epoch reported in the metrics file", pl, rec.get("epoch"))
        w.add("fabtrain_trainer_loss", "Latest training loss", pl, rec.get("loss"))
        w.add("fabtrain_trainer_samples_per_second", "Latest training throughput, samples per second", pl, rec.get("samples_per_s"))
        w.add("fabtrain_trainer_last_record_timestamp_seconds", "ts of the latest metrics record", pl, rec.get("ts"))
        w.add("fabtrain_trainer_records", "Metrics records read so far", pl, prog.records)
        w.add("fabtrain_trainer_total_steps", "The run's total steps, where the framework knows them", pl,
              rec.get("total_steps"))
        for key in ("step_time", "data_time", "compute_time", "comm_time"):
            w.add(f"fabtrain_trainer_{key}_seconds", f"Mean {key.replace('_', ' ')} of the latest steps recorded "
                  "(the launcher's hook, docs/progress.md)", pl, rec.get(key))
        _checkpoint(w, pl, checkpoints.view(rec, now))
    for n in snap.nodes:
        d = snap.dropped.get(n.name) or {"count": 0}
        w.add("fabtrain_records_dropped_total", "Records from the node dropped as malformed (bad JSON, NaN, "
              "wrong field types, over-long lines) since the dashboard started", {"cluster": cluster_name, "node": n.name},
              d["count"], kind="counter")
    for s in verdict.stragglers:
        sl = {"cluster": cluster_name, "node": s.node, "process": s.name,
              "rank": "" if s.rank is None else str(s.rank), "cause": s.cause or "step rate"}
        w.add("fabtrain_straggler", "1 for a rank the others wait for (watchdog.straggler): by its data loading or "
              "compute time against the median rank's, or its backed-up sends (synchronous training), or by its "
              "step rate", sl, 1)
        if s.ratio is not None:
            w.add("fabtrain_straggler_ratio", "The straggler's data loading or compute time a step over the median "
                  "rank's (communication: its share of time with sends backed up over the median rank's)", sl, s.ratio)
    jl = {"cluster": cluster_name, "job": verdict.job_id or ""}
    if verdict.restarts:
        w.add("fabtrain_job_restarts_total", "Times the watchdog restarted the job (on_failure restart): its generation",
              jl, verdict.generation, kind="counter")
        w.add("fabtrain_job_restarts_left", "Restarts left before the next failure fails the job", jl,
              verdict.restarts_left)
    for s in JOB_STATES:
        w.add("fabtrain_job_state", "1 for the job's current state (the verdict fab status and fab watch show)",
              jl | {"state": s}, verdict.state.value == s)
    return w.text()


def _checkpoint(w: _Writer, pl: dict, ck: dict | None) -> None:
    """A trainer's last checkpoint and the work a failure now would lose (controller/checkpoints.py)."""
    if ck is None:
        return
    w.add("fabtrain_trainer_checkpoint_step", "Step of the trainer's last checkpoint save (the launcher's hook)",
          pl, ck["step"])
    w.add("fabtrain_trainer_checkpoint_timestamp_seconds", "When the trainer's last checkpoint save returned", pl,
          ck["at"])
    w.add("fabtrain_trainer_checkpoint_age_seconds", "Seconds since the trainer's last checkpoint: the time a "
          "failure now would lose", pl, ck["seconds_since"])
    w.add("fabtrain_trainer_steps_since_checkpoint", "Steps since the trainer's last checkpoint: the steps a "
          "failure now would lose", pl, ck["steps_since"])
    w.add("fabtrain_trainer_checkpoint_bytes", "Size of the trainer's last checkpoint, bytes", pl, ck["bytes"])
    w.add("fabtrain_trainer_checkpoint_save_seconds", "Seconds the trainer's last checkpoint save took", pl,
          ck["seconds"])


def _health(w: _Writer, node: dict, h: dict, now: float) -> None:
    host = h.get("host") or {}
    if h.get("ts") is not None:
        w.add("fabtrain_node_health_age_seconds", "Age of the node agent's latest health snapshot", node, now - h["ts"])
    w.add("fabtrain_node_cpu_percent", "Node CPU utilisation, percent of all cores", node, host.get("cpu_percent"))
    w.add("fabtrain_node_mem_percent", "Node memory in use, percent", node, host.get("mem_percent"))
    w.add("fabtrain_node_mem_used_bytes", "Node memory in use, bytes", node, host.get("mem_used"))
    w.add("fabtrain_node_disk_percent", "Workspace disk in use, percent", node, host.get("disk_percent"))
    w.add("fabtrain_node_disk_free_bytes", "Workspace disk free, bytes", node, host.get("disk_free"))
    w.add("fabtrain_node_net_receive_bytes_per_second", "Network bytes received per second", node, host.get("net_rx_bps"))
    w.add("fabtrain_node_net_transmit_bytes_per_second", "Network bytes sent per second", node, host.get("net_tx_bps"))
    for g in h.get("gpus") or []:
        gl = node | {"gpu": g.get("index", "?")}
        w.add("fabtrain_gpu_util_percent", "GPU utilisation, percent", gl, g.get("util"))
        w.add("fabtrain_gpu_mem_used_bytes", "GPU memory in use, bytes", gl, g.get("mem_used"))
        w.add("fabtrain_gpu_mem_total_bytes", "GPU memory, bytes", gl, g.get("mem_total"))
        w.add("fabtrain_gpu_temp_celsius", "GPU temperature, degrees Celsius", gl, g.get("temp"))
        w.add("fabtrain_gpu_power_watts", "GPU power draw, watts", gl, g.get("power_w"))
