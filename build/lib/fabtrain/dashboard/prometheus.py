"""/metrics: the collector's view in Prometheus text format (version 0.0.4).

Gauges only, every series named fabtrain_*; states are one-hot gauges with
a `state` label (as kube-state-metrics does), so a Grafana panel can show
"which processes are not running" with a plain selector.
"""
from __future__ import annotations

import math

from .api import number, process_role

PROCESS_STATES = ("running", "sleeping", "stopped", "zombie", "exited", "killed", "lost", "not started")
JOB_STATES = ("no job", "starting", "running", "finished", "failed", "killed")


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
        self.families: dict[str, tuple[str, list[str]]] = {}

    def add(self, name: str, help_text: str, labels: dict, value) -> None:
        value = number(value) if not isinstance(value, bool) else value
        if value is None:
            return
        family = self.families.setdefault(name, (help_text, []))
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        family[1].append(f"{name}{{{label_text}}} {_fmt(value)}" if labels else f"{name} {_fmt(value)}")

    def text(self) -> str:
        out = []
        for name, (help_text, samples) in self.families.items():
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} gauge")
            out.extend(samples)
        return "\n".join(out) + "\n"


def render(collector, cluster_name: str, now: float) -> str:
    w = _Writer()
    state = collector.job_state()
    job_id = collector.job_id_seen() or ""
    with collector.lock:
        for name, view in collector.nodes.items():
            node = {"cluster": cluster_name, "node": name}
            w.add("fabtrain_node_up", "1 if the controller reached the node at its last poll", node, view.up is True)
            if view.last_seen is not None:
                w.add("fabtrain_node_last_seen_timestamp_seconds", "When the controller last reached the node", node, view.last_seen)
            h = view.health if isinstance(view.health, dict) else {}
            host = h.get("host") if isinstance(h.get("host"), dict) else {}
            if number(h.get("ts")) is not None:
                w.add("fabtrain_node_health_age_seconds", "Age of the node agent's latest health snapshot", node, now - h["ts"])
            w.add("fabtrain_node_cpu_percent", "Node CPU utilisation, percent of all cores", node, host.get("cpu_percent"))
            w.add("fabtrain_node_mem_percent", "Node memory in use, percent", node, host.get("mem_percent"))
            w.add("fabtrain_node_mem_used_bytes", "Node memory in use, bytes", node, host.get("mem_used"))
            w.add("fabtrain_node_disk_percent", "Workspace disk in use, percent", node, host.get("disk_percent"))
            w.add("fabtrain_node_disk_free_bytes", "Workspace disk free, bytes", node, host.get("disk_free"))
            w.add("fabtrain_node_net_receive_bytes_per_second", "Network bytes received per second", node, host.get("net_rx_bps"))
            w.add("fabtrain_node_net_transmit_bytes_per_second", "Network bytes sent per second", node, host.get("net_tx_bps"))
            for g in h.get("gpus") or []:
                if not isinstance(g, dict):
                    continue
                gl = node | {"gpu": g.get("index", "?")}
                w.add("fabtrain_gpu_util_percent", "GPU utilisation, percent", gl, g.get("util"))
                w.add("fabtrain_gpu_mem_used_bytes", "GPU memory in use, bytes", gl, g.get("mem_used"))
                w.add("fabtrain_gpu_mem_total_bytes", "GPU memory, bytes", gl, g.get("mem_total"))
                w.add("fabtrain_gpu_temp_celsius", "GPU temperature, degrees Celsius", gl, g.get("temp"))
                w.add("fabtrain_gpu_power_watts", "GPU power draw, watts", gl, g.get("power_w"))
            for p in view.processes:
                pname = p.get("name", "?")
                role, rank = process_role(pname)
                pl = node | {"process": pname, "role": role}
                current = p.get("state")
                for s in PROCESS_STATES if current in PROCESS_STATES else (*PROCESS_STATES, current):
                    w.add("fabtrain_process_state", "1 for the process's current state (running, stopped, zombie, exited, killed, lost)",
                          pl | {"state": s}, current == s)
                if current == "exited":
                    w.add("fabtrain_process_exit_code", "Exit code of a process that exited", pl, p.get("exit_code"))
        for pname, prog in collector.progress.items():
            pl = {"cluster": cluster_name, "node": prog.node, "process": pname}
            rec = prog.last
            w.add("fabtrain_trainer_step", "Latest step reported in the metrics file", pl, rec.get("step"))
            w.add("fabtrain_trainer_epoch", "Latest epoch reported in the metrics file", pl, rec.get("epoch"))
            w.add("fabtrain_trainer_loss", "Latest training loss", pl, rec.get("loss"))
            w.add("fabtrain_trainer_samples_per_second", "Latest training throughput, samples per second", pl, rec.get("samples_per_s"))
            w.add("fabtrain_trainer_last_record_timestamp_seconds", "ts of the latest metrics record", pl, rec.get("ts"))
            w.add("fabtrain_trainer_records", "Metrics records read so far", pl, prog.records)
    jl = {"cluster": cluster_name, "job": job_id}
    for s in JOB_STATES:
        w.add("fabtrain_job_state", "1 for the job's current state (starting, running, finished, failed, killed)", jl | {"state": s}, state == s)
    return w.text()
