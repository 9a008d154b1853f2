"""Stragglers: a trainer at half the others' step rate is named; a job whose ranks all slow together is not."""
import re
import time

from tests.support.local_job import FAKE
from tests.support.procscan import wait_for
from tests.support.sshd import free_port

WINDOW = 4


def start(local_job, command):
    job = local_job([("n0", ["trainer"]), ("n1", ["trainer"]), ("n2", ["trainer"])], mode="collective",
                    master_port="auto", trainer={"command": command},
                    watchdog={"interval": 0.5, "hang_timeout": 30, "port": free_port(["127.0.0.1"]),
                              "straggler": {"share": 0.7, "window": WINDOW}})
    job.fab("deploy", "start-trainers", check=True)
    return job


def test_a_trainer_at_half_the_rate_is_a_straggler_named_with_its_node_rate_and_the_median(local_job):
    job = start(local_job, f"{FAKE} --period 0.1 --slow trainer-1:2")
    assert wait_for(lambda: any(e["kind"] == "straggler" for e in job.events("n0")), timeout=WINDOW + 25), \
        job.events("n0")
    ev = next(e for e in job.events("n0") if e["kind"] == "straggler")
    assert ev["name"] == "trainer-1" and ev["origin"] == "n1" and ev["rank"] == 1, ev
    assert ev["rate"] < 0.7 * ev["median"] and 5 <= ev["median"] <= 11, ev
    assert [e["name"] for e in job.events("n0") if e["kind"] == "straggler"] == ["trainer-1"]
    # Still behind: the coordinator's agent says so in health.json, and fab status marks its row only.
    status = job.fab("status").stdout
    assert re.search(r"^n1\s+trainer-1\s+running\s.*STRAGGLER [0-9.]+ vs median [0-9.]+ steps/s", status, re.M), status
    assert status.count("STRAGGLER") == 1, status


def test_a_job_whose_ranks_all_slow_together_has_no_straggler(local_job):
    job = start(local_job, f"{FAKE} --period 0.1 --slow '*:3'")
    rates = lambda: [p.get("step_rate") for n in ("n0", "n1", "n2") for p in (job.health(n) or {}).get("processes", [])]
    assert wait_for(lambda: len(rates()) == 3 and all(rates()), timeout=20)  # every rate measured: compared
    assert max(rates()) < 4, rates()  # all three at a third of the 10 steps/s they could do
    time.sleep(WINDOW + 8)
    assert not [e for e in job.events("n0") if e["kind"] == "straggler"], job.events("n0")
    assert "STRAGGLER" not in job.fab("status").stdout
    assert any(e["kind"] == "agent_started" for e in job.events("n0"))
