"""As many nodes as this machine holds: N `host: local` nodes of one collective job, held for a while.

The job of tests/local/test_scale_local.py (each node one trainer: a shell that writes a metrics
record and a log line every 5 s; watchdog interval 1 s), run for --hold seconds instead of 2
minutes. Prints, against a baseline measured in the same run (the same N trainers started bare,
`sh` by `sh`, with no launcher, agent or coordinator: until every one wrote its first record):

  start     `fab start-trainers` until it returns, and until every trainer's first record
  running   every 30 s: the load average, the agents' share of the cores, and every event on any
            node that says something was lost or failed (peer_lost, hang, teardown, ...): none
            expected; the coordinator's agent's peers
  status    `fab status` in the middle of the hold: wall and exit code
  kill-all  wall, exit code, and what is left of the job in /proc

    .venv/bin/python bench/local_nodes.py [--nodes 200] [--hold 600]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from tests.local.test_scale_local import FAILURE_KINDS, TRAINER  # noqa: E402
from tests.support.local_job import LocalJob  # noqa: E402
from tests.support.procscan import live_marked  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402


def bare_start(n: int, root: Path) -> float:
    """N copies of the trainer, started as plain processes: seconds until each wrote its first record."""
    script = TRAINER.replace("{{", "{").replace("}}", "}")[len("sh -c '"):-1]
    procs, files, t0 = [], [], time.monotonic()
    for i in range(n):
        f = root / f"bare-{i}.jsonl"
        files.append(f)
        procs.append(subprocess.Popen(["sh", "-c", script], env={**os.environ, "FABTRAIN_METRICS": str(f)},
                                      stdout=subprocess.DEVNULL, start_new_session=True))
    while not all(f.exists() and f.stat().st_size for f in files):
        time.sleep(0.05)
    took = time.monotonic() - t0
    for p in procs:
        os.killpg(p.pid, 9)
        p.wait()
    return took


def agents_share(window: float) -> float:
    """The agents' CPU over `window` s, as a share of one core."""
    def ticks():
        total = 0
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if b"fabtrain.node.agent" not in Path(f"/proc/{name}/cmdline").read_bytes():
                        continue
                    rest = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
                    total += int(rest[11]) + int(rest[12])
                except (OSError, IndexError):
                    pass
        return total
    a, t0 = ticks(), time.monotonic()
    time.sleep(window)
    return (ticks() - a) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--hold", type=float, default=600)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fabtrain-local-nodes-"))
    names = [f"l{i:03d}" for i in range(args.nodes)]
    code = root / "code"
    code.mkdir()
    (code / "README").write_text("bench/local_nodes.py's job code\n")
    job = LocalJob(root, [(n, ["trainer"]) for n in names],
                   {"code": str(code), "mode": "collective", "trainer": {"command": TRAINER},
                    "watchdog": {"interval": 1, "port": free_port(["127.0.0.1"])}})

    def failures():
        return [(n, e["kind"], e.get("reason", "")[:160]) for n in names for e in job.events(n)
                if e["kind"] in FAILURE_KINDS]

    try:
        bare = bare_start(args.nodes, root)
        print(f"{args.nodes} local nodes, interval 1 s; load average before {os.getloadavg()}", flush=True)
        print(f"baseline: {args.nodes} bare trainers started, every first record in {bare:.1f} s", flush=True)
        out = job.fab("deploy", timeout=900)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        t0 = time.monotonic()
        out = job.fab("start-trainers", timeout=900)
        start = time.monotonic() - t0
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        while not all((job.health(n) or {}).get("processes", [{}])[0].get("last_record") for n in names):
            time.sleep(1)
        first = time.monotonic() - t0
        print(f"start: fab start-trainers {start:.1f} s = {start / bare:.1f}x; every trainer's first record "
              f"as the agents saw it {first:.1f} s = {first / bare:.1f}x", flush=True)
        held_from, status = time.monotonic(), None
        while time.monotonic() - held_from < args.hold:
            share = agents_share(20)
            if status is None and time.monotonic() - held_from > args.hold / 2:
                t1 = time.monotonic()
                out = job.fab("status", timeout=900)
                status = time.monotonic() - t1
                print(f"status: fab status {status:.1f} s, exit {out.returncode}; {out.stdout.splitlines()[0]}",
                      flush=True)
            peers = len((job.health(names[0]) or {}).get("peers") or {})
            print(f"running {time.monotonic() - held_from:5.0f} s: load {os.getloadavg()[0]:.1f}, "
                  f"agents {100 * share:.0f}% of a core, coordinator's peers {peers}, failures {len(failures())}",
                  flush=True)
        lost = failures()  # before the kill, whose own events say it stopped everything
        t2 = time.monotonic()
        out = job.fab("kill-all", timeout=900)
        kill = time.monotonic() - t2
        left = live_marked(job.ws.values())
        print(f"kill-all: {kill:.1f} s, exit {out.returncode}, left in /proc: {len(left)}")
        print(f"failures from the start to the kill: {len(lost)} {lost[:5]}")
    finally:
        if live_marked(job.ws.values()):
            job.fab("kill-all", timeout=900)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
