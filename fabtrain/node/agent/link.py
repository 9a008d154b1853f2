"""The agent's link to the job's coordinator: hosting it (on the first node), the client, the status lines.

The client's thread hands every coordinator line to `Link`, which keeps them
until the loop takes them (`take`), and wakes the loop. The loop sends its
beats through `send`; `acked` says whether the coordinator has the last one.
`peers` and `health` are what the policy and health.json see of it.

Status lines carry the job's status and counts only; the roster (who beat,
who is done or lost) comes as what changed since the version this agent
holds, which every beat names (coordination/roster.py). `view` is the two
put together: the latest status line, with `peers`, `done` and `lost`.
"""
from __future__ import annotations

import threading
import time

from fabtrain.contract.jobfolder import JobFolder
from fabtrain.contract.records import HEALTH_COORDINATOR, record
from fabtrain.node.coordination.client import Client
from fabtrain.node.coordination.restart import RestartPolicy
from fabtrain.node.coordination.roster import merged

from . import policy


class Link:
    def __init__(self, job: dict, nodes: list[str], cfg: policy.Config, restart: RestartPolicy, job_dir: str,
                 on_event, wake, resumed: float | None = None):
        self.job_id, self.node, self.nodes, self.cfg, self.restart = job["job_id"], job["node"], nodes, cfg, restart
        coord = job["watchdog"]["coordinator"]
        self.host, self.port, self.secret = coord["host"], int(coord["port"]), coord.get("secret")
        self.path = JobFolder(job_dir).coordinator
        self.on_event, self.wake = on_event, wake
        self.coordinator = None  # the Coordinator, on the node that hosts it
        self.client: Client | None = None
        self.view: dict = {}  # the coordinator's last status line for this job, with the roster
        self.roster: dict = {}  # node -> [ts, done, lost], as the replies' rosters built it
        self.roster_known: dict | None = None  # the version of it we hold, named in every beat
        # An agent restarted by its keeper whose predecessor held a lease: its own lease starts with it
        # (monotonic), so a node cut off while its agent restarts still fences itself (fence.py).
        self.resumed = resumed
        self.fenced: dict | None = None  # the coordinator's `fenced` answer: this node left the job for good
        self.msgs: list[dict] = []
        self.msgs_lock = threading.Lock()
        self.last_seq = 0
        self.last_beat_key = None

    @property
    def hosted_here(self) -> bool:
        return self.nodes[0] == self.node

    def start(self) -> bool:
        """Host the coordinator (first node) and connect to it; False if the coordinator could not listen."""
        if self.hosted_here:
            from fabtrain.node.coordination.server import Coordinator  # only here: the other agents never load it

            self.coordinator = Coordinator(
                self.job_id, self.host, self.port, self.nodes, self.cfg.interval, self.cfg.peer_timeout, self.path,
                secret=self.secret, restart=self.restart, on_event=self.on_event)
            self.coordinator.start()
            if not self.coordinator.wait_listening(self.coordinator.bind_wait + 5):
                return False
        self.client = Client(self.host, self.port, self.cfg.interval, self._on_message, secret=self.secret,
                             job_id=self.job_id, node=self.node, on_event=self.on_event,
                             peer_timeout=self.cfg.peer_timeout)
        self.client.start()
        return True

    def _on_message(self, msg: dict) -> None:
        with self.msgs_lock:
            self.msgs.append(msg)
        self.wake()

    def take(self) -> list[dict]:
        """The lines that came since the last call; the newest status of this job becomes `view`."""
        with self.msgs_lock:
            msgs, self.msgs = self.msgs, []
        for msg in msgs:
            if msg.get("op") == "fenced" and msg.get("job_id") == self.job_id:
                self.fenced = msg
            if msg.get("op") == "status" and msg.get("job_id") == self.job_id:
                self.view = dict(msg, peers=self.view.get("peers") or {}, done=self.view.get("done") or [],
                                 lost=self.view.get("lost") or [])
                if isinstance(msg.get("roster"), dict):
                    self._take_roster(msg.pop("roster"))
        return msgs

    def _take_roster(self, roster: dict) -> None:
        self.roster = merged(self.roster, roster)
        self.roster_known = {"epoch": roster.get("epoch"), "at": roster.get("at")}
        self.view.pop("roster", None)
        self.view.update(peers={n: e[0] for n, e in self.roster.items()},
                         done=sorted(n for n, e in self.roster.items() if e[1]),
                         lost=sorted(n for n, e in self.roster.items() if e[2]))

    def send(self, beat: dict, urgent: bool = False) -> None:
        """A beat to the coordinator; an urgent one only if something in it changed since the last."""
        if self.client is None:
            return
        key = repr([beat["procs"], beat["done"], beat["failure"], beat["final"]])
        if urgent and key == self.last_beat_key:
            return  # nothing new since the last beat; the next tick sends one anyway
        self.last_beat_key = key
        self.last_seq = self.client.update(dict(beat, roster=self.roster_known), urgent)

    @property
    def acked(self) -> bool:
        return self.client is not None and self.client.acked_seq >= self.last_seq

    @property
    def ever_connected(self) -> bool:
        return bool(self.client and self.client.ever_connected)

    def peers(self) -> policy.Peers:
        c, view, now = self.client, self.view, time.monotonic()
        lease = c.lease if c and c.lease is not None else self.resumed
        return policy.Peers(
            ever_connected=self.ever_connected or self.resumed is not None, connected=bool(c and c.connected),
            silent_for=(now - c.last_contact) if c and c.last_contact is not None else None,
            lease_age=(now - lease) if lease is not None else None,
            error=c.error if c else None, seen=tuple(sorted(view.get("peers") or {})),
            trainers_running=int(view.get("trainers_running") or 0))

    def health(self) -> dict:
        """health.json's `coordinator`."""
        c, co, view = self.client, self.coordinator, self.view
        return record(HEALTH_COORDINATOR, host=self.host, port=self.port, hosted_here=co is not None,
                      connected=bool(c and c.connected),
                      last_contact=round(c.last_contact_epoch, 3) if c and c.last_contact_epoch else None,
                      lease=round(c.lease_epoch, 3) if c and c.lease_epoch else None,
                      fenced=(self.fenced or {}).get("reason"),
                      pulses=c.pulser.answered if c else 0,  # answered pulses (coordination/pulse.py)
                      error=(c.error if c else None) or (co.bind_error if co else None),
                      lost=view.get("lost") or [], done=view.get("done") or [])

    def stop(self) -> None:
        if self.client:
            self.client.stop()
        if self.coordinator:
            self.coordinator.stop()
            self.coordinator.join(2)
