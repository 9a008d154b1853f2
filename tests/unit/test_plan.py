"""The plan as data: who runs what, where, with which argv and environment."""
import subprocess

import pytest

from fabtrain.config.cluster import parse_cluster
from fabtrain.plan.plan import make_plan, render_shell, shell_word


def cluster(job, nodes=None, **extra):
    d = {"cluster": {"name": "t", "workspace": "/ws"},
         "nodes": nodes or [
             {"name": "a", "host": "10.0.0.1", "roles": ["pserver", "trainer"]},
             {"name": "b", "host": "10.0.0.2", "roles": ["pserver", "trainer"]},
             {"name": "c", "host": "10.0.0.3", "roles": ["trainer"], "workspace": "/other"}],
         "job": job, **extra}
    return parse_cluster(d, "t.yaml")


def procs(plan, role=None):
    return [(n.node, p) for n in plan.nodes for p in n.processes if role in (None, p.role)]


def test_pserver_mode_ranks_endpoints_and_paddle_v2_environment():
    plan = make_plan(cluster({"mode": "pserver", "trainer": {"per_node": 2},
                              "pserver": {"port": 7000, "ports_num": 2, "ports_num_for_sparse": 1}}), "J")
    trainers = procs(plan, "trainer")
    assert [(n, p.rank) for n, p in trainers] == [("a", 0), ("a", 1), ("b", 2), ("b", 3), ("c", 4), ("c", 5)]
    pservers = procs(plan, "pserver")
    assert [(n, p.rank, p.env["PADDLE_INIT_PORT"]) for n, p in pservers] == [("a", 0, "7000"), ("b", 1, "7000")]
    env = trainers[3][1].env
    assert env["PADDLE_INIT_TRAINER_ID"] == "3"
    assert env["PADDLE_INIT_PSERVERS"] == "10.0.0.1,10.0.0.2"
    assert env["PADDLE_INIT_NUM_GRADIENT_SERVERS"] == "6"
    assert env["PADDLE_INIT_PORTS_NUM"] == "2" and env["PADDLE_INIT_PORTS_NUM_FOR_SPARSE"] == "1"
    assert env["PADDLE_INIT_USE_GPU"] == "0" and env["PADDLE_INIT_TRAINER_COUNT"] == "1"
    assert env["TRAINING_ROLE"] == "TRAINER" and env["PADDLE_TRAINERS_NUM"] == "6"
    assert env["PADDLE_PSERVERS_IP_PORT_LIST"] == "10.0.0.1:7000,10.0.0.2:7000"
    assert env["POD_IP"] == "10.0.0.2"
    ps_env = pservers[1][1].env
    assert ps_env["TRAINING_ROLE"] == "PSERVER" and ps_env["PADDLE_PORT"] == "7000" and ps_env["POD_IP"] == "10.0.0.2"
    assert "PADDLE_INIT_TRAINER_ID" not in ps_env


def test_every_process_carries_the_job_marker_and_its_paths():
    plan = make_plan(cluster({"mode": "pserver"}), "J1")
    for node, p in procs(plan):
        assert p.env["FABTRAIN_JOB_ID"] == "J1" and p.env["FABTRAIN_NODE"] == node
        assert p.env["FABTRAIN_ROLE"] == p.role and p.env["FABTRAIN_RANK"] == str(p.rank)
        assert p.env["FABTRAIN_WORKSPACE"] == "$WS"
        assert p.env["FABTRAIN_SGD"] == "sync" and p.env["FABTRAIN_DATA_DIR"] == "$WS/data"
        assert p.log == f"$WS/jobs/J1/logs/{p.name}.log" and p.run == f"$WS/jobs/J1/run/{p.name}.json"
        assert p.env["FABTRAIN_METRICS"] == p.metrics == f"$WS/jobs/J1/metrics/{p.name}.jsonl"
        n = len(p.argv)
        assert p.launch_argv()[1:-n] == ["-I", "-S", "$WS/jobs/J1/launch.py", "--exit", p.exit, "--"]
        assert p.launch_argv()[-n:] == list(p.argv)


