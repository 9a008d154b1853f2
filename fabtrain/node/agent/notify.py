"""Alerts: the agents tell a webhook or a command when a job fails, hangs, restarts or finishes.

The agents send them themselves, since the controller (a laptop, `fab watch`)
may be long gone when a job fails at night. job.json's watchdog.notify says
where: {"webhook": URL, "command": [argv], "on": ["failed", "hang", ...]}.

Once per job event, not once per node: every agent writes job_failed and
finished, but only the one that hosts the coordinator (nodes[0]) sends them;
a hang is sent by the node that saw it. Each alert goes out on its own
thread (the watchdog's loop never waits on a slow webhook): one POST of a
JSON body, a Slack-compatible `text` line and the event itself, tried a few
times over about five seconds; `command` gets the same JSON on its stdin
(argv, no shell). One that still fails is written as a `notify_failed`
event; it never stops the agent. Standard library only.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from fabtrain.contract.events import EventKind
from fabtrain.contract.states import stopped_by_user
from fabtrain.contract.jobfolder import JobFolder

# events.jsonl kinds -> the names cluster.yaml's notify.on uses
# A restart is told once, when it is decided (`restarting`: the cause, the backoff, the restarts left); a
# next generation that cannot start is a `failed` of its own.
# A hang is told twice: by the node that saw it (its own ranks' blame), and by the coordinator's node once
# every node's ranks are in (`blame`: the rank the others wait for, job-wide).
KINDS = {EventKind.JOB_FAILED: "failed", EventKind.HANG: "hang", EventKind.BLAME: "hang",
         EventKind.RESTARTING: "restart", EventKind.FINISHED: "finished", EventKind.STRAGGLER: "straggler",
         EventKind.NO_CHECKPOINT: "no_checkpoint"}  # written by the coordinator's node only (agent/checkpoints.py)
JOB_LEVEL = ("failed", "finished", "restart")  # every agent writes these: only nodes[0]'s agent sends
TRIES = 3
BACKOFF = (1.0, 2.0)  # seconds between tries: three within about five seconds
HTTP_TIMEOUT = 2.0
COMMAND_TIMEOUT = 30.0


class Notifier:
    def __init__(self, job: dict, report, job_dir: str | None = None):
        """job: job.json; report(kind, reason): writes an event (the EventLog's write);
        job_dir: where kill-all leaves its `killed` marker."""
        w = job.get("watchdog") or {}
        cfg = w.get("notify") or {}
        self.webhook = cfg.get("webhook")
        self.command = [str(a) for a in cfg.get("command") or []]
        self.on = set(cfg["on"]) if cfg else set()  # the plan writes `on` whenever notify is set (config: the defaults)
        self.job_id, self.node, self.cluster = job.get("job_id"), job.get("node"), job.get("cluster")
        nodes = [n.get("name") for n in job.get("nodes") or [] if isinstance(n, dict)]
        self.hosts_coordinator = not nodes or nodes[0] == self.node
        self.report = report
        self.killed_marker = JobFolder(job_dir).killed if job_dir else None
        self.sent: set = set()
        self.threads: list[threading.Thread] = []

    @property
    def enabled(self) -> bool:
        return bool(self.on and (self.webhook or self.command))

    def wants(self, ev: dict):
        """The notify.on name of an event this agent must send, else None."""
        what = KINDS.get(ev.get("kind"))
        if what is None or what not in self.on:
            return None
        if what in JOB_LEVEL and not self.hosts_coordinator:
            return None
        if what == "failed" and self.stopped_by_user(ev):
            return None  # kill-all is the user's own act, not a failure to be told about
        # A job fails or finishes once, and restarts once a generation: the coordinator's word and the
        # agent's own note are one event. Any other event is its own alert, by its kind: the coordinator's
        # node writes a one-node job's `hang` and its `blame` for the same rank in the same millisecond.
        key = what if what in ("failed", "finished") else (what, ev.get("generation")) if what == "restart" \
            else (what, ev.get("kind"), ev.get("name"), ev.get("ts"))
        if key in self.sent:
            return None
        self.sent.add(key)
        return what

    def __call__(self, ev: dict) -> None:
        what = self.wants(ev) if self.enabled else None
        if what is None:
            return
        body = self.body(what, ev)
        # Not a daemon: an agent that exits right after `finished` still sends it (each try is bounded).
        t = threading.Thread(target=self.send, args=(body,), name="notify", daemon=False)
        t.start()
        self.threads = [x for x in self.threads if x.is_alive()] + [t]

    def stopped_by_user(self, ev: dict) -> bool:
        """The job ends by `fab kill-all`: this node's marker, or another node's word through the coordinator
        (kill-all reaches the nodes in parallel, so a peer may report it before this node's marker exists)."""
        return stopped_by_user(ev.get("reason")) or bool(
            self.killed_marker and os.path.exists(self.killed_marker))

    def body(self, what: str, ev: dict) -> dict:
        where = ev.get("origin") or ev.get("node") or self.node
        subject = (" %s" % ev["name"]) if ev.get("name") else ""
        text = "fabtrain: job %s %s%s on %s: %s" % (self.job_id, what, subject, where, ev.get("reason") or what)
        if ev.get("blame"):  # a hang: the rank the others wait for, as the node that saw it knows
            text += " [%s]" % ev["blame"]
        elif ev.get("frame") and ev.get("kind") == EventKind.HANG:  # where the stalled rank stood (its top frame)
            text += " [at %s]" % ev["frame"]
        return {"text": text, "kind": what, "job_id": self.job_id, "cluster": self.cluster, "node": self.node,
                "event": ev}

    def send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        if self.webhook:
            error = post(self.webhook, data)
            if error:
                self.report(EventKind.NOTIFY_FAILED, "webhook %s: %s (alert: %s)" % (self.webhook, error, body["text"]))
        if self.command:
            error = run(self.command, data)
            if error:
                self.report(EventKind.NOTIFY_FAILED, "command %s: %s (alert: %s)" % (self.command[0], error, body["text"]))

    def wait(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def post(url: str, data: bytes):
    """POST data to url, tried TRIES times; None when it got a 2xx, else why not (one line)."""
    # Imported here, not with the module: urllib.request brings http.client, email and ssl, about
    # 40 ms of CPU that every agent would pay at its start for an alert most jobs never send.
    import urllib.error
    import urllib.request

    error = None
    for attempt in range(TRIES):
        if attempt:
            time.sleep(BACKOFF[min(attempt - 1, len(BACKOFF) - 1)])
        req = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "fabtrain-agent"})
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
                r.read(65536)
            return None
        except urllib.error.HTTPError as e:
            error = "HTTP %d %s" % (e.code, e.reason)
            if 400 <= e.code < 500 and e.code not in (408, 429):
                return error  # the request is wrong: trying again will not help
        except (urllib.error.URLError, OSError, ValueError) as e:
            error = str(getattr(e, "reason", None) or e)
    return "%s (after %d tries)" % (error, TRIES)


def run(argv: list, data: bytes):
    """Run argv with data on stdin; None if it exited 0, else why not (one line)."""
    try:
        p = subprocess.run(argv, input=data, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=COMMAND_TIMEOUT, start_new_session=True)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if p.returncode != 0:
        last = (p.stderr or b"").decode("utf-8", "replace").strip().splitlines()[-1:]
        return "exited %d%s" % (p.returncode, (": " + last[0][:200]) if last else "")
    return None


def from_job_dir(job_dir: str, report):
    """The job's Notifier (job.json beside events.jsonl), or None when it asks for no alerts."""
    try:
        with open(JobFolder(job_dir).job_json) as f:
            job = json.load(f)
    except (OSError, ValueError):
        return None
    n = Notifier(job if isinstance(job, dict) else {}, report, job_dir)
    return n if n.enabled else None
