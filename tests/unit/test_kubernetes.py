"""`fab export --k8s`: the job of cluster.yaml as Kubernetes manifests.

No cluster runs here: the manifests are checked as data (golden files), against
the strict schemas of Kubernetes 1.29 and of the newest version
kubernetes-validate ships (`--strict`), the JobSet against its CRD's published
schema (tests/data/crds), the PyTorchJob through the Kubeflow training
operator's own models, and the pod entrypoint runs for real as local
processes, one per pod, over the rendered Secret (tests/local/test_kubernetes_pods.py).
Regenerate the golden files after a deliberate change with
FABTRAIN_UPDATE_GOLDEN=1: the golden test then rewrites the files that differ
and still fails, naming them; read the diff and run it again without it.
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
from fabtrain.errors import UserError
from fabtrain.contract import podpart
from fabtrain.plan import kubernetes
from fabtrain.plan.plan import make_plan
from tests.conftest import require_import
from tests.support import REPO

GOLDEN = REPO / "tests" / "golden" / "k8s"
CRDS = REPO / "tests" / "data" / "crds"
JOB_ID, SECRET = "20261124-000000-abcd", "00112233445566778899aabbccddeeff"
LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1123
IMAGE = "registry.example.com/lab/word2vec:1"
PLACED = {"namespace": "vision", "queue": "team-a", "priority_class": "training", "image_pull_secrets": ["regcred"],
          "node_selector": {"gpu-type": "a100", "kubernetes.io/arch": "amd64"},
          "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                          {"key": "spot", "value": "true", "effect": "NoExecute", "seconds": 300}],
          "ttl_after_finished": 3600, "run_as_user": 2000, "run_as_group": 3000,
          "volumes": {"data": {"claim": "corpus", "read_only": True}, "checkpoints": {"host_path": "/mnt/lab/ckpt"}},
          "trainer": {"cpu": 8, "memory": "64Gi", "gpus": 2, "gpu_resource": "amd.com/gpu", "shm": "16Gi"},
          "pserver": {"cpu": "500m", "memory": "4Gi"}}

CASES = {
    "pserver": ("job", {"mode": "pserver", "image": IMAGE, "env": {"NCCL_DEBUG": "INFO"},
                        "trainer": {"per_node": 2, "use_gpu": True}},
                [{"name": "a", "host": "10.0.0.1", "roles": ["pserver", "trainer"], "gpus": 2},
                 {"name": "b", "host": "10.0.0.2", "roles": ["pserver", "trainer"], "gpus": 2}], None),
    "collective": ("job", {"mode": "collective", "image": IMAGE, "master_port": "auto",
                           "trainer": {"command": "python train.py --epochs 3"}},
                   [{"name": f"n{i}", "host": f"10.0.0.{i}", "roles": ["trainer"]} for i in range(3)], None),
    "pytorchjob": ("pytorchjob", {"mode": "collective", "image": IMAGE, "master_port": 23456,
                                  "trainer": {"per_node": 4, "use_gpu": True,
                                              "command": "torchrun --max-restarts=0 train.py"}},
                   [{"name": f"gpu{i}", "host": f"10.0.1.{i}", "roles": ["trainer"], "gpus": 4} for i in range(3)],
                   None),
    "jobset": ("jobset", {"mode": "pserver", "image": IMAGE, "trainer": {"per_node": 2, "use_gpu": True},
                          "watchdog": {"on_failure": "restart", "max_restarts": 2}},
               [{"name": f"g{i}", "host": f"10.0.2.{i}", "roles": ["pserver", "trainer"], "gpus": 2} for i in range(3)],
               PLACED),
    # A trainer pod's /dev/shm from its memory limit: half of 3Gi.
    "sized": ("job", {"mode": "collective", "image": IMAGE, "trainer": {"command": "python train.py"}},
              [{"name": f"n{i}", "host": f"10.0.3.{i}", "roles": ["trainer"]} for i in range(2)],
              {"trainer": {"cpu": 2, "memory": "3Gi"}}),
    "placed": ("job", {"mode": "pserver", "image": IMAGE, "trainer": {"per_node": 2, "use_gpu": True},
                       "watchdog": {"on_failure": "restart", "max_restarts": 2}},
               [{"name": f"g{i}", "host": f"10.0.2.{i}", "roles": ["pserver", "trainer"], "gpus": 2} for i in range(3)],
               PLACED),
}


def cluster_of(case, name="Vision_Lab"):
    _, job, nodes, k8s = CASES[case]
    return parse_cluster({"cluster": {"name": name}, "nodes": nodes, "job": job}
                         | ({"kubernetes": k8s} if k8s else {}), "cluster.yaml")


def docs_of(case, name="Vision_Lab"):
    return render(cluster_of(case, name), CASES[case][0], job_id=JOB_ID, secret=SECRET)


def file_name(i, doc):
    return f"{i:02d}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifests_match_the_golden_files(case):
    rendered = {file_name(i, d): manifest_text(d) for i, d in enumerate(docs_of(case))}
    folder = GOLDEN / case
    golden = {p.name: p.read_text() for p in folder.glob("*.yaml")}  # read before anything may rewrite them
    if golden != rendered and os.environ.get("FABTRAIN_UPDATE_GOLDEN"):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.yaml"):
            old.unlink()
        for name, text in rendered.items():
            (folder / name).write_text(text)
        changed = sorted(n for n in golden.keys() | rendered.keys() if golden.get(n) != rendered.get(n))
        # Still a failure: the run that rewrites the files has compared nothing. Read the diff, then run again.
        pytest.fail(f"{folder.relative_to(REPO)}: rewrote {', '.join(changed)} from the code; read "
                    f"`git diff {folder.relative_to(REPO)}`, then run again without FABTRAIN_UPDATE_GOLDEN",
                    pytrace=False)
    assert golden == rendered


def validated(paths, version):
    out = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", version,
                          *map(str, paths)], capture_output=True, text=True, timeout=120)
    return out.returncode, (out.stdout + out.stderr).strip().splitlines()


def versions():
    """Kubernetes 1.29 (the oldest with backoffLimitPerIndex on by default) and the newest kubernetes-validate knows."""
    require_import("kubernetes_validate", "kubernetes-validate", "installed by `make test` (requirements-test.txt)")
    import kubernetes_validate
    shipped = [p.name[1:-len("-local-strict")] for p in
               (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema").iterdir()
               if p.name.endswith("-local-strict")]
    assert "1.29.0" in shipped, "kubernetes-validate ships no strict schemas of 1.29"
    return ["1.29.0", max(shipped, key=lambda v: tuple(map(int, v.split("."))))]


def as_pod_templates(i, doc):
    """A custom resource's pod templates as PodTemplates (Kubernetes' own schemas have no CRD kinds)."""
    if doc["kind"] == "PyTorchJob":
        templates = {r.lower(): spec["template"] for r, spec in doc["spec"]["pytorchReplicaSpecs"].items()}
    else:
        templates = {r["name"]: r["template"]["spec"]["template"] for r in doc["spec"]["replicatedJobs"]}
    return [(f"{i:02d}-{k}.yaml", {"apiVersion": "v1", "kind": "PodTemplate",
                                    "metadata": {"name": f"{doc['metadata']['name']}-{k}"}, "template": t})
            for k, t in templates.items()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_passes_the_strict_schemas_of_kubernetes_1_29_and_the_newest(case, tmp_path):
    paths = []
    for i, doc in enumerate(docs_of(case)):
        if doc["kind"] == "JobSet":  # its Jobs as Jobs, as the JobSet controller makes them
            for r in doc["spec"]["replicatedJobs"]:
                job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"x-{r['name']}"},
                       "spec": r["template"]["spec"]}
                paths.append(tmp_path / f"{i:02d}-{r['name']}.yaml")
                paths[-1].write_text(manifest_text(job))
        for name, d in (as_pod_templates(i, doc) if doc["kind"] in ("PyTorchJob", "JobSet") else [(file_name(i, doc), doc)]):
            paths.append(tmp_path / name)
            paths[-1].write_text(manifest_text(d))
    for version in versions():
        code, lines = validated(paths, version)
        # A kind without a schema is only a warning to kubernetes-validate: here it is a failure.
        assert code == 0 and len(lines) == len(paths) and all(line.startswith("INFO ") and " passed " in line
                                                              for line in lines), "\n".join(lines)


def test_a_manifest_with_a_field_kubernetes_does_not_know_fails_validation(tmp_path):
    """The check above can fail: strict validation refuses an unknown field in a pod spec, and 1.29 a field
    that came later."""
    job = docs_of("collective")[-1]
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    (tmp_path / "job.yaml").write_text(manifest_text(job))
    code, lines = validated([tmp_path / "job.yaml"], versions()[0])
    assert code != 0 and "restartPolicyy" in "\n".join(lines)
    job = docs_of("collective")[-1]
    job["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"  # batch/v1 Job field since 1.30
    (tmp_path / "job.yaml").write_text(manifest_text(job))
    code, lines = validated([tmp_path / "job.yaml"], versions()[0])
    assert code != 0 and "managedBy" in "\n".join(lines)


def strict(schema):
    """The CRD's schema as the API server with strict field validation reads it: no field it does not name."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("enum", "required", "default", "example") else v for k, v in schema.items()
           if not k.startswith("x-kubernetes-")}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def jobset_errors(doc):
    require_import("jsonschema", "jsonschema", "installed by `make test` (requirements-test.txt)")
    import jsonschema
    schema = strict(json.loads((CRDS / "jobset-v1alpha2.json").read_text())["openAPIV3Schema"])
    # The API server fills in metadata; the CRD's schema says only `type: object` of it.
    validator = jsonschema.Draft7Validator(schema)
    return sorted(".".join(map(str, e.absolute_path)) + ": " + e.message for e in validator.iter_errors(doc))


