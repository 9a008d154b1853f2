"""What node ops' kill writes into a job's events.jsonl beside the agent: a failed start's
`start_failed`, and one `killed` event per process it stopped. One write a line, with O_APPEND,
so a line is never interleaved with the agent's own (fabtrain/node/agent/events.py)."""
import json
import os
import time

from fabtrain.contract.events import EventKind
from fabtrain.contract.identity import Process
from fabtrain.contract.jobfolder import JobFolder


def append_events(path, events):
    """Append events to an events.jsonl, one write a line: never interleaved with the agent's."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for ev in events:
            os.write(fd, (json.dumps(ev) + "\n").encode())
    finally:
        os.close(fd)


def write_kill_events(jobs_root, touched, killed, node, reason):
    """One `killed` event per process (its program and children share it) in each job's events.jsonl;
    `killed`: what the kill signalled (contract.opreplies.Killed)."""
    now = time.time()
    for job_id in touched:
        path = JobFolder(os.path.join(jobs_root, job_id)).events
        if not os.path.isdir(os.path.dirname(path)):
            continue
        by_name = {}
        for k in killed:
            if k.job_id == job_id:
                by_name.setdefault(k.name, []).append(k)
        events = []
        for name, ks in sorted(by_name.items()):
            process = Process(name)  # its role and index (contract/identity.py); a name with none: its role
            orphan = any(k.orphan for k in ks)
            daemons = sorted(k.pid for k in ks if k.starter)
            own = [k.pid for k in ks if not k.starter]
            events.append({
                "ts": now, "node": node, "kind": EventKind.KILLED, "role": process.role,
                "rank": process.index, "name": name, "pid": min(own or daemons),
                "pids": sorted(k.pid for k in ks),
                "reason": reason + (" (orphan: run record lost, or it left its launcher)" if orphan else "")
                + (" (and Open MPI's daemon that started it here, pid %s)" % ", ".join(map(str, daemons))
                   if daemons else ""),
                "signal": "SIGKILL" if any(k.signal == "SIGKILL" for k in ks) else "SIGTERM"})
        append_events(path, events)
