"""What do fabtrain's fan-outs, the agents' coordinator and the dashboard cost at 64 nodes?

64 real sshd nodes on one machine (127.0.0.2-65, one sshd each), logged into
as the plain account of bench/nodes.py; a stand-in collective job (one
`sleep 600` trainer per node, watchdog on, interval 1 s). For each --nodes
count (default 16 and 64, the first N of the same sshd nodes), --repeat
times, interleaved:

  ssh       N parallel OpenSSH `ssh node true` (a new connection each: the issue's baseline)
  floor     N parallel `true` over connections already open
  status    what `fab status` does: connect, one node-ops call per node (health on), the table;
            measured once every agent has joined the coordinator (the job as a user finds it)
  status@start  the same, right after the start returns, while the N fresh agents take their
            first CPU (on one 2-core machine; on a cluster each node has its own cores)
  start     what `fab start-trainers` does: connect, one start per node (agent included)
  kill-all  what `fab kill-all` does: connect, one kill per node

each as wall time and controller CPU (this process and its children), and
the ratio to ssh. Then, with the job running:

  coordinator   CPU of the first node's agent (which hosts the coordinator)
                less the median agent's, over --window s: CPU per beat
  collector     the dashboard's StreamingCollector: first poll (opens a
                channel per node), one poll of every node, controller CPU in
                the background at one poll a second, the oldest node view,
                and the time to build /api/cluster and /api/job
  model         the coordinator's per-beat work in-process (no sockets) at
                16 to 1,000 peers, each beat naming the roster version its
                node holds: CPU and bytes a reply as nodes grow (the median
                of 5 rounds), and one failure sealed for every other peer
                (--model-only: this alone)

    .venv/bin/python bench/scale.py [--nodes 16,64] [--repeat 3] [--window 10] [--model-only]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from bench import nodes  # noqa: E402
from bench.fanout import session, spread  # noqa: E402
from fabtrain.controller import lifecycle, report  # noqa: E402
from fabtrain.remote.transport import fan_out  # noqa: E402
from tests.support.procscan import stat  # noqa: E402
from tests.support.sshd import SshdCluster  # noqa: E402

ACCOUNT = nodes.ACCOUNTS["plain"]
INTERVAL = 1.0  # watchdog and collector


def cpu_now() -> float:
    """CPU seconds of this process and its reaped children (OpenSSH clients, rsync)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn) -> tuple[float, float]:
    c0, t0 = cpu_now(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_now() - c0


def ssh_true(path: Path) -> None:
    s = session(path)
    argvs = [[*nodes.openssh_argv(t, path.parent), "true"] for t in (s.transport(n) for n in s.cluster.nodes)]
    replies = fan_out(argvs, lambda a: subprocess.run(a, check=True, capture_output=True), 64, name=lambda a: a[-2])
    assert all(r.ok for r in replies), [r.error for r in replies if not r.ok]


def with_session(fn):
    """fn(session) on a fresh session: connecting is part of what `fab <task>` pays."""
    def run() -> None:
        s = session(path_of[0])
        try:
            fn(s)
        finally:
            s.close()
    return run


path_of: list[Path] = []  # the cluster file the with_session steps use (set per --nodes)


def ok(replies) -> None:
    bad = [r.error for r in replies if not r.ok]
    assert not bad, bad


def do_status(s) -> None:
    replies = lifecycle.status(s, health=True)
    ok(replies)
    report.status_text(replies)


def do_start(s) -> None:
    ok(lifecycle.start(s, ("trainer",)).replies)


def do_kill(s) -> None:
    replies = lifecycle.kill_all(s, grace=2)
    ok(replies)
    assert all(not r.value.left for r in replies)


def do_floor(s) -> None:
    ok(s.map(lambda t: t.run("true")))  # connect first, not timed below


def floor_only(path: Path) -> tuple[float, float]:
    s = session(path)
    do_floor(s)
    out = timed(lambda: ok(s.map(lambda t: t.run("true"))))
    s.close()
    return out


def workspaces(name: str) -> Path:
    return nodes.home(ACCOUNT) / ".fabtrain" / name


def agent_pids(name: str, names: list[str]) -> dict[str, int]:
    """node -> pid of its agent's Python (the child of the wrapper that agent.json names)."""
    wrappers = {}
    for node in names:
        jd = (workspaces(name) / node / "current").resolve()
        wrappers[json.loads((jd / "run" / "agent.json").read_text())["pid"]] = node
    found = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        st = stat(int(p))
        if st and st[1] in wrappers and b"fabtrain.node.agent" in Path(f"/proc/{p}/cmdline").read_bytes():
            found[wrappers[st[1]]] = int(p)
    return found


def wait_for_peers(name: str, first: str, count: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    health = workspaces(name) / first / "current" / "health.json"
    while time.time() < deadline:
        try:
            if len(json.loads(health.read_text()).get("peers") or {}) >= count:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the coordinator did not hear from all {count} agents within {timeout:g} s")


def coordinator_cost(name: str, names: list[str], window: float) -> str:
    pids = agent_pids(name, names)
    assert len(pids) == len(names), f"found {len(pids)} agents of {len(names)}"
    before = {n: stat(p)[2] for n, p in pids.items()}
    time.sleep(window)
    used = {n: stat(p)[2] - before[n] for n, p in pids.items()}
    coord = used[names[0]]
    others = statistics.median(used[n] for n in names[1:]) if len(names) > 1 else 0.0
    beats = len(names) * window / INTERVAL
    extra = max(coord - others, 0.0)
    return (f"coordinator's agent {100 * coord / window:.2f}% of a core, median other agent "
            f"{100 * others / window:.2f}%; coordinator ~{1000 * extra / beats:.2f} ms CPU per beat "
            f"({beats:.0f} beats in {window:g} s; CPU in 10 ms ticks)")


def collector_cost(path: Path, window: float) -> list[str]:
    from fabtrain.controller.streaming import StreamingCollector
    from fabtrain.dashboard import api
    s = session(path)
    c = StreamingCollector(s)
    first = timed(c.poll)
    polls = [timed(c.poll) for _ in range(5)]
    assert all(v.up for v in c.nodes.values()), [v.error for v in c.nodes.values() if not v.up]
    # What the two endpoints the page polls do, less Flask: snapshot, view, JSON.
    views = [timed(lambda: json.dumps(api.cluster_view(c.snapshot())))[0] for _ in range(20)]
    jobs = [timed(lambda: json.dumps(api.job_view(c.snapshot(), stale_after=30, ended={})))[0] for _ in range(20)]
    c.start(INTERVAL)
    c0, ages = cpu_now(), []
    for _ in range(int(window)):
        time.sleep(1)
        now = time.time()
        ages.append(max(now - (v.last_seen or 0) for v in c.nodes.values()))
    cpu = (cpu_now() - c0) / window
    c.stop()
    s.close()
    n = len(c.nodes)
    return [f"first poll (a channel per node) {first[0]:.2f} s, controller CPU {first[1]:.2f} s",
            f"one poll of all {n} nodes {spread([p[0] for p in polls], '{:.3f}')} s, "
            f"controller CPU {spread([p[1] for p in polls], '{:.3f}')} s = "
            f"{1000 * statistics.median(p[1] for p in polls) / n:.1f} ms a node",
            f"background, one poll a second: controller {100 * cpu:.1f}% of a core, "
            f"oldest node view {spread(ages, '{:.2f}')} s",
            f"/api/cluster built in {spread([1000 * v for v in views], '{:.1f}')} ms, "
            f"/api/job in {spread([1000 * v for v in jobs], '{:.1f}')} ms"]


def coordinator_model(peers: list[int], beats: int = 3000, trials: int = 5) -> list[str]:
    """The coordinator's work for one beat with `n` peers known, in-process (no sockets):
    check the frame's MAC and parse it, update the board, build the reply, seal it. Each
    beat carries what an agent's would: what changed since its last (protocol.beat_changes), in
    a training job the trainer's step rate every time and the roster version when the last reply
    brought a new one. `trials` rounds of `beats` beats: the median round is the figure (one round
    on this shared 2-core machine varied 0.036-0.084 ms a beat for the same code), the best
    and worst are shown. Then one failure: its beat, and the status line sealed for every peer."""
    from fabtrain.node.coordination.server import Coordinator
    from fabtrain.node.coordination.protocol import Channel, beat_changes
    lines = []
    for n in peers:
        names = [f"node{i}" for i in range(1, n + 1)]
        co = Coordinator("job", "127.0.0.1", 0, names, INTERVAL, 5.0, secret="s" * 32)
        pairs = {x: (Channel("s" * 32, "job", x, "a" * 32, "b" * 32, "agent"),
                     Channel("s" * 32, "job", x, "a" * 32, "b" * 32, "coordinator")) for x in names}
        known: dict = {}
        last: dict = {x: {} for x in names}  # what each agent sent last on its connection

        def beat(x: str, seq: int, **extra) -> bytes:
            # A training job: the trainer's step rate is new in every beat, so its procs always travel.
            procs = {"trainer-0": {"role": "trainer", "rank": 0, "state": "running", "exit_code": None,
                                   "rate": round(10 + seq % 7 / 3, 3)}}
            whole = {"op": "beat", "job_id": "job", "node": x, "seq": seq, "procs": procs, "done": False,
                     "failure": None, "final": None, "generation": 0, "trainers_expected": n,
                     "roster": known.get(x), **extra}
            frame = pairs[x][0].seal(beat_changes(whole, last[x]))[:-1]
            last[x] = whole
            return frame

        def answer(x: str, frame: bytes) -> tuple[int, bool]:  # what the coordinator's loop does with a frame
            reply, _, _, broadcast, body = co.take(pairs[x][1].open(frame))
            assert reply["op"] == "status", reply
            if isinstance(reply.get("roster"), dict):
                known[x] = {"epoch": reply["roster"]["epoch"], "at": reply["roster"]["at"]}
            return len(pairs[x][1].seal(reply, body)), broadcast
        for rnd in range(2):  # every peer known and told, as in a running job
            for x in names:
                answer(x, beat(x, 1 + rnd))
        order = (names * (beats // n + 1))[:beats]
        rounds, sizes = [], []
        for trial in range(trials):
            frames = [(x, beat(x, 3 + (trial * beats + i) // n)) for i, x in enumerate(order)]
            t0 = time.process_time()
            for x, frame in frames:
                sizes.append(answer(x, frame)[0])
            rounds.append((time.process_time() - t0) / beats)
        per = statistics.median(rounds)
        failing = names[n // 2]
        frame = beat(failing, 10**7, failure={"reason": "trainer-0 exited with code 1", "kind": "exit",
                                              "exit_code": 1, "generation": 0})
        t0 = time.perf_counter()
        _, broadcast = answer(failing, frame)
        board = co.board
        line = board.status_line() if hasattr(board, "status_line") else board.view()
        pushed = [len(pairs[x][1].seal(line)) for x in names if x != failing] if broadcast else []
        spread_s = time.perf_counter() - t0
        lines.append(f"{n:>5} peers: {1000 * per:7.3f} ms CPU per beat (median of {trials} rounds of {beats:,}; "
                     f"{1000 * min(rounds):.3f}-{1000 * max(rounds):.3f}), reply {statistics.median(sizes):>7,.0f} B "
                     f"(largest {max(sizes):,}); at one beat a node a second: {100 * per * n:6.1f}% of a core, "
                     f"{statistics.median(sizes) * n / 1e6:6.2f} MB/s out; a failure sealed for all {len(pushed)} "
                     f"others in {1000 * spread_s:.1f} ms ({statistics.median(pushed or [0]):,.0f} B each)")
    return lines


def standin_job(root: Path, sshd: SshdCluster, name: str, names: list[str]) -> Path:
    """The cluster file of the stand-in collective job on sshd nodes `names` (one `sleep 600`
    trainer each, watchdog on); the sessions of with_session use it from now on."""
    path = nodes.write_cluster(
        root / f"{name}.yaml", sshd, ACCOUNT, name=name, code=nodes.standin_project(root),
        roles=[(x, ["trainer"]) for x in names],
        job={"mode": "collective", "trainer": {"command": nodes.STANDIN},
             "watchdog": {"interval": INTERVAL, "port": nodes.free_port(sshd.nodes[0].address)}})
    path_of[:] = [path]
    return path


def measure(root: Path, sshd: SshdCluster, n: int, repeat: int, window: float) -> None:
    name = f"scale{n}"
    names = [x.name for x in sshd.nodes[:n]]
    path = standin_job(root, sshd, name, names)
    try:
        run_rows(path, name, names, repeat, window)
    finally:  # a failed run leaves no job behind
        s = session(path)
        lifecycle.kill_all(s, grace=1)
        s.close()
        nodes.remove_workspaces(ACCOUNT, name)


def run_rows(path: Path, name: str, names: list[str], repeat: int, window: float) -> None:
    n = len(names)
    first = timed(with_session(lambda s: ok(lifecycle.deploy(s))))
    again = timed(with_session(lambda s: ok(lifecycle.deploy(s))))
    print(f"\n== N={n} ({ACCOUNT.label}), parallel 64 ==")
    print(f"deploy: first {first[0]:.2f} s (CPU {first[1]:.2f} s), unchanged {again[0]:.2f} s (CPU {again[1]:.2f} s); "
          f"2 OpenSSH connections + 2 rsyncs a node", flush=True)
    rows: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("ssh", "floor", "status", "status@start", "start", "kill-all")}
    for i in range(repeat):  # interleaved
        rows["ssh"].append(timed(lambda: ssh_true(path)))
        rows["floor"].append(floor_only(path))
        rows["start"].append(timed(with_session(do_start)))
        rows["status@start"].append(timed(with_session(do_status)))
        wait_for_peers(name, names[0], n)
        rows["status"].append(timed(with_session(do_status)))
        if i == repeat - 1:
            print("coordinator:", coordinator_cost(name, names, window), flush=True)
            for line in collector_cost(path, window):
                print("collector:", line, flush=True)
        rows["kill-all"].append(timed(with_session(do_kill)))
    print(f"{'':<12} {'wall s':>17} {'/ ssh':>17} {'controller CPU s':>17} {'CPU ms a node':>14}")
    for k, v in rows.items():
        ratio = [w / s[0] for (w, _), s in zip(v, rows["ssh"])]
        print(f"{k:<12} {spread([w for w, _ in v]):>17} {spread(ratio):>17} {spread([c for _, c in v]):>17} "
              f"{1000 * statistics.median(c for _, c in v) / n:>14.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="16,64")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--window", type=float, default=10.0, help="seconds of each CPU window")
    ap.add_argument("--model-only", action="store_true", help="the in-process coordinator model only, no sshd")
    args = ap.parse_args()
    counts = [int(x) for x in args.nodes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="scale-"))
    os.environ["FABTRAIN_STATE_DIR"] = str(root / "state")
    print("coordinator model (in-process, one beat = handle() + the JSON reply):")
    for line in coordinator_model([16, 64, 256, 1000]):
        print(" ", line, flush=True)
    if args.model_only:
        return
    t0 = time.perf_counter()
    sshd = SshdCluster(root / "sshd", count=max(counts))
    print(f"{max(counts)} sshd nodes up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        nodes.ensure_bench_user(sshd.user_key)
        for n in counts:
            measure(root, sshd, n, args.repeat, args.window)
    finally:
        sshd.close()
        for n in counts:
            nodes.remove_workspaces(ACCOUNT, f"scale{n}")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