def test_the_jobset_passes_its_crds_published_schema_and_a_wrong_one_does_not():
    jobset = next(d for d in docs_of("jobset") if d["kind"] == "JobSet")
    assert jobset_errors(jobset) == []
    jobset["spec"]["failurePolicy"]["maxRestartz"] = 1
    jobset["spec"]["failurePolicy"]["rules"][0]["action"] = "Retry"
    errors = jobset_errors(jobset)
    assert len(errors) == 2 and any("maxRestartz" in e for e in errors) and any("'Retry'" in e for e in errors), errors


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


def spec_and_secret(docs):
    secret = next(d for d in docs if d["kind"] == "Secret")["stringData"]
    return json.loads(secret["job.json"]), secret.get("secret")


def every_part(docs):
    """{pod name: job.json} as each pod makes it from the Secret and its index."""
    spec, secret = spec_and_secret(docs)
    return {f"{role}-{j}": podpart.part(spec, role, j, secret)
            for role, pods in spec["pods"].items() for j in range(pods["count"])}


@pytest.mark.parametrize("name", ["Vision_Lab", "9" * 63, "a.b_c--d"])
def test_names_are_dns_labels_and_every_pod_is_reached_by_its_service_name(name):
    docs = docs_of("pserver", name)
    service = next(d for d in docs if d["kind"] == "Service")
    assert re.match(r"^[a-z]", service["metadata"]["name"])  # a Service name starts with a letter (RFC 1035)
    hostnames = set()
    for doc in docs:
        assert LABEL_RE.match(doc["metadata"]["name"]) and JOB_ID in doc["metadata"]["name"], doc["metadata"]["name"]
        assert all(LABEL_RE.match(v) for v in doc["metadata"]["labels"].values())
        if doc["kind"] == "Job":
            pod = doc["spec"]["template"]
            assert pod["spec"]["subdomain"] == service["metadata"]["name"]
            assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
            for index in range(doc["spec"]["completions"]):  # Kubernetes names an Indexed Job's pod <job>-<index>
                hostnames.add(f"{doc['metadata']['name']}-{index}")
                assert LABEL_RE.match(f"{doc['metadata']['name']}-{index}")
    known = {f"{h}.{service['metadata']['name']}" for h in hostnames}
    for job in every_part(docs).values():
        assert {n["address"] for n in job["nodes"]} == known
        assert job["watchdog"]["coordinator"]["host"] in known
        for p in job["processes"]:
            hosts = {p["env"].get("MASTER_ADDR", p["env"]["POD_IP"]), p["env"]["POD_IP"]} | \
                {e.rsplit(":", 1)[0] for e in p["env"]["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")}
            assert hosts <= known, p["name"]