def test_paddle_commands_get_their_placeholders_filled():
    plan = make_plan(cluster({"mode": "pserver", "pserver": {
        "port": 7164, "command": "paddle pserver --port={port} --ports_num={ports_num} "
                                 "--ports_num_for_sparse={ports_num_for_sparse} --num_gradient_servers={num_gradient_servers}"},
        "trainer": {"command": "paddle train --trainer_id={trainer_id} --pservers={pservers} --port={port}"}}), "J")
    assert procs(plan, "pserver")[0][1].argv == ("paddle", "pserver", "--port=7164", "--ports_num=1",
                                                "--ports_num_for_sparse=1", "--num_gradient_servers=3")
    assert procs(plan, "trainer")[2][1].argv == ("paddle", "train", "--trainer_id=2",
                                                "--pservers=10.0.0.1,10.0.0.2", "--port=7164")


def test_collective_mode_gives_every_rank_torch_and_paddle_environment():
    nodes = [{"name": "a", "host": "10.0.0.1", "roles": ["trainer"]},
             {"name": "b", "host": "10.0.0.2", "roles": ["trainer"]}]
    plan = make_plan(cluster({"mode": "collective", "master_port": 29400, "trainer": {"per_node": 2, "command": "python train.py"}}, nodes), "J")
    ranks = procs(plan)
    assert [(n, p.rank, p.env["LOCAL_RANK"], p.env["NODE_RANK"]) for n, p in ranks] == [
        ("a", 0, "0", "0"), ("a", 1, "1", "0"), ("b", 2, "0", "1"), ("b", 3, "1", "1")]
    env = ranks[3][1].env
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
        ("10.0.0.1", "29400", "3", "4", "2")
    assert env["PADDLE_TRAINER_ID"] == "3" and env["PADDLE_TRAINERS_NUM"] == "4"
    assert env["PADDLE_TRAINER_ENDPOINTS"] == "10.0.0.1:29401,10.0.0.1:29402,10.0.0.2:29401,10.0.0.2:29402"
    assert env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:29402"
    assert env["PADDLE_MASTER"] == "10.0.0.1:29400" and env["PADDLE_DISTRI_BACKEND"] == "gloo"
    assert "PADDLE_INIT_PSERVERS" not in env


def test_torchrun_runs_once_per_node_with_multinode_flags_added():
    nodes = [{"name": "a", "host": "10.0.0.1", "roles": ["trainer"]},
             {"name": "b", "host": "10.0.0.2", "roles": ["trainer"]}]
    plan = make_plan(cluster({"mode": "collective", "trainer": {"per_node": 4, "command": "torchrun --max-restarts=0 train.py --lr 0.1"}}, nodes), "J")
    ranks = procs(plan)
    assert len(ranks) == 2
    assert ranks[1][1].argv == ("torchrun", "--nnodes=2", "--node-rank=1", "--nproc-per-node=4",
                                "--master-addr=10.0.0.1", "--master-port=29500", "--max-restarts=0",
                                "train.py", "--lr", "0.1")
    assert "RANK" not in ranks[1][1].env  # torchrun sets RANK per worker


def test_torchrun_flags_the_user_gave_are_kept():
    nodes = [{"name": "a", "host": "10.0.0.1", "roles": ["trainer"]}]
    cmd = "torchrun --nnodes={nnodes} --node_rank={node_rank} --nproc-per-node={nproc_per_node} --master-addr={master_addr} --master-port={master_port} t.py"
    plan = make_plan(cluster({"mode": "collective", "trainer": {"command": cmd}}, nodes), "J")
    assert procs(plan)[0][1].argv == ("torchrun", "--nnodes=1", "--node_rank=0", "--nproc-per-node=1",
                                      "--master-addr=10.0.0.1", "--master-port=29500", "t.py")


