"""events.jsonl: the agent's record of what it saw and did, one JSON object a line.

The agent is its only writer on the node (``fab kill-all`` appends its own
``killed`` lines with the same one-write-per-line discipline, so lines never
interleave). An event must reach the file even when the disk is full -- that
is often exactly what it reports -- so the agent keeps a small reserve file
next to it and gives that space back the first time a write fails with ENOSPC.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time

from fabtrain.contract.events import read_events
from fabtrain.contract.jobfolder import JobFolder

RESERVE_BYTES = 256 * 1024


class EventLog:
    def __init__(self, path: str, node: str, out=None):
        self.path, self.node = path, node
        self.out = out if out is not None else sys.stdout
        self.reserve_path = JobFolder(os.path.dirname(path)).events_reserve
        self.recent: list[dict] = []  # the last few, for health.json
        # Alerts (job.json's watchdog.notify) go out from here: every event passes this one writer.
        from .notify import from_job_dir
        self.notify = from_job_dir(os.path.dirname(path), self.write)

    def reserve(self) -> None:
        """Set aside room for the events of a full disk."""
        try:
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size < RESERVE_BYTES:
                os.write(fd, b"\0" * RESERVE_BYTES)
                os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def release(self) -> None:
        try:
            os.unlink(self.reserve_path)
        except OSError:
            pass

    def write(self, kind: str, reason: str, name: str | None = None, **fields) -> dict:
        ev = {"ts": round(time.time(), 3), "node": self.node, "kind": kind}
        if name is not None:
            ev["name"] = name
        ev["reason"] = reason
        ev.update({k: v for k, v in fields.items() if v is not None})
        self._append((json.dumps(ev) + "\n").encode())
        self.recent = (self.recent + [ev])[-5:]
        if self.notify is not None:
            self.notify(ev)  # on its own thread: never waits on the network
        try:
            self.out.write("%s %s%s: %s\n" % (time.strftime("%H:%M:%S"), kind, " " + name if name else "", reason))
            self.out.flush()
        except (OSError, ValueError):
            pass  # the log is on the same full disk; the event is what matters
        return ev

    def _append(self, line: bytes) -> None:
        for attempt in (0, 1):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, line)  # one write of one line: never interleaved with kill-all's
                finally:
                    os.close(fd)
                return
            except OSError as e:
                if e.errno != errno.ENOSPC or attempt:
                    return
                self.release()

    def replay(self) -> list[dict]:
        """Every event so far (a restarted agent learns the job's story from them)."""
        return read_events(self.path)