def test_a_jobsets_pods_are_reached_by_the_names_jobset_gives_them():
    jobset = next(d for d in docs_of("jobset") if d["kind"] == "JobSet")
    name, network = jobset["metadata"]["name"], jobset["spec"]["network"]
    assert network == {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True}
    # JobSet names a pod <jobset>-<replicated job>-<job index>-<pod index>, under the subdomain's Service.
    known = {f"{name}-{r['name']}-0-{i}.{name}" for r in jobset["spec"]["replicatedJobs"]
             for i in range(r["template"]["spec"]["completions"])}
    parts = every_part(docs_of("jobset"))
    assert {n["address"] for n in parts["trainer-2"]["nodes"]} == known
    assert parts["trainer-0"]["watchdog"]["coordinator"]["host"] == f"{name}-pserver-0-0.{name}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_pod_makes_exactly_its_part_of_the_plan_from_the_one_job_spec(case):
    docs = docs_of(case)
    cluster = cluster_of(case)
    kind = CASES[case][0]
    pods = kubernetes.pod_cluster(cluster, JOB_ID, kind)
    plan = make_plan(pods, JOB_ID, secret=SECRET, network=kubernetes.pod_network(pods))
    parts = every_part(docs)
    assert parts == {n.node: kubernetes.pod_job_json(plan, n.node) for n in plan.nodes}
    original = make_plan(cluster, JOB_ID, network=kubernetes.pod_network(cluster))
    for role in {p["processes"][0]["role"] for p in parts.values()}:
        # The same ranks, in the same order, as the job on its own nodes.
        got = [p["rank"] for name, part in parts.items() if name.startswith(role) for p in part["processes"]]
        assert got == [p.rank for n in original.nodes for p in n.processes if p.role == role]
    for doc in docs:
        for template in [doc["spec"]["template"]] if doc["kind"] == "Job" else []:
            assert template["spec"]["containers"][0]["command"][-1] == "JOB_COMPLETION_INDEX"