def test_trainer_zero_is_the_first_trainer_of_the_first_node_in_the_file():
    nodes = [{"name": "p", "host": "10.0.0.9", "roles": ["pserver"]},
             {"name": "z", "host": "10.0.0.5", "roles": ["trainer"]},
             {"name": "y", "host": "10.0.0.4", "roles": ["trainer"]}]
    plan = make_plan(cluster({"mode": "pserver"}, nodes), "J")
    assert [(n, p.rank) for n, p in procs(plan, "trainer")] == [("z", 0), ("y", 1)]


def test_a_value_with_metacharacters_stays_one_argument():
    plan = make_plan(cluster({"mode": "pserver", "trainer": {"command": "prog --msg 'a b; $(touch x) `id`' --pservers={pservers}"}}), "J")
    assert procs(plan, "trainer")[0][1].argv == ("prog", "--msg", "a b; $(touch x) `id`", "--pservers=10.0.0.1,10.0.0.2")


@pytest.mark.parametrize("value", ["plain", "a b", "it's", "$(touch /tmp/pwned)", "`id`", "x;y|z&", "$WS/logs/x.log", "a\nb", ""])
def test_shell_word_round_trips_through_sh(value):
    out = subprocess.run(["sh", "-c", f"WS=/w; printf '%s' {shell_word(value)}"], capture_output=True, text=True)
    assert out.stdout == value.replace("$WS", "/w")


def test_rendered_line_is_valid_shell():
    plan = make_plan(cluster({"mode": "pserver", "env": {"TRICKY": "a'b $(x)"}}), "J")
    for _, p in procs(plan):
        line = render_shell(p)
        assert subprocess.run(["sh", "-n", "-c", line]).returncode == 0
        assert "TRICKY='a'\"'\"'b $(x)'" in line


def test_job_json_holds_only_that_nodes_processes_and_the_launch_argv():
    plan = make_plan(cluster({"mode": "pserver"}), "J")
    j = plan.job_json("c")
    assert j["node"] == "c" and j["workspace"] == "/other" and j["node_index"] == 2
    assert [p["name"] for p in j["processes"]] == ["trainer-2"]
    assert j["processes"][0]["launch"][-len(j["processes"][0]["argv"]):] == j["processes"][0]["argv"]
    assert [n["name"] for n in j["nodes"]] == ["a", "b", "c"]
    assert j["watchdog"]["coordinator"] == {"host": "10.0.0.1", "port": 7180}


