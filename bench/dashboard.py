"""Benchmark: the dashboard over a big synthetic job.

    .venv/bin/python bench/dashboard.py                      # 16 sshd nodes, 100,000 records a trainer
    .venv/bin/python bench/dashboard.py --transport local    # 16 local nodes, separate workspaces

One trainer per node; every trainer's metrics file starts with --records
records and grows by 5 records/s while the benchmark runs (a trainer at
0.2 s a step), each node's health.json is rewritten every second (as the
agent does) and each trainer logs a line a second. The dashboard (collector +
app under waitress) runs in its own process, so its CPU is measured apart
from this one's. Each collector is measured in the same run:

  plain      fabtrain.controller.collector.Collector: one node_ops command per node per poll
  streaming  fabtrain.controller.streaming.StreamingCollector (what `fab dashboard` uses): one open loop per node

and for each: time to catch up on the whole history, CPU on the controller
and on the nodes while nobody looks and while one page refreshes every
second, p50/p95 latency of every endpoint, and the bytes of a page load and
of one refresh. Printed as figures and as ratios (plain / streaming, each
endpoint against a tiny static file, refresh against full).
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ would come first on sys.path, and a bench/<name>.py
# would shadow a standard module of that name (a bench/copy.py would shadow copy).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

import argparse
import gzip
import http.client
import json
import os
import random
import secrets
import statistics
import subprocess
import tempfile
import threading
import time


JOB_ID = "20261122-040000-bead"


# -- the dashboard process ---------------------------------------------------------------------


def serve(args) -> None:
    import waitress

    from fabtrain.dashboard import create_app
    from fabtrain.controller.streaming import StreamingCollector
    from fabtrain.controller.collector import Collector
    from fabtrain.remote.session import get_session

    from fabtrain.dashboard.serve import MAX_POINTS

    session = get_session(args.cluster)
    cls = StreamingCollector if args.collector == "streaming" else Collector
    collector = cls(session, max_points=MAX_POINTS)  # as fab dashboard
    app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": args.token,
                      "ALLOWED_HOSTS": [f"127.0.0.1:{args.port}"]})
    server = waitress.create_server(app, host="127.0.0.1", port=args.port, threads=8)
    collector.start(args.interval)
    print("ready", flush=True)
    try:
        server.run()
    finally:
        collector.stop()


# -- measuring -------------------------------------------------------------------------------------


def cpu_seconds(proc) -> tuple[float, float]:
    """(own, descendants') CPU seconds of a process tree, reaped children included."""
    import psutil

    try:
        t = proc.cpu_times()
        own = t.user + t.system
        below = t.children_user + t.children_system
        kids = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    for k in kids:
        try:
            kt = k.cpu_times()
            below += kt.user + kt.system + kt.children_user + kt.children_system
        except psutil.NoSuchProcess:
            pass
    return own, below


class Meter:
    """CPU of the dashboard process (the controller) and of the nodes' side of its polling."""

    def __init__(self, server, sshd_pids: list[int]):
        import psutil

        self.server = psutil.Process(server.pid)
        self.sshd = [psutil.Process(p) for p in sshd_pids]

    def sample(self) -> tuple[float, float, float]:
        own, below = cpu_seconds(self.server)
        nodes = below + sum(sum(cpu_seconds(p)) for p in self.sshd)  # local: the children; ssh: sshd and below
        return time.monotonic(), own, nodes

    def window(self, seconds: float) -> tuple[float, float]:
        t0, c0, n0 = self.sample()
        time.sleep(seconds)
        t1, c1, n1 = self.sample()
        return (c1 - c0) / (t1 - t0), (n1 - n0) / (t1 - t0)


class Client:
    def __init__(self, port: int, token: str):
        self.port = port
        self.headers = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {token}", "Accept-Encoding": "gzip"}
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def get(self, path: str) -> tuple[int, int, bytes]:
        """(status, bytes on the wire incl. headers, decoded body)."""
        self.conn.request("GET", path, headers=self.headers)
        r = self.conn.getresponse()
        body = r.read()
        wire = len(body) + sum(len(k) + len(v) + 4 for k, v in r.getheaders()) + 17
        if r.getheader("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if r.status != 200:
            raise RuntimeError(f"GET {path}: {r.status} {body[:200]!r}")
        return r.status, wire, body


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


class Page:
    """What app.js does every refresh: cluster, job, metrics since the cursor, events, one followed log."""

    def __init__(self, client: Client, log_path: str):
        self.client, self.cursor, self.log_path, self.log_offset = client, None, log_path, None

    def refresh(self) -> dict[str, int]:
        sizes = {}
        for name, path in (("cluster", "/api/cluster"), ("job", "/api/job"),
                           ("metrics", "/api/metrics" + (f"?since={self.cursor}" if self.cursor else "")),
                           ("events", "/api/events?limit=100"),
                           ("log", self.log_path + (f"?offset={self.log_offset}" if self.log_offset is not None else ""))):
            _, wire, body = self.client.get(path)
            sizes[name] = wire
            if name == "metrics":
                self.cursor = json.loads(body)["cursor"]
            elif name == "log":
                self.log_offset = json.loads(body)["offset"]
        return sizes


# -- the synthetic job and its growth ------------------------------------------------------------------


def build(root: Path, nodes: int, records: int, transport: str):
    from tests.support.synthetic import SyntheticJob
    from tests.support.sshd import SshdCluster, write_cluster

    sshd = None
    names = [f"node{i + 1}" for i in range(nodes)]
    if transport == "ssh":
        sshd = SshdCluster(root / "sshd", count=nodes)
        cluster = write_cluster(root / "cluster.yaml", sshd, name="bench", ssh_nodes=[(n, ["trainer"]) for n in names],
                                job={"mode": "collective"})
    else:
        cluster = write_cluster(root / "cluster.yaml", None, name="bench", local_nodes=[(n, ["trainer"]) for n in names],
                                job={"mode": "collective"})
    job = SyntheticJob(JOB_ID, {n: (str(root / f"ws-{n}"), [f"trainer-{i}"]) for i, n in enumerate(names)}).start()
    t0 = time.time() - 0.2 * records
    for i, n in enumerate(names):
        job.metrics(n, f"trainer-{i}", range(records), t0=t0, dt=0.2)
        job.log(n, f"trainer-{i}", [f"step {s} loss {7 - s / records:.4f}" for s in range(0, records, 50)])
        job.health(n, cpu=50.0, gpus=[{"index": 0, "util": 80.0, "mem_used": 1 << 30, "mem_total": 8 << 30, "temp": 60}])
        job.event(n, kind="started", role="trainer", rank=i, reason="bench")
    return cluster, job, sshd, names


class Writer(threading.Thread):
    """The job going on: 5 records/s per trainer, a log line/s, health.json every second."""

    def __init__(self, job, names: list[str], records: int):
        super().__init__(daemon=True)
        self.job, self.names, self.step, self.stop = job, names, records, threading.Event()

    def run(self):
        rng = random.Random(1)
        tick = 0
        while not self.stop.wait(0.2):
            for i, n in enumerate(self.names):
                self.job.metrics(n, f"trainer-{i}", range(self.step, self.step + 1), t0=time.time(), rng=rng)
            self.step += 1
            tick += 1
            if tick % 5 == 0:
                for i, n in enumerate(self.names):
                    self.job.log(n, f"trainer-{i}", [f"step {self.step} loss 1.5"])
                    self.job.health(n, cpu=40 + rng.random() * 20,
                                    gpus=[{"index": 0, "util": 70 + rng.random() * 20, "mem_used": 1 << 30,
                                           "mem_total": 8 << 30, "temp": 60}])


# -- one collector's run --------------------------------------------------------------------------------


def run_one(kind: str, args, cluster: Path, sshd_pids: list[int], nodes: int, records: int) -> dict:
    from tests.support.sshd import free_port

    port = free_port(["127.0.0.1"])
    token = secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--cluster", str(cluster), "--port", str(port),
                               "--token", token, "--collector", kind, "--interval", str(args.interval)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out: dict = {"kind": kind}
    try:
        assert server.stdout.readline().strip() == "ready"
        meter = Meter(server, sshd_pids)
        client = Client(port, token)
        t0, c0, n0 = meter.sample()
        while True:  # catch up on the whole history
            job = json.loads(client.get("/api/job")[2])
            done = sum(t["records"] >= records for t in job["trainers"])
            if done == nodes:
                break
            if time.monotonic() - t0 > args.catch_up_limit:
                raise RuntimeError(f"{kind}: caught up on {done}/{nodes} trainers in {args.catch_up_limit} s")
            time.sleep(0.25)
        t1, c1, n1 = meter.sample()
        out["catch_up_s"] = t1 - t0
        out["catch_up_controller_cpu_s"] = c1 - c0
        time.sleep(2)
        out["idle_controller"], out["idle_nodes"] = meter.window(args.seconds)

        # Latency of each endpoint (a browser's headers: gzip accepted).
        page = Page(client, "/api/logs/node1/trainer-0")
        page.refresh()
        cursor_client = Page(client, "/api/logs/node1/trainer-0")
        cursor_client.refresh()
        endpoints = {
            "GET /static/style.css (baseline)": lambda: client.get("/static/style.css"),
            "GET /": lambda: client.get("/"),
            "GET /api/cluster": lambda: client.get("/api/cluster"),
            "GET /api/job": lambda: client.get("/api/job"),
            "GET /api/metrics (full)": lambda: client.get("/api/metrics"),
            "GET /api/metrics?since=": lambda: cursor_client.refresh_metrics(),
            "GET /api/events?limit=100": lambda: client.get("/api/events?limit=100"),
            "GET /api/logs/node1/trainer-0": lambda: client.get("/api/logs/node1/trainer-0"),
            "GET /metrics (Prometheus)": lambda: client.get("/metrics"),
        }

        def refresh_metrics(p=cursor_client):
            r = client.get(f"/api/metrics?since={p.cursor}")
            p.cursor = json.loads(r[2])["cursor"]
            return r
        cursor_client.refresh_metrics = refresh_metrics
        latency = {}
        for name, fn in endpoints.items():
            times = []
            for i in range(args.requests):
                if name == "GET /api/metrics?since=" and i % 10 == 0:
                    time.sleep(0.2)  # let something new arrive, as between two refreshes
                s = time.perf_counter()
                fn()
                times.append((time.perf_counter() - s) * 1000)
            latency[name] = (percentile(times, 0.5), percentile(times, 0.95))
        out["latency_ms"] = latency

        # Bytes: a first page load, then one refresh (the average of 10, a second apart).
        fresh = Page(Client(port, token), "/api/logs/node1/trainer-0")
        first = {p: fresh.client.get(p)[1] for p in ("/", "/static/app.js", "/static/style.css", "/static/plotly.min.js")}
        first.update({f"api:{k}": v for k, v in fresh.refresh().items()})
        out["first_load_bytes"] = first
        refreshes = []
        for _ in range(10):
            time.sleep(1.0)
            refreshes.append(fresh.refresh())
        out["refresh_bytes"] = {k: statistics.mean(r[k] for r in refreshes) for k in refreshes[0]}
        raw = Client(port, token)
        raw.headers.pop("Accept-Encoding")
        out["metrics_full_raw_bytes"] = raw.get("/api/metrics")[1]

        # One viewer: a page refreshing every second.
        stop = threading.Event()

        def viewer():
            p = Page(Client(port, token), "/api/logs/node1/trainer-0")
            while not stop.wait(1.0):
                p.refresh()
        th = threading.Thread(target=viewer, daemon=True)
        th.start()
        time.sleep(1.5)
        out["viewer_controller"], out["viewer_nodes"] = meter.window(args.seconds)
        stop.set()
        th.join()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return out


# -- report ----------------------------------------------------------------------------------------------


def report(results: dict, args, nodes: int) -> None:
    plain, stream = results.get("plain"), results["streaming"]
    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    print(f"\n== dashboard benchmark: {nodes} nodes over {args.transport}, {args.records:,} records per trainer, "
          f"poll interval {args.interval:g} s, {os.cpu_count()} CPUs on this machine ==")
    print("\nCPU (fraction of one core; 'nodes' = per node, the extra CPU the polling causes there)")
    print(f"{'':36}{'plain':>12}{'streaming':>12}{'plain/streaming':>17}")
    rows = [("catch-up time, s", "catch_up_s", lambda v: f"{v:.1f}"),
            ("catch-up controller CPU, s", "catch_up_controller_cpu_s", lambda v: f"{v:.1f}"),
            ("controller, nobody watching", "idle_controller", pct),
            ("per node, nobody watching", "idle_nodes_per_node", pct),
            ("controller, one page at 1 s", "viewer_controller", pct),
            ("per node, one page at 1 s", "viewer_nodes_per_node", pct)]
    for r in results.values():
        r["idle_nodes_per_node"] = r["idle_nodes"] / nodes
        r["viewer_nodes_per_node"] = r["viewer_nodes"] / nodes
    for label, key, f in rows:
        a = plain[key] if plain else None
        b = stream[key]
        ratio = f"{a / b:.1f}x" if a is not None and b else "-"
        print(f"{label:36}{f(a) if a is not None else '-':>12}{f(b):>12}{ratio:>17}")
    print(f"target: per node <= 1% of a core -> streaming {'MET' if stream['idle_nodes_per_node'] <= 0.01 else 'NOT met'} "
          f"({pct(stream['idle_nodes_per_node'])})")

    print("\nLatency per endpoint, ms (streaming run; gzip accepted, keep-alive, sequential)")
    base = stream["latency_ms"]["GET /static/style.css (baseline)"][1]
    print(f"{'':36}{'p50':>9}{'p95':>9}{'p95/baseline':>14}")
    for name, (p50, p95) in stream["latency_ms"].items():
        print(f"{name:36}{p50:>9.1f}{p95:>9.1f}{p95 / base:>13.1f}x")
    worst = max((v[1], k) for k, v in stream["latency_ms"].items() if "full" not in k and "baseline" not in k)
    print(f"target: p95 <= 50 ms -> worst polled endpoint {worst[1]} {worst[0]:.1f} ms "
          f"({'MET' if worst[0] <= 50 else 'NOT met'}); full metrics p95 {stream['latency_ms']['GET /api/metrics (full)'][1]:.1f} ms "
          f"(once per page load)")
    if plain:
        print("(plain run, for comparison: " + ", ".join(f"{k.split()[1]} {v[1]:.1f}" for k, v in plain["latency_ms"].items()
                                                        if k.startswith("GET /api")) + " ms p95)")

    print("\nBytes on the wire (gzip accepted, headers included)")
    first = stream["first_load_bytes"]
    for k, v in first.items():
        print(f"  first load {k:34}{v:>12,}")
    print(f"  first load total{'':30}{sum(first.values()):>12,}")
    refresh = stream["refresh_bytes"]
    for k, v in refresh.items():
        print(f"  one refresh {k:33}{v:>12,.0f}")
    total = sum(refresh.values())
    full = first["api:metrics"]
    print(f"  one refresh total{'':29}{total:>12,.0f}   ({total * 8 / 1000:.1f} kbit/s at 1 refresh/s)")
    print(f"  metrics since cursor vs full: {refresh['metrics']:,.0f} vs {full:,} bytes gzip "
          f"({stream['metrics_full_raw_bytes']:,} raw) = {full / refresh['metrics']:.0f}x smaller")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--transport", choices=("ssh", "local"), default="ssh")
    ap.add_argument("--interval", type=float, default=1.0, help="collector poll interval, s")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each CPU window")
    ap.add_argument("--requests", type=int, default=100, help="requests per endpoint")
    ap.add_argument("--only", choices=("plain", "streaming"), help="measure one collector")
    ap.add_argument("--catch-up-limit", type=float, default=600.0)
    # the dashboard process
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--token", help=argparse.SUPPRESS)
    ap.add_argument("--collector", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return 0

    with tempfile.TemporaryDirectory(prefix="fabtrain-bench-") as tmp:
        root = Path(tmp)
        t = time.time()
        cluster, job, sshd, names = build(root, args.nodes, args.records, args.transport)
        print(f"built {args.nodes} nodes x {args.records:,} records in {time.time() - t:.1f} s "
              f"({sum(f.stat().st_size for f in root.glob('ws-*/jobs/*/metrics/*.jsonl')) / 1e6:.0f} MB of metrics)", flush=True)
        sshd_pids = [n.process.pid for n in sshd.nodes] if sshd else []
        writer = Writer(job, names, args.records)
        writer.start()
        results = {}
        try:
            for kind in ("plain", "streaming"):
                if args.only and kind != args.only:
                    continue
                print(f"measuring {kind} ...", flush=True)
                results[kind] = run_one(kind, args, cluster, sshd_pids, args.nodes, args.records)
        finally:
            writer.stop.set()
            writer.join()
            job.close()
            if sshd:
                sshd.close()
        if "streaming" not in results:
            print(json.dumps(results, indent=1, default=str))
            return 0
        report(results, args, args.nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