def pods_cluster(count, mode="collective"):
    roles = ["pserver", "trainer"] if mode == "pserver" else ["trainer"]
    return parse_cluster({"cluster": {"name": "lab"}, "job": {"mode": mode, "image": IMAGE,
                                                              "trainer": {"per_node": 2, "use_gpu": True}},
                          "nodes": [{"name": f"n{i}", "host": f"10.{i // 250}.{i % 250}.1", "roles": roles, "gpus": 2}
                                    for i in range(count)]}, "cluster.yaml")


@pytest.mark.timeout(120)
def test_the_manifests_of_1000_pods_are_the_size_of_those_of_4():
    """One job spec, one template a role: only the numbers grow a digit or so (WORLD_SIZE 2000 for 8, ...)."""
    docs = {n: render(pods_cluster(n), job_id=JOB_ID, secret=SECRET) for n in (4, 1000)}
    # The same three objects either way (the Secret, the Service, the trainers' Indexed Job), the Job of 1,000 pods.
    kinds = {n: [(d["kind"], d["metadata"]["name"]) for d in docs[n]] for n in docs}
    assert kinds[4] == kinds[1000] and [k for k, _ in kinds[1000]] == ["Secret", "Service", "Job"], kinds
    assert [d["spec"]["completions"] for d in docs[4] + docs[1000] if d["kind"] == "Job"] == [4, 1000]
    assert json.loads(docs[1000][0]["stringData"]["job.json"])["pods"]["trainer"]["count"] == 1000
    size = {n: [len(manifest_text(d)) for d in docs[n]] for n in docs}
    assert len(size[4]) == len(size[1000]) == 3, size
    assert all(0 <= big - small < 256 for small, big in zip(size[4], size[1000])), size
    assert sum(size[1000]) < 50_000  # a Secret holds 1 MiB