def test_nodes_that_share_an_address_get_distinct_endpoints_and_pserver_ports():
    # Two "nodes" on one machine (local nodes, or two sshd on one host): every
    # endpoint that shares an address must differ in port, or the ranks collide.
    nodes = [{"name": "n1", "host": "local", "workspace": "/ws1", "roles": ["pserver", "trainer"]},
             {"name": "n2", "host": "local", "workspace": "/ws2", "roles": ["pserver", "trainer"]}]
    trainers_only = [dict(n, roles=["trainer"]) for n in nodes]
    collective = make_plan(cluster({"mode": "collective", "master_port": 29500,
                                    "trainer": {"command": "python train.py"}}, trainers_only), "J")
    endpoints = collective.nodes[0].processes[0].env["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert endpoints == ["127.0.0.1:29501", "127.0.0.1:29502"]
    assert [p.env["PADDLE_CURRENT_ENDPOINT"] for _, p in procs(collective)] == endpoints

    ps = make_plan(cluster({"mode": "pserver", "pserver": {"port": 7000, "ports_num": 2, "ports_num_for_sparse": 1}},
                           nodes), "J")
    ports = [p.env["PADDLE_PORT"] for _, p in procs(ps, "pserver")]
    assert ports == ["7000", "7003"]  # each pserver's range (2 dense + 1 sparse ports) is its own
    assert ps.pserver_endpoints == ("127.0.0.1:7000", "127.0.0.1:7003")


def test_plan_offline_does_not_claim_an_auto_port_is_free_and_prints_the_agents_start():
    from fabtrain.controller import preflight, report
    cluster = parse_cluster({"cluster": {"name": "c"}, "job": {"mode": "collective", "master_port": "auto"},
                             "nodes": [{"name": "n0", "host": "local", "roles": ["trainer"]}]}, "x.yaml")
    plan = make_plan(cluster, "20261122-000000-ab12", network=preflight.choose_ports(cluster, {}))
    offline = report.plan_text(plan, [], asked=False)
    assert "free now" not in offline and "picked without asking the nodes" in offline
    assert "free now" in report.plan_text(plan, [], asked=True)
    agent = offline.split("# agent", 1)[1].splitlines()[1]
    assert agent.startswith('cd "$WS"/runtime/') and "--no-subreaper -- " in agent and "-m fabtrain.node.agent" in agent
@pytest.mark.parametrize("job", [
    {"mode": "pserver", "trainer": {"per_node": 2}, "pserver": {"per_node": 2}},
    {"mode": "collective", "trainer": {"per_node": 3}},
    {"mode": "collective", "trainer": {"per_node": 2, "command": "torchrun train.py"}},
], ids=["pserver", "collective", "torchrun"])
def test_every_process_gets_mpiruns_rank_variables_consistent_with_its_own(job):
    nodes = [{"name": n, "host": f"10.0.0.{i}", "roles": ["pserver", "trainer"] if job["mode"] == "pserver" else
              ["trainer"]} for i, n in enumerate("abc", 1)]
    plan = make_plan(cluster(job, nodes), "J")
    for role in ("pserver", "trainer"):
        ranks = procs(plan, role)
        for node, p in ranks:
            on_node = [q for m, q in ranks if m == node]
            mpi = {k: int(p.env[f"OMPI_COMM_WORLD_{k}"]) for k in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")}
            assert mpi == {"RANK": p.rank, "SIZE": len(ranks), "LOCAL_RANK": on_node.index(p),
                           "LOCAL_SIZE": len(on_node)}, (node, p.name)
            if "RANK" in p.env:  # torch's variables, where the plan sets them, say the same
                assert (p.env["RANK"], p.env["WORLD_SIZE"], p.env["LOCAL_RANK"]) == \
                    (p.env["OMPI_COMM_WORLD_RANK"], p.env["OMPI_COMM_WORLD_SIZE"], p.env["OMPI_COMM_WORLD_LOCAL_RANK"])
    assert procs(plan, "trainer")


def test_instrument_off_for_a_role_gives_its_processes_fabtrain_instrument_0():
    from fabtrain.contract import progress
    base = {"mode": "pserver", "pserver": {"command": "python ps.py"}, "trainer": {"command": "python t.py"}}
    on = make_plan(cluster(base), "20261122-014600-ab12")
    assert all(progress.ENV_INSTRUMENT not in p.env for _, p in procs(on))
    some = make_plan(cluster({**base, "watchdog": {"instrument": {"pserver": False}}}), "20261122-014600-ab12")
    assert {p.env.get(progress.ENV_INSTRUMENT) for _, p in procs(some, "pserver")} == {"0"}
    assert all(progress.ENV_INSTRUMENT not in p.env for _, p in procs(some, "trainer"))
    off = make_plan(cluster({**base, "watchdog": {"instrument": False}}), "20261122-014600-ab12")
    assert all(p.env[progress.ENV_INSTRUMENT] == "0" for _, p in procs(off))
    from fabtrain.node import progress as hook  # what the hook makes of it, in the program
    assert not hook.enabled({"FABTRAIN_METRICS": "/m", "FABTRAIN_INSTRUMENT": "0"})
    assert hook.enabled({"FABTRAIN_METRICS": "/m"}) and not hook.enabled({})


@pytest.mark.parametrize("value,said", [
    ("yes", "job.watchdog.instrument: must be true, false or a mapping of roles to true/false, got a string"),
    ({"trainer": "no"}, "job.watchdog.instrument.trainer: must be true or false"),
    ({"agent": False}, "job.watchdog.instrument.agent: unknown field"),
])
def test_a_wrong_instrument_is_one_line_naming_it(value, said):
    from fabtrain.errors import UserError
    with pytest.raises(UserError) as e:
        cluster({"mode": "collective", "trainer": {"command": "python t.py"}, "watchdog": {"instrument": value}})
    assert said in str(e.value)
