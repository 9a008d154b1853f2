"""The rank to blame when the others wait inside backward(): DDP's gradient all-reduce runs in its C++ reducer at
the end of ``loss.backward()``, with no Python frame of torch.distributed. Real hung DDP jobs (gloo, CPU, 3 ranks)
of a script that knows nothing of fabtrain (tests/programs/ddp_stuck.py: its steps come from the launcher's
progress hook), under torchrun and as one process per rank: rank 1 gets stuck after step 10 — spinning in its own
code before its forward, waiting for its DataLoader's worker, asleep opening a FIFO nobody writes, or gone on
to its next step past the loss's all_reduce that the others entered — and the hang's verdict names it with its
frame in the `blame` event, `fab status`, `fab watch`, the dashboard's sentence and the alert."""
import json
import os
import re
import sys

import pytest

from fabtrain.config.cluster import load_cluster
from fabtrain.controller.collector import Collector
from fabtrain.dashboard import create_app
from fabtrain.remote.session import Session
from tests.conftest import require_import
from tests.support.procscan import live_marked, wait_for
from tests.support.sshd import free_port

HANG_TIMEOUT = 4
STEP = 10  # rank 1 gets stuck after this step
TOKEN = "t0k3n-for-backward-blame-0123456789abcdef"
HOST = "127.0.0.1:8265"
# Where the stuck rank stands (its frame: `<file>:<line> in <function>`), and what the others wait in.
CASES = {
    "spin": (r"ddp_stuck\.py:\d+ in spin_forever", "backward"),
    "data": (r"dataloader\.py:\d+ in _try_get_data", "backward"),  # its main thread waits for its worker
    "fifo": (r"ddp_stuck\.py:\d+ in read_fifo", "backward"),
    "skip": (r"graph\.py:\d+ in _engine_run_backward", "all_reduce"),  # gone on: it waits where nobody else does
}


def start(local_job, tmp_path, how, torchrun):
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    fifo = tmp_path / "nobody-writes"
    os.mkfifo(fifo)
    args = f"tests/programs/ddp_stuck.py --stuck 1:{STEP}:{how} --fifo {fifo}" + \
        (" --workers 1" if how == "data" else "")
    command = f"torchrun --max-restarts=0 {args}" if torchrun else f"python {args}"
    alerts = tmp_path / "alerts.jsonl"
    record = f"import sys; open({str(alerts)!r}, 'a').write(sys.stdin.read() + '\\n')"
    notify = {"command": [sys.executable, "-c", record], "on": ["hang"]}  # each alert's JSON, a line
    job = local_job([("n0", ["trainer"])], mode="collective", master_port="auto",
                    trainer={"per_node": 3, "command": command},
                    watchdog={"interval": 0.5, "hang_timeout": HANG_TIMEOUT, "grace": 1, "startup_timeout": 300,
                              "port": free_port(["127.0.0.1"]), "notify": notify})
    job.fab("deploy", "start-trainers", check=True)
    return job, alerts


def views(job):
    """What the dashboard's /api/job says of the job."""
    session = Session(load_cluster(str(job.path)))
    try:
        collector = Collector(session, job_id=job.job_id)
        collector.poll()
        app = create_app({"COLLECTOR": collector, "DASHBOARD_TOKEN": TOKEN, "ALLOWED_HOSTS": [HOST], "TESTING": True})
        return app.test_client().get("/api/job", headers={"Authorization": f"Bearer {TOKEN}", "Host": HOST}).get_json()
    finally:
        session.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how, torchrun", [("spin", True), ("data", True), ("spin", False), ("fifo", False),
                                           ("skip", False)])
def test_the_rank_the_others_wait_for_in_backward_is_named_with_its_frame(local_job, tmp_path, how, torchrun):
    job, alerts = start(local_job, tmp_path, how, torchrun)
    frame, others = CASES[how]
    said = wait_for(lambda: next((e for e in job.events("n0") if e["kind"] == "blame"), None), timeout=150,
                    interval=0.2)
    log = "".join(p.read_text()[-2000:] for p in (job.jd("n0") / "logs").glob("*.log"))
    assert said, (job.events("n0"), log)
    hang = next(e for e in job.events("n0") if e["kind"] == "hang")
    # Every rank's stack: ranks 0 and 2 wait; rank 1, named by its frame, does not (skip: it waits elsewhere).
    ranks = {r["rank"]: r for name in sorted(hang["stacks"]) for r in hang["stacks"][name].get("ranks", [])}
    assert set(ranks) == {0, 1, 2}, hang["stacks"]
    assert ranks[0].get("collective") == ranks[2].get("collective") == others, ranks
    assert re.search(frame + "$", ranks[1]["frame"]), ranks
    assert ranks[1].get("collective") == ("backward" if how == "skip" else None), ranks
    # The verdict: the one rank the others wait for, its step and frame.
    if how == "skip":
        sentence = (rf"rank 1 on n0 stopped stepping at step {STEP} waiting in backward, where the others are not "
                    rf"\(`{frame}`\); ranks 0, 2 wait in all_reduce")
    else:
        sentence = rf"rank 1 on n0 stopped stepping at step {STEP} in `{frame}`; ranks 0, 2 wait in backward"
    assert re.fullmatch(sentence, said["reason"]), said
    assert said["rank"] == 1 and said["step"] == STEP and said["origin"] == "n0", said
    assert said["name"] == ("trainer-0" if torchrun else "trainer-1"), said
    assert re.search(frame + "$", said["frame"]), said
    assert re.fullmatch(sentence, hang["blame"]), hang  # the hung node's own word, at once
    assert wait_for(lambda: not live_marked(job.ws.values()), timeout=20), "teardown too slow"
    status = job.fab("status").stdout
    assert re.search(r"JOB FAILED: trainer-\d on n0 hung: .*; " + sentence + "; torn down", status), status
    watch = job.fab("watch", "--timeout", "10").stdout
    assert re.search(sentence, watch.splitlines()[-1]), watch
    # The alerts: the hung node's `hang` event and the coordinator's `blame`, both as notify's `hang`.

    def sent():
        return [json.loads(x) for x in alerts.read_text().splitlines()] if alerts.exists() else []
    assert wait_for(lambda: {"hang", "blame"} <= {a["event"]["kind"] for a in sent()}, timeout=10), sent()
    assert all(a["kind"] == "hang" and re.search(sentence, a["text"]) for a in sent()), sent()
    if how == "spin" and not torchrun:
        assert re.search(sentence, views(job)["sentence"])
