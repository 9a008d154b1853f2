"""cluster.yaml's scheduler section and the batch script it renders, as data (no Slurm needed)."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import yaml

from fabtrain.config.cluster import parse_cluster
from fabtrain.errors import UserError
from fabtrain.node import allocation
from fabtrain.plan.plan import Network, make_plan
from fabtrain.slurm.script import PLAN_END, render
from tests.conftest import FAB, REPO

BASE = {"cluster": {"name": "lab", "workspace": "~/.fabtrain/lab"},
        "scheduler": {"kind": "slurm", "nodes": 3, "partition": "gpu", "time": "12:00:00", "gpus_per_node": 4},
        "job": {"mode": "collective", "trainer": {"command": "python train.py", "per_node": 2, "use_gpu": True}}}


def cluster(**scheduler):
    doc = json.loads(json.dumps(BASE))
    doc["scheduler"].update(scheduler)
    return parse_cluster(doc, "cluster.yaml")


def test_the_allocation_has_one_stand_in_node_per_slurm_node_on_the_shared_workspace():
    c = cluster()
    assert [n.name for n in c.nodes] == ["node0", "node1", "node2"]
    assert [n.workspace for n in c.nodes] == [f"~/.fabtrain/lab/node{i}" for i in range(3)]
    assert {n.host for n in c.nodes} == {"local"}
    assert cluster(login="login1").nodes[0].host == "login1"
    assert c.trainer_count == 6


@pytest.mark.parametrize("change, message", [
    ({"kind": "pbs"}, "scheduler.kind: must be one of slurm"),
    ({"nodes": 0}, "scheduler.nodes: must be between 1"),
    ({"nodes": "three"}, "scheduler.nodes: must be an integer"),
    ({"time": 720}, "scheduler.time: must be a string in quotes"),
    ({"time": "soon"}, "scheduler.time: 'soon' is not a Slurm time limit"),
    ({"partition": "gpu; rm -rf /"}, "scheduler.partition:"),
    ({"sbatch": "--qos=x"}, "scheduler.sbatch: must be a list"),
    ({"sbatch": ["-N 4"]}, "scheduler.sbatch[0]: must be one long sbatch option"),
    ({"sbatch": ["--nodes=4"]}, "scheduler.sbatch[0]: --nodes is set by fabtrain (use scheduler.nodes)"),
    ({"sbatch": ["--qos=a\nb"]}, "scheduler.sbatch[0]: must be one long sbatch option on one line"),
    ({"gpus": 2}, "scheduler.gpus: unknown field"),
    ({"login": "-oProxyCommand=x"}, "scheduler.login:"),
    ({"sbatch": ["--array=0-3"]}, "scheduler.sbatch[0]: --array is not possible with fabtrain (every array task "
                                  "would share one fabtrain job id, folder and secret)"),
    ({"sbatch": ["--het-job"]}, "scheduler.sbatch[0]: --het-job is not possible with fabtrain"),
    ({"sbatch": ["--gres=gpu:2"]}, "scheduler.sbatch[0]: --gres is not possible with fabtrain (use "
                                   "scheduler.gpus_per_node (with its type: a100:8))"),
    ({"sbatch": ["--requeue"]}, "scheduler.sbatch[0]: --requeue is set by fabtrain (use scheduler.requeue)"),
    ({"requeue": -1}, "scheduler.requeue: must be between 0 and 1000"),
    ({"continue_after_time_limit": True}, "scheduler.continue_after_time_limit: needs scheduler.requeue of 1 or "
                                          "more"),
    ({"gpus_per_node": "a100:x"}, "scheduler.gpus_per_node: 'a100:x' is not a GPU count or type:count"),
    ({"mem_per_node": "lots"}, "scheduler.mem_per_node: 'lots' is not a Slurm memory size"),
    ({"cpus_per_rank": 0}, "scheduler.cpus_per_rank: must be between 1 and 4096"),
    ({"exclusive": "yes"}, "scheduler.exclusive: must be true or false"),
])
def test_a_wrong_scheduler_field_is_one_line_naming_it(change, message):
    with pytest.raises(UserError) as e:
        cluster(**change)
    assert str(e.value).startswith(f"cluster.yaml: {message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_nodes_and_scheduler_together_are_refused():
    doc = {**BASE, "nodes": [{"name": "a", "host": "local", "roles": ["trainer"]}]}
    with pytest.raises(UserError, match="exactly one of 'nodes'"):
        parse_cluster(doc, "cluster.yaml")


def script_of(c, job_id="20261124-000000-abcd"):
    plan = make_plan(c, job_id, network=Network(ports={"master_port": 29500, "pserver_port": 7164,
                                                       "watchdog_port": 7180}))
    return plan, render(c, plan, ("trainer",), "/home/u")


def test_the_batch_script_asks_for_the_allocation_and_holds_no_secret():
    plan, script = script_of(cluster(sbatch=["--qos=normal"], account="mylab"))
    options = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert options == ["--job-name=fabtrain-lab", "--nodes=3", "--ntasks-per-node=1",
                       f"--output=/home/u/.fabtrain/lab/slurm/{plan.job_id}/slurm-%j.out", "--open-mode=append",
                       "--no-requeue", "--partition=gpu",
                       "--account=mylab", "--time=12:00:00", "--gpus-per-node=4", "--signal=B:USR1@120",
                       "--qos=normal"]
    template = json.loads(script.split(f"<<'{PLAN_END}'\n")[1].split(f"\n{PLAN_END}\n")[0])
    assert "secret" not in json.dumps(template)
    assert [n["job"]["node"] for n in template["nodes"]] == ["node0", "node1", "node2"]
    assert "srun --ntasks-per-node=1" in script and "-m fabtrain.node.allocation" in script


def test_resources_and_requeue_are_rendered_as_slurm_options():
    c = cluster(gpus_per_node="a100:4", cpus_per_rank=6, mem_per_node="64G", exclusive=True, requeue=3,
                continue_after_time_limit=True)
    assert c.trainer_count == 6  # the count of a typed GPU request sizes the plan as a bare count does
    plan, script = script_of(c)
    options = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert {"--requeue", "--gpus-per-node=a100:4", "--cpus-per-task=12", "--mem=64G", "--exclusive"} <= set(options)
    assert "--no-requeue" not in options
    template = json.loads(script.split(f"<<'{PLAN_END}'\n")[1].split(f"\n{PLAN_END}\n")[0])
    assert template["attempts"] == 4
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and "sleep 60" not in script
    assert 'scontrol requeue' not in script_of(cluster())[1]


def test_each_process_gets_its_ranks_share_of_the_cpus_slurm_bound_the_step_to():
    plan, script = script_of(cluster(cpus_per_rank=2))
    template = json.loads(script.split(f"<<'{PLAN_END}'\n")[1].split(f"\n{PLAN_END}\n")[0])
    hosts = [("gpu7", "10.0.0.7"), ("gpu8", "10.0.0.8"), ("gpu9", "10.0.0.9")]
    job, _ = allocation.node_part(template, 0, hosts, None, {}, cpus=[4, 5, 6, 7, 8])
    assert [p["env"]["FABTRAIN_CPUS"] for p in job["processes"]] == ["4,5", "6,7"]
    doc = json.loads(json.dumps(BASE))
    doc["scheduler"]["cpus_per_rank"] = 2
    doc["job"]["trainer"]["command"] = "torchrun train.py"  # one process of 2 ranks a node
    c = parse_cluster(doc, "cluster.yaml")
    plan, script = script_of(c)
    assert "#SBATCH --cpus-per-task=4" in script
    template = json.loads(script.split(f"<<'{PLAN_END}'\n")[1].split(f"\n{PLAN_END}\n")[0])
    job, _ = allocation.node_part(template, 0, hosts, None, {}, cpus=[0, 1, 2, 3])
    assert [p["env"]["FABTRAIN_CPUS"] for p in job["processes"]] == ["0,1,2,3"]


def test_launcher_mpirun_under_a_scheduler_is_refused_saying_why():
    doc = json.loads(json.dumps(BASE))
    doc["job"]["launcher"] = "mpirun"
    with pytest.raises(UserError) as e:
        parse_cluster(doc, "cluster.yaml")
    assert str(e.value).startswith("cluster.yaml: job.launcher: mpirun is not run inside a Slurm allocation: its "
                                   "ranks would start outside fabtrain's agents"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_requeued_attempt_starts_from_nothing_of_the_last_ones_end(tmp_path):
    from fabtrain.node import attempts
    jd, folder = tmp_path / "node0" / "jobs" / "J", tmp_path / "slurm"
    for sub in ("run", "metrics", "logs", "checkpoints"):
        (jd / sub).mkdir(parents=True)
    folder.mkdir()
    for name, text in (("events.jsonl", '{"kind": "job_failed", "reason": "x"}\n'), ("coordinator.json", "{}"),
                       ("killed", ""), ("run/trainer-0.exit", "143"), ("metrics/trainer-0.jsonl", "{}\n"),
                       ("logs/trainer-0.log", "step 5\n"), ("checkpoints/step", "5")):
        (jd / name).write_text(text)
    (folder / "slurm-7.out").write_text("slurmstepd-n1: error: *** JOB 7 ON n1 CANCELLED AT 2026-11-27T11:13:12 "
                                        "DUE TO PREEMPTION ***\n")
    assert attempts.begin(str(jd), "node0", 1, 4, "x") == (None, False)  # a first attempt: nothing touched
    assert (jd / "killed").exists()
    why = attempts.cause(str(folder), "7", 2)
    assert why == "requeued after preemption (preempted by Slurm)"
    said, refused = attempts.begin(str(jd), "node0", 2, 4, why)
    assert said == "attempt 2 of 4: requeued after preemption (preempted by Slurm)" and not refused
    assert sorted(p.name for p in jd.iterdir()) == ["attempts", "checkpoints", "events.jsonl", "logs"]
    assert (jd / "attempts" / "1" / "killed").exists() and (jd / "attempts" / "1" / "coordinator.json").exists()
    assert [json.loads(line)["kind"] for line in (jd / "events.jsonl").read_text().splitlines()] == ["attempt"]
    assert (jd / "checkpoints" / "step").read_text() == "5"
    assert "==== fabtrain: attempt 2 of 4" in (jd / "logs" / "trainer-0.log").read_text()
    (folder / "slurm-8.out").write_text(
        "srun: error: Node failure on n3\nslurmstepd-n1: error: *** JOB 8 ON n1 CANCELLED AT 2026-11-27T11:44:25 DUE TO "
        "NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***\n")
    assert attempts.cause(str(folder), "8", 2) == "requeued after node n3 failed (NODE_FAIL)"
    (folder / "requeue-cause-3").write_text("time limit\n")  # the batch shell requeued it itself
    assert attempts.cause(str(folder), "7", 3) == "requeued at the time limit"
    said, refused = attempts.begin(str(jd), "node0", 5, 4, "requeued by Slurm")
    assert refused
    failed = [json.loads(line) for line in (jd / "events.jsonl").read_text().splitlines()][-1]
    assert failed["kind"] == "job_failed" and "scheduler.requeue allows 4 attempts" in failed["reason"]
    job = {"processes": [{"name": "trainer-0"}]}
    attempts.restarts_before(job, 3)
    from fabtrain.node.spawn import prepare
    _, env, _ = prepare({"env": {}, "launch": ["true"], "cwd": str(tmp_path), **job["processes"][0]},
                        str(tmp_path), {}, generation=1)
    assert env["FABTRAIN_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "3"  # 2 attempts + 1 generation


def test_each_node_fills_in_the_allocation_its_addresses_and_gpus():
    plan, script = script_of(cluster())
    template = json.loads(script.split(f"<<'{PLAN_END}'\n")[1].split(f"\n{PLAN_END}\n")[0])
    hosts = [("gpu7", "10.0.0.7"), ("gpu8", "10.0.0.8"), ("gpu9", "10.0.0.9")]
    job, agent = allocation.node_part(template, 1, hosts, "s3cret", {"CUDA_VISIBLE_DEVICES": "4,5,6,7",
                                                                     "SLURM_JOB_ID": "42"})
    assert job["node"] == "node1" and job["watchdog"]["coordinator"] == {"host": "10.0.0.7", "port": 7180,
                                                                        "secret": "s3cret"}
    envs = [p["env"] for p in job["processes"]]
    assert [e["RANK"] for e in envs] == ["2", "3"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.7"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4", "5"]  # local ranks 0 and 1 of what Slurm granted
    assert job["slurm"] == {"job_id": "42", "node": "gpu8", "nodes": ["gpu7", "gpu8", "gpu9"]}
    assert "@slurm-node-" not in json.dumps([job, agent])


def test_fab_plan_prints_the_script_and_export_writes_it(tmp_path):
    doc = json.loads(json.dumps(BASE))
    doc["cluster"]["workspace"] = str(tmp_path / "ws")
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc))
    env = {**os.environ, "FABTRAIN_CLUSTER": str(tmp_path / "cluster.yaml"), "FABTRAIN_STATE_DIR": str(tmp_path)}
    out = subprocess.run([FAB, "plan"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/sh\n#SBATCH --job-name=fabtrain-lab\n")
    out = subprocess.run([FAB, "export", f"--slurm={tmp_path / 'job.sh'}"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "job.sh").read_text().startswith("#!/bin/sh\n#SBATCH --job-name=fabtrain-lab\n")
    doc["scheduler"]["time"] = 720
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc))
    out = subprocess.run([FAB, "plan"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"fab plan: {tmp_path / 'cluster.yaml'}: scheduler.time: must be a "
                                               'string in quotes, e.g. "12:00:00" (minutes, H:MM:SS or D-HH:MM:SS; '
                                               "YAML reads an unquoted 12:00:00 as a number) (line "
                                               f"{yaml.safe_dump(doc).splitlines().index('  time: 720') + 1})"]


def test_the_cluster_file_in_docs_slurm_md_is_valid_as_printed():
    text = (REPO / "docs" / "slurm.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    c = parse_cluster(yaml.safe_load(block), "docs/slurm.md")
    assert c.scheduler.nodes == 2 and c.scheduler.time == "12:00:00" and c.trainer_count == 16


def test_a_job_written_on_another_machine_is_read_from_its_agents_health_not_from_local_proc(tmp_path):
    from fabtrain.node import elsewhere, ops
    ws, job_id = tmp_path / "node1", "20261124-000000-abcd"
    jd = ws / "jobs" / job_id
    (jd / "run").mkdir(parents=True)
    job = {"job_id": job_id, "node": "node1", "machine": {"boot_id": "not-this-machine", "hostname": "gpu8"},
           "slurm": {"job_id": "42", "node": "gpu8", "nodes": ["gpu7", "gpu8"]},
           "processes": [{"name": "trainer-1"}, {"name": "trainer-2"}]}
    (jd / "job.json").write_text(json.dumps(job))
    # A run record whose pid is alive HERE (this test) must not be taken for the remote trainer.
    (jd / "run" / "trainer-1.json").write_text(json.dumps({"pid": os.getpid(), "create_time": 0}))
    health = {"ts": time.time(), "interval": 1.0,
              "processes": [{"name": "trainer-1", "state": "killed", "pid": 7, "exit_code": 137, "signal": "SIGKILL"}]}
    (jd / "health.json").write_text(json.dumps(health))
    reply = ops.op_status({"workspace": str(ws), "job_id": job_id})
    assert reply["slurm"]["job_id"] == "42"
    assert [(p["name"], p["state"], p.get("exit_code")) for p in reply["processes"]] == \
        [("trainer-1", "killed", 137), ("trainer-2", "not started", None)]
    assert not elsewhere.running_elsewhere(str(jd))
    health["processes"][0].update(state="running", exit_code=None)
    (jd / "health.json").write_text(json.dumps(health))
    assert elsewhere.running_elsewhere(str(jd))
    health["ts"] -= 3600  # an agent silent for an hour says nothing about now
    (jd / "health.json").write_text(json.dumps(health))
    assert not elsewhere.running_elsewhere(str(jd))
