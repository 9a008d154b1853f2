"""A hung torchrun job (gloo, CPU) on two local nodes, of a script that knows nothing of fabtrain (its steps come
from the launcher's progress hook): one rank spins forever while the others wait in their all_reduce. The hang
is caught by steps (torchrun's own monitor loop, which wakes every 0.1 s, is no
progress), every Python process of every rank dumps its own stack, and the rank the others wait for is named,
with its node, step and frame, in the events, `fab status` and health.json."""
import json
import re
import time

from tests.conftest import require_import
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port

HANG_TIMEOUT = 5
SPIN = 3  # the global rank that spins (node n1, local rank 1)


def records(job, node, name):
    try:
        return [json.loads(x) for x in (job.jd(node) / "metrics" / f"{name}.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def test_a_torchrun_rank_that_spins_is_caught_by_steps_and_named(local_job):
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    job = local_job([("n0", ["trainer"]), ("n1", ["trainer"])], mode="collective", master_port="auto",
                    trainer={"per_node": 2, "command": "torchrun --max-restarts=0 tests/programs/sync_ranks.py "
                                                       f"--spin {SPIN}:12 --width 32"},
                    watchdog={"interval": 0.5, "hang_timeout": HANG_TIMEOUT, "grace": 1, "startup_timeout": 300,
                              "port": free_port(["127.0.0.1"])})
    job.fab("deploy", "start-trainers", check=True)
    # Either node may see its ranks stop first (the others' last records may be older than the spinner's).
    hang = wait_for(lambda: min((e for n in ("n0", "n1") for e in job.events(n) if e["kind"] == "hang"),
                                key=lambda e: e["ts"], default=None), timeout=150, interval=0.2)
    assert hang, (job.events("n1"), (job.jd("n1") / "logs" / "trainer-1.log").read_text()[-3000:])
    # Caught by steps: within hang_timeout of the ranks' last new steps (the spinner's is the newest: the
    # others' come at most 0.5 s, the hook's pace, before it).
    spun = [r for r in records(job, "n1", "trainer-1") if r.get("rank") == SPIN]
    assert spun and spun[-1]["step"] == 12 and spun[-1]["source"] == "auto", spun[-3:]
    late = hang["ts"] - spun[-1]["ts"]
    assert HANG_TIMEOUT - 1 <= late < HANG_TIMEOUT + 3, late
    assert "new step" in hang["reason"], hang
    # Every rank's process on n1 dumped its own stack (its hang's, or its teardown's for n0's hang).
    said_n1 = wait_for(lambda: next((e for e in job.events("n1") if e["kind"] in ("hang", "teardown")
                                     and "stacks" in e), None), timeout=20)
    ranks = {r.get("rank"): r for r in said_n1["stacks"]["trainer-1"]["ranks"]}
    assert set(ranks) == {2, 3}, said_n1["stacks"]
    assert ranks[3]["frame"].endswith("in spin_forever") and "collective" not in ranks[3], ranks
    assert ranks[2]["collective"] == "all_reduce", ranks
    files = sorted((job.jd("n1") / "stacks").glob("trainer-1.*.txt"))
    dumped = [p.read_text() for p in files if p.stat().st_size]
    assert len(dumped) >= 3 and sum("rank 3" in t.splitlines()[0] for t in dumped) == 1, [t[:200] for t in dumped]
    if hang["node"] == "n1":  # the hung node names the rank among its own
        assert hang["blame"].startswith("rank 3 on n1 stopped stepping at step 12 in `sync_ranks.py:"), hang
    # The coordinator's node names it job-wide, with the ranks of the other node.
    said = wait_for(lambda: next((e for e in job.events("n0") if e["kind"] == "blame"), None), timeout=20)
    assert said, job.events("n0")
    assert re.fullmatch(r"rank 3 on n1 stopped stepping at step 12 in `sync_ranks\.py:\d+ in spin_forever`; "
                        r"ranks 0, 1, 2 wait in all_reduce", said["reason"]), said
    assert said["origin"] == "n1" and said["rank"] == 3 and said["step"] == 12, said
    # Gone within hang_timeout + 0.5 s of the hang being due (the dump waits for nobody that cannot answer).
    assert wait_for(lambda: not live_marked(job.ws.values()), timeout=15), "teardown too slow"
    out = job.fab("status")
    assert "rank 3 on n1 stopped stepping at step 12" in out.stdout and "ranks 0, 1, 2 wait in all_reduce" \
        in out.stdout, out.stdout
    assert time.time() - hang["ts"] < 60
