"""`job.launcher: mpirun` as data: what cluster.yaml may ask, and the plan it makes."""
import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.errors import UserError
from fabtrain.plan import mpirun
from fabtrain.plan.plan import make_plan


def cluster(job=None, nodes=None, ssh=None):
    nodes = nodes or [{"name": f"n{i}", "host": f"10.0.0.{i}", "roles": ["trainer"]} for i in (1, 2, 3)]
    return parse_cluster({"cluster": {"name": "t", "ssh": ssh or {}}, "nodes": nodes,
                          "job": {"mode": "collective", "launcher": "mpirun", **(job or {})}}, "t.yaml")


@pytest.mark.parametrize("job, nodes, needle", [
    ({"mode": "pserver"}, [{"name": "a", "host": "10.0.0.1", "roles": ["pserver", "trainer"]}], "job.launcher: mpirun"),
    ({"trainer": {"command": "torchrun train.py"}}, None, "without torchrun"),
    ({"watchdog": {"on_failure": "restart"}}, None, "job.watchdog.on_failure: restart is not possible"),
    ({}, [{"name": "a", "host": "local", "roles": ["trainer"]}], "nodes.a.host"),
    ({}, [{"name": "a", "host": "h1", "address": "10.0.0.1", "roles": ["trainer"]},
          {"name": "b", "host": "h2", "address": "10.0.0.1", "roles": ["trainer"]}], "same address as node 'a'"),
    ({"launcher": "srun"}, None, "job.launcher: must be one of fabtrain, mpirun"),
])
def test_what_mpirun_cannot_start_is_one_line_naming_the_field(job, nodes, needle):
    with pytest.raises(UserError) as e:
        cluster(job, nodes)
    assert needle in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("t.yaml: ")


def test_ranks_are_left_to_one_mpirun_on_the_first_trainer_node():
    plan = make_plan(cluster({"trainer": {"per_node": 2, "command": "./allreduce"}}), "J")
    first, *others = plan.nodes
    assert [p.name for p in first.processes] == ["mpirun-0", "trainer-0", "trainer-1"]
    assert all(not p.name.startswith("mpirun") for n in others for p in n.processes)
    ranks = [p for n in plan.nodes for p in n.processes if p.role == "trainer"]
    assert [p.rank for p in ranks] == list(range(6)) and {p.started_by for p in ranks} == {"mpirun-0"}
    launcher = first.processes[0]
    assert launcher.starts_with == "trainer" and launcher.role == "mpirun"
    argv = list(launcher.argv)
    assert argv[0] == "mpirun" and argv[argv.index("-np") + 1] == "6"
    assert argv[argv.index("plm_rsh_agent") + 1] == "ssh -F $WS/jobs/J/mpi/ssh_config"
    assert argv[argv.index("plm_rsh_no_tree_spawn") + 1] == "1"  # only the first node holds the ssh config
    assert argv[-3:] == ["~/.fabtrain/t/n1", "~/.fabtrain/t/n2", "~/.fabtrain/t/n3"]  # rank r's node: r // 2
    # mpirun gets the job marker, not a rank's place (it gives each rank its own).
    assert launcher.env["FABTRAIN_ROLE"] == "mpirun" and "OMPI_COMM_WORLD_RANK" not in launcher.env
    assert launcher.env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def test_job_json_of_the_first_node_carries_the_hostfile_and_the_clusters_ssh_settings():
    c = cluster({"trainer": {"per_node": 2}}, ssh={"user": "lab", "port": 2222, "known_hosts": "~/.ssh/lab_hosts",
                                                   "host_key_policy": "strict"})
    plan = make_plan(c, "J")
    files = plan.job_json("n1")["files"]
    assert files[mpirun.HOSTFILE] == "10.0.0.1 slots=2\n10.0.0.2 slots=2\n10.0.0.3 slots=2\n"
    config = files[mpirun.SSH_CONFIG]
    assert "StrictHostKeyChecking yes" in config and 'UserKnownHostsFile "~/.ssh/lab_hosts"' in config
    assert "BatchMode yes" in config and "Host 10.0.0.3\n    User lab\n    Port 2222" in config
    assert "files" not in plan.job_json("n2")
    ranks = plan.job_json("n2")["processes"]
    assert [p["started_by"] for p in ranks] == ["mpirun-0", "mpirun-0"]


def test_the_default_launcher_job_json_has_no_mpirun_fields():
    plan = make_plan(cluster({"launcher": "fabtrain"}), "J")
    for n in plan.nodes:
        job = plan.job_json(n.node)
        assert "files" not in job and all("started_by" not in p and "starts_with" not in p for p in job["processes"])
