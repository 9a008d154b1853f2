"""The node side of the call protocol: answer requests read on stdin until it closes.

The controller (fabtrain.remote.rpc) starts the node's python with a fixed
launcher, sends the node code and then requests over stdin, one JSON object
a line: {"op": "status", "payload": {...}}. Each is answered on stdout with
the reply frame: a SENTINEL line, then one JSON line, {"ok": true, "result":
...} or {"ok": false, "error": "one line"} (fabtrain.contract.replies: a refusal
a caller acts on adds its code and detail). Anything an op prints before it
(`logs --follow` streams log lines that way) comes before the sentinel, as
does noise a login shell prints (a .bashrc that echoes), so neither can
corrupt a reply.

Nothing travels on the command line: payloads carry the job's secret, and
any user of the node can read every process's argv in /proc.

The loop ends when stdin closes (a one-shot call closes it after its one
request; a long-lived channel when the controller closes it or the SSH
connection drops) or after `idle_exit` seconds without a request, so it
never outlives its controller for long. It carries no job marker (kill-all
leaves it alone) and holds no port, no GPU and no file open.

With the code deployed, `python -m fabtrain.node.serve` runs the same loop
by hand: type a request line, read the reply.
"""
import importlib
import json
import os
import select
import sys

from fabtrain.contract.replies import SENTINEL, UserFacing, refused


def request_lines(fd, buffered=b"", idle_exit=None):
    """Each request line read from fd (after `buffered`, what was read already) until EOF or idle."""
    buf = buffered
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
        # Not sys.stdin: its buffer would hide bytes from select().
        if idle_exit is not None and not select.select([fd], [], [], idle_exit)[0]:
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buf += chunk


# The ops of other node modules, imported only when asked for: what they need (torch, the history's
# readers, Slurm's step) costs no other call its import, and those that build on node ops (history,
# allocation) are reached from here, never from the ops they import.
MODULE_OPS = {"probe": ("probe", "op_probe"), "provision": ("probe", "op_provision"),
              "mark_killed": ("allocation", "op_mark_killed"), "jobs": ("history", "op_jobs"),
              "job": ("history", "op_job"), "netcheck": ("netcheck", "run"), "bandwidth": ("bandwidth", "run")}


def find_op(name):
    """The function that serves op `name`, or None."""
    from fabtrain.node.ops import OPS

    if name in MODULE_OPS:
        module, function = MODULE_OPS[name]
        return getattr(importlib.import_module("fabtrain.node." + module), function)
    return OPS.get(name)


def answer(line):
    """The reply to one request line, as the JSON text of the reply frame."""
    name = "?"
    try:
        request = json.loads(line)
        name = request["op"]
        op = find_op(name)
        if op is None:
            raise UserFacing("unknown op %r (the controller's fabtrain is newer than this node code?)" % name)
        reply = {"ok": True, "result": op(request["payload"])}
    except UserFacing as e:
        reply = refused(e)
    except Exception as e:  # reported on the controller with the node's name, as one line
        reply = {"ok": False, "error": in_words(e, name)}
    try:
        return json.dumps(reply)
    except (TypeError, ValueError) as e:
        return json.dumps({"ok": False, "error": "the reply is not JSON: %s" % e})


def in_words(e, op):
    """What went wrong, as a person says it: the path and what the system said of it, never a
    Python exception's class name or errno tuple."""
    if isinstance(e, OSError) and e.strerror:
        where = " ".join("%s" % f for f in (e.filename, e.filename2) if f is not None)
        return "%s%s (during %s)" % (where + ": " if where else "", e.strerror.lower(), op)
    if isinstance(e, KeyError):
        return "%s: the request has no %s (the controller's fabtrain differs from this node code?)" % (op, e)
    return "%s failed on this node: %s" % (op, str(e) or "no detail")


def main(buffered=b"", idle_exit=None):
    for line in request_lines(sys.stdin.fileno(), buffered, idle_exit):
        text = answer(line)
        # A leading newline: an op's streamed output may not end with one.
        sys.stdout.write("\n%s\n%s\n" % (SENTINEL, text))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
