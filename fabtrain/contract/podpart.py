"""A pod's part of the job from one template and its index (`fab export --k8s`).

Every pod of a role runs the same pod template, so the Secret holds one job
spec for all of them (its size does not grow with the pods): per role, pod
0's job.json ("first": it holds what one pod of the role holds, such as the
agents' coordinator) and every other pod's ("rest"), in which each value that
differs from pod to pod is an expression of the pod's index. fabtrain.plan.kubernetes writes the template
and checks, when it renders, that it gives every pod exactly the part the
plan gives it; this module fills it in on the pod. Standard library only.

A template value is a JSON value, except an object with one key:

    {"@": [PIECE, ...]}       a string: the pieces joined, where a piece is a
                              string, or {"i": [A, B]} (str(A * index + B)), or
                              {"addr": [ROLE, A, B]} (the address of that
                              role's pod A * index + B), or
                              {"each": [ROLE, [SUFFIX, ...]]} (every pod of that
                              role, in order, one item per suffix: ADDRESS+SUFFIX,
                              joined with commas)
    {"@int": [A, B]}          the number A * index + B
    {"@nodes": [ROLE, ...]}   job.json's `nodes`: every pod of those roles, in order

A pod's address is ADDRESS[0] + str(index + ADDRESS[1]) + ADDRESS[2], or
FIRST for index 0 where the role gives one (the Kubeflow operator names its
master replica apart).
"""
import json
import os

from fabtrain.contract.jobfolder import JOB, SECRET


def address(pods, role, index):
    spec = pods[role]
    if index == 0 and spec.get("first"):
        return spec["first"]
    prefix, offset, suffix = spec["address"]
    return "%s%d%s" % (prefix, index + offset, suffix)


def expand(value, index, pods):
    """The template value for the pod `index` of its role; pods: {role: {"count", "address", "first"?}}."""
    if isinstance(value, list):
        return [expand(v, index, pods) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, arg), = value.items()
        if key == "@":
            return "".join(_piece(p, index, pods) for p in arg)
        if key == "@int":
            return arg[0] * index + arg[1]
        if key == "@nodes":
            return [{"address": address(pods, role, j), "name": "%s-%d" % (role, j), "roles": [role]}
                    for role in arg for j in range(pods[role]["count"])]
    return {k: expand(v, index, pods) for k, v in value.items()}


def _piece(piece, index, pods):
    if isinstance(piece, str):
        return piece
    (kind, arg), = piece.items()
    if kind == "i":
        return str(arg[0] * index + arg[1])
    if kind == "addr":
        return address(pods, arg[0], arg[1] * index + arg[2])
    if kind == "each":
        role, suffixes = arg
        return ",".join(address(pods, role, j) + s for j in range(pods[role]["count"]) for s in suffixes)
    raise ValueError("unknown template piece %r" % kind)


def part(spec, role, index, secret=None):
    """(job.json of pod `index` of `role`) from the job spec the Secret holds; ValueError says what is wrong."""
    pods = spec["pods"]
    if role not in spec["parts"]:
        raise ValueError("the job has no role %r (it has %s)" % (role, ", ".join(sorted(spec["parts"]))))
    if not 0 <= index < pods[role]["count"]:
        raise ValueError("pod index %d: the job has %d %s pods" % (index, pods[role]["count"], role))
    templates = spec["parts"][role]
    job = expand(templates["first"] if index == 0 else templates["rest"], index, pods)
    if secret:
        job["watchdog"].setdefault("coordinator", {})["secret"] = secret
    return job


def read(files, role, index):
    """The part of pod `index` from the Secret's files: job.json (the spec) and secret (the agents')."""
    with open(os.path.join(files, JOB)) as f:
        spec = json.load(f)
    try:
        with open(os.path.join(files, SECRET)) as f:
            secret = f.read().strip()
    except FileNotFoundError:
        secret = None
    return part(spec, role, index, secret)
