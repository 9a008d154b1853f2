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

from fabtrain.contract.events import EventKind
from fabtrain.contract.jobfolder import JobFolder
from fabtrain.contract.records import HEALTH_COORDINATOR, record
from fabtrain.node import deadman
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
        self.job, self.job_dir = job, job_dir
        self.elector = None  # a job that elects (Layout.elects): this agent's votes and candidacy (elect.py)
        self.target = self.nodes[0]  # the node whose coordinator the client follows
        self.echo: float | None = None  # the newest `t` of the followed coordinator's lines (tenure.py)
        self.term = 1  # the newest term of the lines followed: what the beats name (tenure.py)
        # The moment this agent would have begun its fence by, for its launchers' dead-man (a job whose agents fence)
        self.deadline = deadman.Deadline(JobFolder(job_dir).deadline, cfg.grace) if deadman.wanted(job) else None

    @property
    def hosted_here(self) -> bool:
        return self.nodes[0] == self.node

    def start(self) -> bool:
        """Host the coordinator (first node) and connect to it; False if the coordinator could not listen."""
        if self.restart.layout is not None and self.restart.layout.elects():
            from . import elect  # only a job that elects loads it

            try:
                self.elector = elect.Elector(self, self.job, self.job_dir, self.cfg.fence_after)
            except OSError as e:  # its ballot box's port is taken: this node neither votes nor stands
                self.on_event(EventKind.AGENT_ERROR, reason="no ballot box on %s: %s" % (self.node, e.strerror or e))
        if self.hosted_here:
            from fabtrain.node.coordination.server import Coordinator  # only here: the other agents never load it

            self.coordinator = Coordinator(
                self.job_id, self.host, self.port, self.nodes, self.cfg.interval, self.cfg.peer_timeout, self.path,
                secret=self.secret, restart=self.restart, on_event=self.on_event)
            if self.elector is not None:
                from fabtrain.node.coordination import tenure
                from fabtrain.node.coordination.election import Lease

                # restored (this agent started again by its keeper): every node counted from now, so it steps
                # down unless a majority echoes within the lease (it may have been elected away meanwhile)
                self.coordinator.tenure = tenure.Tenure(self.node, Lease(
                    tuple(self.nodes), self.node, 1, self.cfg.fence_after, time.monotonic(),
                    voters=tuple(self.nodes) if self.coordinator.restored else ()))
            self.coordinator.start()
            if not self.coordinator.wait_listening(self.coordinator.bind_wait + 5):
                return False
        host = self.host
        if self.elector is not None:  # an agent started again follows the coordinator of its term record
            self.target = self.elector.voter.state.coordinator or self.target
            host = self.elector.addresses.get(self.target, self.host)
        self._connect(host)
        if self.elector is not None:
            self.elector.start()
        return True

    def _connect(self, host: str) -> None:
        client = Client(host, self.port, self.cfg.interval, lambda msg: self._on_message(msg, client),
                        secret=self.secret, job_id=self.job_id, node=self.node, on_event=self.on_event,
                        peer_timeout=self.cfg.peer_timeout)
        self.client = client
        client.start()

    def _on_message(self, msg: dict, client: Client | None = None) -> None:
        if client is not None and client is not self.client:
            return  # a line of the coordinator this link no longer follows
        if self.elector is not None:
            if not self.elector.heard(msg):
                return  # of an older term: not followed (its coordinator steps down)
            if isinstance(msg.get("t"), (int, float)):
                self.echo = max(self.echo or 0.0, float(msg["t"]))
            if type(msg.get("term")) is int:
                self.term = max(self.term, msg["term"])
        with self.msgs_lock:
            self.msgs.append(msg)
        self.wake()

    # -- a job that elects (elect.py) ------------------------------------------------------------

    def follow(self, node: str, host: str) -> None:
        """Point the client at `node`'s coordinator (its term's, or the candidate this node voted for)."""
        if node == self.target:
            return
        old, self.target, self.echo = self.client, node, None
        self.roster, self.roster_known, self.last_beat_key = {}, None, None
        self._connect(host)
        if old is not None:
            old.stop()

    def hosting(self) -> bool:
        co = self.coordinator
        return co is not None and co.is_alive() and (co.tenure is None or co.tenure.stepped_down is None)

    def host_elected(self, won, previous: str | None, asked: float, lease: float) -> None:
        """This node won `won.term`: host its coordinator on this node's address (succession.take_over's board,
        the lease counted from `asked`), and follow it."""
        from fabtrain.node.coordination import tenure
        from fabtrain.node.coordination.election import Lease
        from fabtrain.node.coordination.server import Coordinator
        from fabtrain.node.coordination.succession import take_over

        host = self.elector.addresses[self.node]
        co = Coordinator(self.job_id, host, self.port, self.nodes, self.cfg.interval, self.cfg.peer_timeout, self.path,
                         secret=self.secret, restart=self.restart, on_event=self.on_event)
        co.board, events = take_over(self.job_id, self.nodes, self.cfg.peer_timeout, self.restart, won, self.node,
                                     previous, time.monotonic(), time.time())
        co.restored = False
        co.tenure = tenure.Tenure(self.node, Lease(tuple(self.nodes), self.node, won.term, lease, asked, won.voters))
        old, self.coordinator = self.coordinator, co
        if old is not None:
            old.stop()
            old.join(2)
        co._emit(events)
        co._save()
        co.start()
        if co.wait_listening(co.bind_wait + 5):
            self.follow(self.node, host)

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
        if self.elector is not None:  # the term it follows (not one it stood for in vain), its newest line, and the
            # newest generation it heard of (what its vote would carry: the board's may_start, coordination/quorum.py)
            beat = dict(beat, term=self.term, echo=self.echo, knows=self.elector.voter.known.generation)
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
        if self.deadline is not None:
            self.deadline.update(now, lease, bool(c and c.connected), self.cfg.interval, self.coordinator)
        return policy.Peers(
            ever_connected=self.ever_connected or self.resumed is not None, connected=bool(c and c.connected),
            silent_for=(now - c.last_contact) if c and c.last_contact is not None else None,
            lease_age=(now - lease) if lease is not None else None,
            error=c.error if c else None, seen=tuple(sorted(view.get("peers") or {})),
            trainers_running=int(view.get("trainers_running") or 0),
            deposed=self.coordinator.tenure.stepped_down  # (not once it follows another node's: elect.py, learned)
            if self.coordinator and self.coordinator.tenure and self.target == self.node else None)

    def health(self) -> dict:
        """health.json's `coordinator`."""
        c, co, view = self.client, self.coordinator, self.view
        host = self.elector.addresses[self.target] if self.elector else self.host  # the coordinator it follows
        # hosted_here: a coordinator of this agent's that has not stepped down (one deposed follows another node's)
        return record(HEALTH_COORDINATOR, host=host, port=self.port,
                      hosted_here=co is not None and (co.tenure is None or co.tenure.stepped_down is None),
                      connected=bool(c and c.connected),
                      last_contact=round(c.last_contact_epoch, 3) if c and c.last_contact_epoch else None,
                      lease=round(c.lease_epoch, 3) if c and c.lease_epoch else None,
                      fenced=(self.fenced or {}).get("reason"),
                      pulses=c.pulser.answered if c else 0,  # answered pulses (coordination/pulse.py)
                      error=(c.error if c else None) or (co.bind_error if co else None),
                      lost=view.get("lost") or [], done=view.get("done") or [],
                      node=self.target if self.elector else None, term=self.term if self.elector else None)

    def stop(self) -> None:
        if self.deadline is not None:
            self.deadline.clear()
        if self.elector:
            self.elector.stop()
        if self.client:
            self.client.stop()
        if self.coordinator:
            self.coordinator.stop()
            self.coordinator.join(2)
