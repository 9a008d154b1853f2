"""A synthetic job: the on-node files of a job, written directly.

For the dashboard's and the collector's tests, the dashboard's benchmark and
screenshots. Writes exactly what node ops `start` (fabtrain/node/ops.py) and
the node agent would (docs/architecture.md, "On each node"): job.json,
run/<name>.json, run/<name>.exit, logs/, metrics/, health.json, events.jsonl
and the `current` link. A "running" process is a
real `sleep` in its own session carrying the job marker in its environment,
so node ops sees it alive and `kill-all` can stop it like a real one.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil


class SyntheticJob:
    def __init__(self, job_id: str, nodes: dict[str, tuple[str, list[str]]]):
        """nodes: node name -> (absolute workspace, process names such as "trainer-0")."""
        self.job_id = job_id
        self.nodes = nodes
        self.sleepers: dict[tuple[str, str], subprocess.Popen] = {}

    def job_dir(self, node: str) -> Path:
        return Path(self.nodes[node][0]) / "jobs" / self.job_id

    def start(self, running: bool = True) -> "SyntheticJob":
        for node, (ws, names) in self.nodes.items():
            jd = self.job_dir(node)
            for sub in ("logs", "run", "metrics"):
                (jd / sub).mkdir(parents=True, exist_ok=True)
            processes = []
            for name in names:
                role, _, rank = name.rpartition("-")
                processes.append({"name": name, "role": role, "rank": int(rank),
                                  "argv": ["python", "-m", f"workload.{role}"],
                                  "log": f"{jd}/logs/{name}.log", "run": f"{jd}/run/{name}.json",
                                  "exit": f"{jd}/run/{name}.exit", "metrics": f"{jd}/metrics/{name}.jsonl"})
            _atomic(jd / "job.json", json.dumps({"job_id": self.job_id, "node": node, "workspace": ws,
                                                  "processes": processes}))
            link = Path(ws) / "current"
            tmp = Path(ws) / f".current.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(Path("jobs") / self.job_id)
            os.replace(tmp, link)
            if running:
                for name in names:
                    self.run(node, name)
        return self

    def run(self, node: str, name: str) -> int:
        """Start a live stand-in for a process (a sleep in its own session, with the job marker)."""
        ws = self.nodes[node][0]
        role, _, rank = name.rpartition("-")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FABTRAIN_WORKSPACE": ws,
               "FABTRAIN_JOB_ID": self.job_id, "FABTRAIN_NODE": node, "FABTRAIN_ROLE": role, "FABTRAIN_RANK": rank}
        p = subprocess.Popen(["sleep", "3600"], env=env, start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.sleepers[(node, name)] = p
        record = {"name": name, "role": role, "rank": int(rank), "pid": p.pid, "pgid": p.pid,
                  "create_time": psutil.Process(p.pid).create_time(), "argv": ["python", "-m", f"workload.{role}"],
                  "started_at": time.time()}
        _atomic(self.job_dir(node) / "run" / f"{name}.json", json.dumps(record))
        return p.pid

    def vanish(self, node: str, name: str) -> None:
        """The launcher is gone without recording an exit (node ops: lost); nothing else changes."""
        p = self.sleepers.pop((node, name))
        p.kill()
        p.wait()

    def exit(self, node: str, name: str, code: int) -> None:
        """The process ends by itself with `code` (as the launch wrapper records it)."""
        p = self.sleepers.pop((node, name), None)
        if p is not None:
            p.kill()
            p.wait()
        _atomic(self.job_dir(node) / "run" / f"{name}.exit", f"{code}\n")

    def metrics(self, node: str, name: str, steps: range, t0: float | None = None, dt: float = 0.2,
                rng: random.Random | None = None) -> None:
        """Append one record per step: a decaying loss, a noisy throughput."""
        rng = rng or random.Random(hash((node, name)) & 0xFFFF)
        role, _, rank = name.rpartition("-")
        t0 = time.time() - dt * len(steps) if t0 is None else t0
        lines = []
        for i, step in enumerate(steps):
            loss = 7.5 * math.exp(-step / 4000) + 1.2 + 0.08 * rng.random()
            lines.append(json.dumps({"ts": round(t0 + i * dt, 3), "role": role, "rank": int(rank), "step": step,
                                     "epoch": step // 5000, "loss": round(loss, 5),
                                     "samples_per_s": round(800 + 60 * rng.random(), 2), "lr": 0.01}))
        with open(self.job_dir(node) / "metrics" / f"{name}.jsonl", "a") as f:
            f.write("\n".join(lines) + "\n")

    def log(self, node: str, name: str, lines: list[str]) -> None:
        with open(self.job_dir(node) / "logs" / f"{name}.log", "a") as f:
            f.write("".join(line + "\n" for line in lines))

    def event(self, node: str, **fields) -> None:
        record = {"ts": time.time(), "node": node, **fields}
        with open(self.job_dir(node) / "events.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def health(self, node: str, cpu: float = 40.0, gpus: list[dict] | None = None, ts: float | None = None,
               processes: list[dict] | None = None, job: dict | None = None, **more) -> None:
        """health.json as the agent writes it (atomically); `job` is the agent's view of the job
        ({"status": "running" | "failed" | "finished", "reason", "on_failure", "kept"}); `more`: other
        fields (its recent `events`, `coordinator`...)."""
        doc = {"ts": time.time() if ts is None else ts, "node": node, "job_id": self.job_id, "interval": 1.0,
               "host": {"cpu_percent": cpu, "load": [1.0, 0.8, 0.5], "mem_percent": 41.5,
                        "mem_used": 26 << 30, "mem_total": 64 << 30, "swap_percent": 0.0,
                        "disk_free": 410 << 30, "disk_total": 1000 << 30, "disk_percent": 59.0,
                        "net_rx_bps": 12.5e6, "net_tx_bps": 11.0e6},
               "gpus": gpus if gpus is not None else [],
               "processes": processes or [],
               "agent": {"pid": os.getpid(), "rss": 30 << 20, "cpu_percent": 0.4},
               "peers": {}}
        if job is not None:
            doc["job"] = job
        doc.update(more)
        _atomic(self.job_dir(node) / "health.json", json.dumps(doc))

    def append(self, node: str, rel: str, data: bytes) -> None:
        """Raw bytes at the end of a file of the job (events.jsonl, metrics/<name>.jsonl): what a
        misbehaving program might write."""
        with open(self.job_dir(node) / rel, "ab") as f:
            f.write(data)

    def close(self) -> None:
        for p in self.sleepers.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.sleepers.clear()


def local_cluster(root: Path, nodes: dict[str, list[str]], name: str = "synthetic",
                  unreachable: dict[str, list[str]] | None = None) -> Path:
    """A cluster file of `host: local` nodes (name -> roles), workspaces under root; and
    `unreachable` nodes, SSH nodes whose connection is refused at once (127.0.0.1 port 1)."""
    import sys

    import yaml

    (root / "known_hosts").touch()
    refused = [{"name": n, "host": "127.0.0.1", "port": 1, "roles": roles, "workspace": str(root / f"ws-{n}"),
                "known_hosts": str(root / "known_hosts"), "connect_timeout": 2}
               for n, roles in (unreachable or {}).items()]
    doc = {"cluster": {"name": name, "python": sys.executable},
           "nodes": [{"name": n, "host": "local", "roles": roles, "workspace": str(root / f"ws-{n}")}
                     for n, roles in nodes.items()] + refused,
           "job": {"pserver": {"command": "python -m workload.pserver"},
                   "trainer": {"command": "python -m workload.trainer"}}}
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def gpu(index: int, util: float, temp: int = 60) -> dict:
    return {"index": index, "name": "NVIDIA A100-SXM4-80GB", "util": util, "mem_used": 52 << 30,
            "mem_total": 80 << 30, "temp": temp, "power_w": 250.0}


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def dashboard(cluster_file: Path, token: str, **config):
    """The dashboard as `fab dashboard` serves it (the streaming collector polling every 0.5 s,
    waitress in a thread) over the cluster file's nodes; yields its URL."""
    from fabtrain.config.cluster import load_cluster
    from fabtrain.controller.streaming import StreamingCollector
    from fabtrain.dashboard import create_app
    from fabtrain.dashboard.serve import MAX_POINTS, make_server
    from fabtrain.remote.session import Session
    from tests.support.sshd import free_port

    session = Session(load_cluster(str(cluster_file)))
    collector = StreamingCollector(session, max_points=MAX_POINTS)
    collector.start(0.5)
    port = free_port(["127.0.0.1"])
    app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": token, "ALLOWED_HOSTS": [f"127.0.0.1:{port}"],
                      **config})
    server = make_server(app, "127.0.0.1", port, threads=4)
    threading.Thread(target=server.run, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        collector.stop()
        session.close()