def test_a_pods_index_out_of_its_role_is_one_line_and_exit_2(tmp_path):
    files = tmp_path / "etc"
    files.mkdir()
    spec, secret = spec_and_secret(docs_of("collective"))
    (files / "job.json").write_text(json.dumps(spec))
    out = subprocess.run([sys.executable, "-m", "fabtrain.node.pod", str(files), "trainer", "--index-env", "I"],
                         env={**os.environ, "I": "3"}, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and out.stderr.strip() == \
        f"fabtrain pod: the job spec in {files} gives no part to trainer pod 3: pod index 3: the job has 3 trainer pods"


def test_every_object_carries_the_job_id_so_two_exports_never_collide():
    first, second = render(cluster_of("collective"), job_id=JOB_ID), render(cluster_of("collective"))
    names = lambda docs: {(d["kind"], d["metadata"]["name"]) for d in docs}  # noqa: E731
    assert not names(first) & names(second)
    for doc in first:
        assert doc["metadata"]["labels"]["fabtrain.io/job-id"] == JOB_ID
        for template in [doc["spec"]["template"]] if doc["kind"] == "Job" else []:
            assert template["metadata"]["labels"]["fabtrain.io/job-id"] == JOB_ID
    service = first[1]
    assert service["spec"]["selector"] == {"fabtrain.io/job-id": JOB_ID}  # never another export's pods


def failure_policy(job):
    return job["spec"]["backoffLimitPerIndex"], job["spec"]["podFailurePolicy"]["rules"]


@pytest.mark.parametrize("watchdog, tries", [({}, 0), ({"on_failure": "restart", "max_restarts": 5}, 5),
                                             ({"on_failure": "restart", "enabled": False}, 0),
                                             ({"on_failure": "keep"}, 0)])
def test_a_disruption_is_not_a_failure_and_restarts_are_bounded_by_on_failure(watchdog, tries):
    cluster = parse_cluster({"cluster": {"name": "lab"}, "job": {"mode": "collective", "image": IMAGE,
                                                                 "watchdog": watchdog},
                             "nodes": [{"name": "a", "host": "10.0.0.1", "roles": ["trainer"]}]}, "c.yaml")
    job = render(cluster)[-1]
    limit, rules = failure_policy(job)
    assert limit == tries and job["spec"]["maxFailedIndexes"] == 0
    # An eviction, a drain, a preemption: the pod starts again and counts for nothing.
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    # The agents' verdict (exit 1, after on_failure's restarts in place): the Job fails, no second round.
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [1]
    jobset = render(cluster, "jobset")[-1]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == tries


def test_placement_resources_volumes_and_a_non_root_user_come_from_the_kubernetes_section():
    docs = docs_of("placed")
    assert {d["metadata"].get("namespace") for d in docs} == {"vision"}
    trainer = next(d for d in docs if d.get("kind") == "Job" and d["metadata"]["labels"]["fabtrain.io/role"] == "trainer")
    assert trainer["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and trainer["spec"]["suspend"]
    assert trainer["spec"]["ttlSecondsAfterFinished"] == 3600
    pod = trainer["spec"]["template"]["spec"]
    box = pod["containers"][0]
    assert box["resources"]["limits"] == box["resources"]["requests"] == {"cpu": "8", "memory": "64Gi",
                                                                          "amd.com/gpu": "2"}
    assert pod["nodeSelector"] == {"gpu-type": "a100", "kubernetes.io/arch": "amd64"}
    assert pod["tolerations"][1] == {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
                                     "tolerationSeconds": 300}
    assert pod["priorityClassName"] == "training" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in box["volumeMounts"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"} and mounts["shm"]["mountPath"] == "/dev/shm"
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "corpus", "readOnly": True}
    assert volumes["checkpoints"]["hostPath"]["path"] == "/mnt/lab/ckpt"
    # Mounted where the plan points the processes: FABTRAIN_DATA_DIR and FABTRAIN_CHECKPOINT_DIR.
    env = every_part(docs)["trainer-1"]["processes"][0]["env"]
    ws = kubernetes.WORKSPACE
    assert mounts["data"]["mountPath"] == env["FABTRAIN_DATA_DIR"].replace("$WS", ws)
    assert mounts["checkpoints"]["mountPath"] == env["FABTRAIN_CHECKPOINT_DIR"].replace("$WS", ws)
    # The Secret readable by the pod's (non-root) user through its group, by no one else.
    security = pod["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == 2000 and security["fsGroup"] == security["runAsGroup"] == 3000
    assert volumes["job"]["secret"]["defaultMode"] == 0o440
    assert box["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    pserver = next(d for d in docs if d.get("kind") == "Job" and d["metadata"]["labels"]["fabtrain.io/role"] == "pserver")
    box = pserver["spec"]["template"]["spec"]["containers"][0]
    assert box["resources"]["requests"] == {"cpu": "500m", "memory": "4Gi"}
    assert "shm" not in {m["name"] for m in box["volumeMounts"]}


def shm_of(template):
    """A pod template's /dev/shm: the sizeLimit of the memory emptyDir mounted there, None if none is."""
    spec = template["spec"]
    mounted = [m["name"] for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    if not mounted:
        return None
    (volume,) = [v for v in spec["volumes"] if v["name"] in mounted]
    assert volume["emptyDir"]["medium"] == "Memory", volume
    return volume["emptyDir"]["sizeLimit"]


def role_templates(docs):
    """{role: pod template} of every kind: the Indexed Jobs', the JobSet's, the PyTorchJob's."""
    out = {}
    for d in docs:
        if d["kind"] == "Job":
            out[d["metadata"]["labels"]["fabtrain.io/role"]] = d["spec"]["template"]
        elif d["kind"] == "JobSet":
            out |= {r["name"]: r["template"]["spec"]["template"] for r in d["spec"]["replicatedJobs"]}
        elif d["kind"] == "PyTorchJob":
            out |= {r.lower(): s["template"] for r, s in d["spec"]["pytorchReplicaSpecs"].items()}
    return out


@pytest.mark.parametrize("trainer, size", [
    ({}, "8Gi"),  # no memory limit: the stated default
    ({"memory": "64Gi"}, "32Gi"), ({"memory": "3Gi"}, "1536Mi"), ({"memory": "3G"}, "1500M"),
    ({"memory": "1001"}, "500"),  # half of the pod's memory limit, in whole bytes
    ({"memory": "64Gi", "shm": "4Gi"}, "4Gi"), ({"shm": "20Gi"}, "20Gi"),  # as given
    ({"memory": "64Gi", "shm": 0}, None), ({"shm": "0"}, None), ({"shm": "0Gi"}, None),  # none
])
@pytest.mark.parametrize("kind", kubernetes.KINDS)
def test_a_trainer_pod_has_dev_shm_of_half_its_memory_limit_by_default_and_shm_0_turns_it_off(kind, trainer, size):
    mode = "collective" if kind == "pytorchjob" else "pserver"
    roles = ["trainer"] if mode == "collective" else ["pserver", "trainer"]
    cluster = parse_cluster({"cluster": {"name": "lab"}, "job": {"mode": mode, "image": IMAGE},
                             "kubernetes": {"trainer": trainer, "pserver": {"memory": "4Gi"}},
                             "nodes": [{"name": "a", "host": "10.0.0.1", "roles": roles},
                                       {"name": "b", "host": "10.0.0.2", "roles": roles}]}, "c.yaml")
    templates = role_templates(render(cluster, kind, job_id=JOB_ID))
    expected = {"trainer": size} if kind != "pytorchjob" else {"master": size, "worker": size}
    if mode == "pserver":
        expected["pserver"] = None  # a parameter server runs no DataLoader workers nor NCCL: none unless given
    assert {role: shm_of(t) for role, t in templates.items()} == expected


def test_a_pserver_pod_has_dev_shm_only_when_its_shm_is_given():
    cluster = parse_cluster({"cluster": {"name": "lab"}, "job": {"mode": "pserver", "image": IMAGE},
                             "kubernetes": {"pserver": {"memory": "4Gi", "shm": "1Gi"}},
                             "nodes": [{"name": "a", "host": "10.0.0.1", "roles": ["pserver", "trainer"]}]}, "c.yaml")
    assert {r: shm_of(t) for r, t in role_templates(render(cluster, job_id=JOB_ID)).items()} == \
        {"pserver": "1Gi", "trainer": "8Gi"}


def test_gpus_are_asked_for_on_trainer_pods_only():
    limits = {d["metadata"]["labels"]["fabtrain.io/role"]: d["spec"]["template"]["spec"]["containers"][0]
              .get("resources", {}).get("limits") for d in docs_of("pserver") if d["kind"] == "Job"}
    assert limits == {"pserver": None, "trainer": {"nvidia.com/gpu": "2"}}
    spec = docs_of("pytorchjob")[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}


def test_the_jobset_is_one_gang_with_kueues_label():
    jobset = docs_of("jobset")[-1]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert [r["name"] for r in jobset["spec"]["replicatedJobs"]] == ["pserver", "trainer"]
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and jobset["spec"]["suspend"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 2
    for r in jobset["spec"]["replicatedJobs"]:  # Kueue reads the label on the JobSet, not on its Jobs
        assert "kueue.x-k8s.io/queue-name" not in r["template"]["metadata"]["labels"]
        assert "suspend" not in r["template"]["spec"]


@pytest.mark.parametrize("section, needle", [
    ({"namespace": "Vision"}, "kubernetes.namespace: 'Vision' is not a valid namespace"),
    ({"trainer": {"memory": "64GB"}}, "kubernetes.trainer.memory: '64GB' is not a Kubernetes quantity"),
    ({"trainer": {"gpu_resource": "gpu"}}, "kubernetes.trainer.gpu_resource: 'gpu' is not a valid extended resource"),
    ({"trainer": {"shm": -1}}, "kubernetes.trainer.shm: -1 is not a Kubernetes quantity"),
    ({"trainer": {"shm": "16GB"}}, "kubernetes.trainer.shm: '16GB' is not a Kubernetes quantity"),
    ({"trainer": {"shm": True}}, "kubernetes.trainer.shm: True is not a Kubernetes quantity"),
    ({"trainer": {"memory": "8Gi", "shm": "16Gi"}},
     "kubernetes.trainer.shm: '16Gi' is more than the pod's memory limit (8Gi)"),
    ({"pserver": {"memory": "1G", "shm": "1Gi"}}, "kubernetes.pserver.shm: '1Gi' is more than the pod's memory limit"),
    ({"volumes": {"data": {"claim": "a", "host_path": "/x"}}}, "kubernetes.volumes.data: give exactly one of"),
    ({"volumes": {"logs": {"claim": "a"}}}, "kubernetes.volumes.logs: unknown field"),
    ({"volumes": {"checkpoints": {"host_path": "mnt/x"}}}, "kubernetes.volumes.checkpoints.host_path: 'mnt/x'"),
    ({"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}, "kubernetes.tolerations[0].value: must be left out"),
    ({"tolerations": [{"key": "a", "effect": "NoRun"}]}, "kubernetes.tolerations[0].effect: must be one of"),
    ({"node_selector": ["gpu"]}, "kubernetes.node_selector: must be a mapping"),
    ({"run_as_user": 0}, "kubernetes.run_as_user: must be between 1 and"),
    ({"ttl_after_finished": "1h"}, "kubernetes.ttl_after_finished: must be an integer"),
    ({"queue": "Team A"}, "kubernetes.queue: 'Team A' is not a valid Kueue LocalQueue name"),
    ({"replicas": 3}, "kubernetes.replicas: unknown field"),
])
def test_each_mistake_in_the_kubernetes_section_is_one_line_naming_its_place(fab, tmp_path, section, needle):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"name": "lab"}, "kubernetes": section,
                                    "job": {"mode": "collective", "image": IMAGE},
                                    "nodes": [{"name": "a", "host": "10.0.0.1", "roles": ["trainer"]}]}))
    out = fab("export", "--k8s", str(tmp_path / "out"), cluster=path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert needle in out.stderr and "(line " in out.stderr and "Traceback" not in out.stderr, out.stderr


def write_cluster_file(path, job):
    path.write_text(yaml.safe_dump({"cluster": {"name": "lab"}, "job": job,
                                    "nodes": [{"name": "a", "host": "10.0.0.1", "roles": ["trainer"]}]}))
    return path


@pytest.mark.parametrize("job, args, needle", [
    ({"mode": "collective"}, (), "job.image: missing"),
    ({"mode": "pserver", "image": IMAGE}, ("--k8s-kind", "pytorchjob"), "needs collective mode"),
    ({"mode": "collective", "image": IMAGE}, ("--k8s-kind", "deployment"), "must be one of job, jobset, pytorchjob"),
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
    job_id = yaml.safe_load(files[0].read_text())["metadata"]["labels"]["fabtrain.io/job-id"]
    assert [f.name for f in files] == [f"00-secret-lab-{job_id}-job.yaml", f"01-service-lab-{job_id}.yaml",
                                       f"02-job-lab-{job_id}-trainer.yaml"]
    assert out.stdout.split() == [str(f) for f in files]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)  # the Secret holds the coordinator's secret
    again = fab("export", "--k8s", str(tmp_path / "out"), cluster=path)
    assert again.returncode == 2 and "already holds manifests" in again.stderr


def test_the_example_of_docs_kubernetes_renders_as_the_doc_says():
    text = (REPO / "docs" / "kubernetes.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    section, example = blocks[0], next(b for b in blocks if "cluster" in b)
    parse_cluster(example | section, "cluster.yaml")  # the section's every field, as the doc shows it
    docs = render(parse_cluster(example, "cluster.yaml"), job_id=JOB_ID)
    names = [file_name(i, d) for i, d in enumerate(docs)]
    assert names == [f"00-secret-demo-{JOB_ID}-job.yaml", f"01-service-demo-{JOB_ID}.yaml",
                     f"02-job-demo-{JOB_ID}-trainer.yaml"]
    for command in ("fab export --k8s k8s/", "kubectl apply -f k8s/", "fab status", "fab logs --follow",
                    "fab kill-all", "-l fabtrain.io/cluster=demo"):
        assert command in text
    box = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    assert box["resources"]["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    assert docs[-1]["metadata"]["namespace"] == "demo"
