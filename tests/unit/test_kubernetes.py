"""`fab export --k8s`: the job of cluster.yaml as Kubernetes manifests.

No cluster runs here: the manifests are checked as data (golden files), against
the real schemas of three Kubernetes versions (kubernetes-validate --strict),
through the Kubeflow training operator's own models, and the pod entrypoint
runs for real as local processes, one per pod, over the rendered job.json files.
Regenerate the golden files after a deliberate change with
FABTRAIN_UPDATE_GOLDEN=1 (then read the diff).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fabtrain.config.cluster import parse_cluster
from fabtrain.controller.kubeexport import manifest_text, render
from fabtrain.plan import kubernetes
from fabtrain.plan.plan import make_plan
from tests.conftest import require_import
from tests.support import REPO

GOLDEN = REPO / "tests" / "golden" / "k8s"
JOB_ID, SECRET = "20261124-000000-abcd", "00112233445566778899aabbccddeeff"
VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1123
IMAGE = "registry.example.com/lab/word2vec:1"

CASES = {
    "pserver": ("job", {"mode": "pserver", "image": IMAGE, "env": {"NCCL_DEBUG": "INFO"},
                        "trainer": {"per_node": 2, "use_gpu": True}},
                [{"name": "a", "host": "10.0.0.1", "roles": ["pserver", "trainer"], "gpus": 2},
                 {"name": "b", "host": "10.0.0.2", "roles": ["pserver", "trainer"], "gpus": 2}]),
    "collective": ("job", {"mode": "collective", "image": IMAGE, "master_port": "auto",
                           "trainer": {"command": "python train.py --epochs 3"}},
                   [{"name": f"n{i}", "host": f"10.0.0.{i}", "roles": ["trainer"]} for i in range(3)]),
    "pytorchjob": ("pytorchjob", {"mode": "collective", "image": IMAGE, "master_port": 23456,
                                  "trainer": {"per_node": 4, "use_gpu": True,
                                              "command": "torchrun --max-restarts=0 train.py"}},
                   [{"name": f"gpu{i}", "host": f"10.0.1.{i}", "roles": ["trainer"], "gpus": 4} for i in range(3)]),
}


def cluster_of(case, name="Vision_Lab"):
    _, job, nodes = CASES[case]
    return parse_cluster({"cluster": {"name": name}, "nodes": nodes, "job": job}, "cluster.yaml")


def docs_of(case, name="Vision_Lab"):
    return render(cluster_of(case, name), CASES[case][0], job_id=JOB_ID, secret=SECRET)


def file_name(i, doc):
    return f"{i:02d}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifests_match_the_golden_files(case):
    rendered = {file_name(i, d): manifest_text(d) for i, d in enumerate(docs_of(case))}
    folder = GOLDEN / case
    if os.environ.get("FABTRAIN_UPDATE_GOLDEN"):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.yaml"):
            old.unlink()
        for name, text in rendered.items():
            (folder / name).write_text(text)
    assert {p.name: p.read_text() for p in folder.glob("*.yaml")} == rendered


def validated(paths, version):
    out = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", version,
                          *map(str, paths)], capture_output=True, text=True, timeout=120)
    return out.returncode, (out.stdout + out.stderr).strip().splitlines()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_passes_the_strict_schemas_of_three_kubernetes_versions(case, tmp_path):
    require_import("kubernetes_validate", "kubernetes-validate", "installed by `make test` (requirements-test.txt)")
    import kubernetes_validate
    shipped = {p.name for p in (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema").iterdir()}
    paths = []
    for i, doc in enumerate(docs_of(case)):
        if doc["kind"] == "PyTorchJob":
            # No Kubernetes schema has this kind (a CRD): each replica's pod template is checked as a
            # PodTemplate, the whole object through the operator's models (the round-trip test).
            for rtype, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                doc = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"{doc['metadata']['name']}-{rtype.lower()}"}, "template": spec["template"]}
                paths.append(tmp_path / f"{i:02d}-{rtype}.yaml")
                paths[-1].write_text(manifest_text(doc))
        else:
            paths.append(tmp_path / file_name(i, doc))
            paths[-1].write_text(manifest_text(doc))
    for version in VERSIONS:
        assert f"v{version}-local-strict" in shipped, f"kubernetes-validate ships no strict schemas of {version}"
        code, lines = validated(paths, version)
        # A kind without a schema is only a warning to kubernetes-validate: here it is a failure.
        assert code == 0 and len(lines) == len(paths) and all(line.startswith("INFO ") and " passed " in line
                                                              for line in lines), "\n".join(lines)


def test_a_manifest_with_a_field_kubernetes_does_not_know_fails_validation(tmp_path):
    """The check above can fail: strict validation refuses an unknown field in a pod spec."""
    require_import("kubernetes_validate", "kubernetes-validate", "installed by `make test` (requirements-test.txt)")
    job = docs_of("collective")[-1]
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    (tmp_path / "job.yaml").write_text(manifest_text(job))
    code, lines = validated([tmp_path / "job.yaml"], VERSIONS[0])
    assert code != 0 and "restartPolicyy" in "\n".join(lines)


def test_pytorchjob_round_trips_unchanged_through_the_kubeflow_training_models():
    require_import("kubeflow.training", "kubeflow-training", "installed by `make test` (requirements-test.txt)")
    from kubeflow.training import ApiClient

    class Response:
        def __init__(self, doc):
            self.data = json.dumps(doc)

    doc = docs_of("pytorchjob")[-1]
    client = ApiClient()
    model = client.deserialize(Response(doc), "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(model) == doc
    replicas = model.spec.pytorch_replica_specs
    assert (replicas["Master"].replicas, replicas["Worker"].replicas) == (1, 2)
    assert replicas["Worker"].template.spec.containers[0].name == "pytorch"  # the operator's container name
    assert model.spec.run_policy.backoff_limit == 0


@pytest.mark.parametrize("name", ["Vision_Lab", "9" * 63, "a.b_c--d"])
def test_names_are_dns_labels_and_every_pod_is_reached_by_its_service_name(name):
    docs = docs_of("pserver", name)
    service = next(d for d in docs if d["kind"] == "Service")
    assert re.match(r"^[a-z]", service["metadata"]["name"])  # a Service name starts with a letter (RFC 1035)
    secret = next(d for d in docs if d["kind"] == "Secret")
    hostnames = set()
    for doc in docs:
        assert LABEL_RE.match(doc["metadata"]["name"]), doc["metadata"]["name"]
        assert all(LABEL_RE.match(v) for v in doc["metadata"]["labels"].values())
        if doc["kind"] == "Job":
            pod = doc["spec"]["template"]
            assert pod["spec"]["subdomain"] == service["metadata"]["name"]
            assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
            for index in range(doc["spec"]["completions"]):  # Kubernetes names an Indexed Job's pod <job>-<index>
                hostnames.add(f"{doc['metadata']['name']}-{index}")
                assert LABEL_RE.match(f"{doc['metadata']['name']}-{index}")
    known = {f"{h}.{service['metadata']['name']}" for h in hostnames}
    for part in secret["stringData"].values():
        job = json.loads(part)
        assert {n["address"] for n in job["nodes"]} == known
        assert job["watchdog"]["coordinator"]["host"] in known
        for p in job["processes"]:
            hosts = {p["env"].get("MASTER_ADDR", p["env"]["POD_IP"]), p["env"]["POD_IP"]} | \
                {e.rsplit(":", 1)[0] for e in p["env"]["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")}
            assert hosts <= known, p["name"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_pod_takes_its_part_of_the_plan_by_its_index(case):
    docs = docs_of(case)
    parts = {k: json.loads(v) for k, v in docs[0]["stringData"].items()}
    cluster = cluster_of(case)
    original = make_plan(cluster, JOB_ID, network=kubernetes.pod_network(cluster))
    ranks = {}
    for doc in docs[1:]:
        if doc["kind"] == "Job":
            role, count = doc["metadata"]["labels"]["fabtrain.io/role"], doc["spec"]["completions"]
            assert doc["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "JOB_COMPLETION_INDEX"
        elif doc["kind"] == "PyTorchJob":
            role, count = "trainer", sum(r["replicas"] for r in doc["spec"]["pytorchReplicaSpecs"].values())
        else:
            continue
        for index in range(count):
            part = parts.pop(f"{role}-{index}.json")
            assert part["node"] == f"{role}-{index}" and part["agent"]["cwd"] == kubernetes.RUNTIME
            ranks.setdefault(role, []).extend(p["rank"] for p in part["processes"])
    assert not parts
    for role, got in ranks.items():  # the same ranks, in the same order, as the job on its own nodes
        assert got == [p.rank for n in original.nodes for p in n.processes if p.role == role]


def test_gpus_become_nvidia_gpu_limits_on_trainer_pods_only():
    limits = {d["metadata"]["labels"]["fabtrain.io/role"]: d["spec"]["template"]["spec"]["containers"][0]
              .get("resources", {}).get("limits") for d in docs_of("pserver") if d["kind"] == "Job"}
    assert limits == {"pserver": None, "trainer": {"nvidia.com/gpu": "2"}}
    spec = docs_of("pytorchjob")[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert spec["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "4"}}


def write_cluster_file(path, job):
    path.write_text(yaml.safe_dump({"cluster": {"name": "lab"}, "job": job,
                                    "nodes": [{"name": "a", "host": "10.0.0.1", "roles": ["trainer"]}]}))
    return path


@pytest.mark.parametrize("job, args, needle", [
    ({"mode": "collective"}, (), "job.image: missing"),
    ({"mode": "pserver", "image": IMAGE}, ("--k8s-kind", "pytorchjob"), "needs collective mode"),
    ({"mode": "collective", "image": IMAGE}, ("--k8s-kind", "deployment"), "must be one of job, pytorchjob"),
    ({"mode": "collective", "image": "bad image"}, (), "job.image"),
    ({"mode": "collective", "image": IMAGE, "launcher": "mpirun"}, (), "job.launcher: mpirun is not exported"),
])
def test_what_the_export_cannot_render_is_one_line_and_exit_2(fab, tmp_path, job, args, needle):
    if "pserver" in job.values():
        write = {"cluster": {"name": "lab"}, "job": job,
                 "nodes": [{"name": "a", "host": "10.0.0.1", "roles": ["pserver", "trainer"]}]}
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(write))
    else:
        path = write_cluster_file(tmp_path / "c.yaml", job)
    out = fab("export", "--k8s", str(tmp_path / "out"), *args, cluster=path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()


def test_min_nodes_is_not_exported_to_kubernetes(fab, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "cluster": {"name": "lab"},
        "job": {"mode": "collective", "image": IMAGE, "watchdog": {"on_failure": "restart", "min_nodes": 1}},
        "nodes": [{"name": n, "host": f"10.0.0.{i + 1}", "roles": ["trainer"]} for i, n in enumerate("ab")]}))
    out = fab("export", "--k8s", str(tmp_path / "out"), cluster=path)
    assert out.returncode == 2 and "job.watchdog.min_nodes is not exported to Kubernetes" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_export_writes_one_private_file_per_object_and_refuses_a_folder_with_manifests(fab, tmp_path):
    path = write_cluster_file(tmp_path / "c.yaml", {"mode": "collective", "image": IMAGE})
    out = fab("export", "--k8s", str(tmp_path / "out"), cluster=path, check=True)
    files = sorted((tmp_path / "out").glob("*.yaml"))
    assert [f.name for f in files] == ["00-secret-lab-job.yaml", "01-service-lab.yaml", "02-job-lab-trainer.yaml"]
    assert out.stdout.split() == [str(f) for f in files]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)  # the Secret holds the coordinator's secret
    again = fab("export", "--k8s", str(tmp_path / "out"), cluster=path)
    assert again.returncode == 2 and "already holds manifests" in again.stderr


def test_the_example_of_docs_kubernetes_renders_as_the_doc_says():
    text = (REPO / "docs" / "kubernetes.md").read_text()
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    docs = render(parse_cluster(example, "cluster.yaml"))
    names = [file_name(i, d) for i, d in enumerate(docs)]
    assert names == ["00-secret-demo-job.yaml", "01-service-demo.yaml", "02-job-demo-trainer.yaml"]
    for command in ("fab export --k8s k8s/", "kubectl wait --for=condition=complete job/demo-trainer",
                    "-l fabtrain.io/cluster=demo"):
        assert command in text
    assert docs[-1]["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
