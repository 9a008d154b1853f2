"""A stand-in for `kubectl` that runs a Job's pods as local processes (no API server can run here).

    fake_kubectl.py STATE [kubectl's arguments]     (tests put a `kubectl` that calls this first on PATH)

It answers exactly the calls fabtrain makes, with kubectl's output shapes:
`apply -f DIR` (Secrets, Services, Indexed Jobs: each Job's pods started as
processes running the container's command, JOB_COMPLETION_INDEX set, the
Secret's keys as the files its mountPath names), `get pods -l SEL -o json`,
`logs -l SEL --prefix --tail N [--follow]`, `delete KIND -l SEL` (a Job's pods
get SIGTERM, as the kubelet sends, then go) and `wait --for=delete pods -l SEL`.
Every call is appended to STATE/calls.jsonl. A pod's container runs under
`run-pod`, which passes SIGTERM on and records the exit code.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import yaml

STATE = sys.argv[1]
PODS = os.path.join(STATE, "pods")


def matches(labels, sel):
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in sel.split(",") if term))


def records():
    out = []
    for path in sorted(glob.glob(os.path.join(PODS, "*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def exit_code(pod):
    try:
        with open(os.path.join(PODS, pod["name"] + ".exit")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def apply(folder, namespace):
    docs = [yaml.safe_load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "*.yaml")))]
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    os.makedirs(PODS, exist_ok=True)
    for doc in docs:
        print(f"{doc['kind'].lower()}/{doc['metadata']['name']} created")
        if doc["kind"] != "Job":
            continue
        template = doc["spec"]["template"]
        box = template["spec"]["containers"][0]
        for index in range(doc["spec"]["completions"]):
            name = f"{doc['metadata']['name']}-{index}"
            files = os.path.join(STATE, "mounts", name)
            command = list(box["command"])
            for volume in template["spec"]["volumes"]:
                if "secret" in volume:
                    mount = next(m["mountPath"] for m in box["volumeMounts"] if m["name"] == volume["name"])
                    os.makedirs(files, mode=0o700)
                    for key, text in secrets[volume["secret"]["secretName"]].items():
                        with open(os.path.join(files, key), "w") as f:
                            f.write(text)
                    command = [files if a == mount else a for a in command]
            pod = {"name": name, "namespace": namespace, "index": index, "container": box["name"],
                   "labels": dict(template["metadata"]["labels"], **{"batch.kubernetes.io/job-completion-index": str(index),
                                                                     "job-name": doc["metadata"]["name"]}),
                   "command": command, "env": {e["name"]: e["value"] for e in box.get("env", [])}}
            with open(os.path.join(PODS, name + ".json"), "w") as f:
                json.dump(pod, f)
            runner = subprocess.Popen([sys.executable, __file__, STATE, "run-pod", name], start_new_session=True,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(PODS, name + ".pid"), "w") as f:
                f.write(str(runner.pid))


def run_pod(name):
    with open(os.path.join(PODS, name + ".json")) as f:
        pod = json.load(f)
    env = dict(os.environ, **pod["env"], JOB_COMPLETION_INDEX=str(pod["index"]))
    with open(os.path.join(PODS, name + ".log"), "wb") as log:
        child = subprocess.Popen(pod["command"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=os.environ.get("FAKE_KUBECTL_WORKDIR"))
        signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
        code = child.wait()
    code = 128 - code if code < 0 else code  # a signal, as the container runtime reports it
    with open(os.path.join(PODS, name + ".exit.tmp"), "w") as f:
        f.write(str(code))
    os.rename(os.path.join(PODS, name + ".exit.tmp"), os.path.join(PODS, name + ".exit"))


def item(pod):
    code = exit_code(pod)
    state = {"running": {"startedAt": "2026-11-24T00:00:00Z"}} if code is None else \
        {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
    phase = "Running" if code is None else "Succeeded" if code == 0 else "Failed"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod["name"], "namespace": pod["namespace"], "labels": pod["labels"]},
            "spec": {"nodeName": "local"},
            "status": {"phase": phase, "conditions": [],
                       "containerStatuses": [{"name": pod["container"], "state": state}]}}


def logs(sel, tail, follow):
    pods = [p for p in records() if matches(p["labels"], sel)]
    offsets = {}
    while True:
        for pod in pods:
            with open(os.path.join(PODS, pod["name"] + ".log"), errors="replace") as f:
                f.seek(offsets.get(pod["name"], 0))
                lines = f.read().splitlines(keepends=True)
                offsets[pod["name"]] = f.tell()
            if pod["name"] not in offsets or tail is not None:
                lines = lines[-tail:] if tail else lines
            for line in lines:
                sys.stdout.write(f"[pod/{pod['name']}/{pod['container']}] {line}")
        tail = None
        sys.stdout.flush()
        if not follow or all(exit_code(p) is not None for p in pods):
            return
        time.sleep(0.2)


def delete(kind, sel):
    if kind not in ("jobs.batch", "services", "secrets"):
        sys.exit(f'error: the server doesn\'t have a resource type "{kind.split(".")[0]}"')
    if kind != "jobs.batch":
        return
    for pod in records():
        if matches(pod["labels"], sel):
            with open(os.path.join(PODS, pod["name"] + ".pid")) as f:
                os.kill(int(f.read()), signal.SIGTERM)
            print(f'job.batch "{pod["labels"]["job-name"]}" deleted') if pod["index"] == 0 else None
            with open(os.path.join(PODS, pod["name"] + ".deleted"), "w"):
                pass


def wait_deleted(sel, timeout):
    pods = [p for p in records() if matches(p["labels"], sel)]
    if not pods:
        sys.exit("error: no matching resources found")
    deadline = time.time() + timeout
    while any(exit_code(p) is None for p in pods):
        if time.time() > deadline:
            sys.exit("error: timed out waiting for the condition")
        time.sleep(0.1)
    for pod in pods:  # a deleted Job's pods are gone once they have ended
        for path in glob.glob(os.path.join(PODS, pod["name"] + ".*")):
            os.unlink(path)
        print(f"pod/{pod['name']} condition met")


def main(args):
    with open(os.path.join(STATE, "calls.jsonl"), "a") as f:
        f.write(json.dumps(args) + "\n")
    if args[:1] == ["run-pod"]:
        return run_pod(args[1])
    namespace = "default"
    while args and args[0] in ("--context", "--namespace"):
        if args[0] == "--namespace":
            namespace = args[1]
        args = args[2:]
    opts = {a.split("=")[0]: (a.split("=", 1) + [None])[1] for a in args if a.startswith("--")}
    value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    verb = args[0]
    if verb == "apply":
        return apply(value("-f"), namespace)
    sel = value("-l")
    if verb == "get" and args[1] == "pods":
        pods = [item(p) for p in records() if matches(p["labels"], sel) and p["namespace"] == namespace]
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}))
    elif verb == "logs":
        logs(sel, int(value("--tail")) if "--tail" in args else None, "--follow" in opts)
    elif verb == "delete":
        delete(args[1], sel)
    elif verb == "wait" and opts.get("--for") == "delete":
        wait_deleted(sel, float(opts["--timeout"].rstrip("s")))
    else:
        sys.exit(f"fake kubectl: not a call fabtrain makes: {args}")


if __name__ == "__main__":
    main(sys.argv[2:])
