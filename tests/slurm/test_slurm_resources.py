"""Resources on the real Slurm: GPUs as GRES on stand-in device files and two CPUs a node under task/affinity, so
what each rank runs on is Slurm's own binding; `fab check` asks the partition and the allocation's nodes."""
from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from tests.conftest import require
from tests.support.slurm_cluster import SlurmCluster, slurm_missing
from tests.support.slurm_job import SlurmJob


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = slurm_missing()
    require(not missing, "slurm-wlm and munge", f"apt-get could not install {' '.join(missing)}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), resources=True).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def job(slurm, tmp_path_factory):
    j = SlurmJob(tmp_path_factory.mktemp("project"), slurm)
    j.configure("python binding.py")
    j.fab("deploy", check=True)
    return j


def configure(job, command="python binding.py", python=None, **scheduler):
    job.configure(command, scheduler={"gpus_per_node": "fake:2", "cpus_per_rank": 1, **scheduler})
    doc = yaml.safe_load(job.path.read_text())
    doc["job"]["trainer"].update(per_node=2, use_gpu=True)
    if python:
        doc["cluster"]["python"] = python
    job.path.write_text(yaml.safe_dump(doc))


def test_each_rank_runs_on_the_gpu_and_cpu_slurm_bound_to_it(job):
    configure(job)
    job.submit()
    assert job.wait_state("COMPLETED", "FAILED", "CANCELLED") == "COMPLETED", job.describe()
    got = {}
    for i in range(3):
        for local in range(2):
            name = f"trainer-{2 * i + local}"
            got[name] = json.loads((job.node_ws(i) / f"binding-{name}.json").read_text())
    # Slurm granted GPUs 0,1 and CPUs 0,1 to each node's step: local rank K gets GPU K and CPU K.
    assert {name: (b["gpus"], b["cpus"]) for name, b in got.items()} == {
        f"trainer-{2 * i + local}": (str(local), [local]) for i in range(3) for local in range(2)}, got
    assert sorted({b["node"] for b in got.values()}) == ["n1", "n2", "n3"]


def test_fab_check_says_what_the_partition_cannot_give(job):
    configure(job, cpus_per_rank=2)  # 4 CPUs a node; the nodes have 2
    out = job.fab("check", timeout=300)
    assert out.returncode == 1, out.stdout
    assert "scheduler: the job asks each of 3 nodes for 4 CPUs (scheduler.cpus_per_rank x its processes), but " \
           "fewer nodes of partition debug have that: the job would stay PENDING" in out.stdout, out.stdout
    configure(job, gpus_per_node="a100:2")
    out = job.fab("check", timeout=300)
    assert out.returncode == 1 and "for 2 GPUs of type a100, but fewer nodes" in out.stdout, out.stdout


def test_fab_check_finds_an_interpreter_without_the_jobs_program_and_framework(job):
    configure(job, command="torchrun --standalone binding.py", python="/usr/bin/python3")
    out = job.fab("check", timeout=300)
    assert out.returncode == 1, out.stdout
    for node in ("n1", "n2", "n3"):
        assert f"torchrun is not on the PATH of /usr/bin/python3 on {node}: the job's start would fail there" \
            in out.stdout, out.stdout
        assert f"torch is not installed for /usr/bin/python3 on {node} (the command uses it)" in out.stdout, out.stdout
    configure(job, command="torchrun --standalone binding.py", python=sys.executable)
    out = job.fab("check", timeout=300)
    assert out.returncode == 0, out.stdout
    assert f"the workspace is shared: every node read a token written here, with {sys.executable} (python " \
        in out.stdout, out.stdout
    assert ", torch " in out.stdout, out.stdout
