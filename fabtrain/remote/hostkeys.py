"""Host-key checking that mirrors OpenSSH, for paramiko (and so Fabric).

Fabric's Connection accepts any host key (paramiko's AutoAddPolicy); fabtrain
never does. `strict` refuses a host that is not in known_hosts; `accept-new`
records an unknown host's key (appending under a lock, as two parallel
connections may learn keys at once). Under both, a key that differs from the
recorded one is refused: paramiko raises BadHostKeyException before any
policy is asked, as long as the recorded keys are loaded into the client.
"""
from __future__ import annotations

import fcntl
import os

import paramiko


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey, known_hosts: str):
        self.hostname, self.key, self.known_hosts = hostname, key, known_hosts
        super().__init__(
            f"unknown host key for {hostname} ({key.get_name()} {key.fingerprint}) and host_key_policy is strict; "
            f"add it to {known_hosts} (ssh-keyscan, after checking the fingerprint) or use host_key_policy: accept-new"
        )


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        raise UnknownHostKey(hostname, key, self.known_hosts)


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Trust on first use: write the new key to known_hosts, under a lock."""

    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        changed = record_keys(self.known_hosts, [(hostname, key)])
        if changed:
            raise paramiko.BadHostKeyException(hostname, key, changed[0][1])
        client.get_host_keys().add(hostname, key.get_name(), key)


def record_keys(known_hosts: str, keys: list[tuple[str, paramiko.PKey]]) -> list[tuple[str, paramiko.PKey]]:
    """THE writer of learned keys: append each (hostname, key) that known_hosts lacks, under a lock,
    so a key learned by several connections at once is recorded once. Returns the (hostname,
    recorded key) of each whose recorded key differs: never replaced, the caller refuses it."""
    os.makedirs(os.path.dirname(known_hosts) or ".", mode=0o700, exist_ok=True)
    changed = []
    with open(known_hosts, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            # Another connection may have written it while we waited for the lock.
            f.seek(0)
            recorded = paramiko.HostKeys()
            for entry_line in f.read().splitlines():
                entry = paramiko.hostkeys.HostKeyEntry.from_line(entry_line)
                if entry is not None:
                    for name in entry.hostnames:
                        recorded.add(name, entry.key.get_name(), entry.key)
            for hostname, key in keys:
                known = recorded.lookup(hostname)
                if known and key.get_name() in known:
                    if known[key.get_name()] != key:
                        changed.append((hostname, known[key.get_name()]))
                    continue
                f.seek(0, os.SEEK_END)
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
                f.flush()
                recorded.add(hostname, key.get_name(), key)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    return changed


def merge_learned(learned_file: str, known_hosts: str) -> None:
    """Move the keys OpenSSH learned into learned_file (see openssh_config) into known_hosts,
    through record_keys: once each, however many ssh processes learned the same key."""
    keys = []
    try:
        with open(learned_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
        if entry is not None:
            keys += [(name, entry.key) for name in entry.hostnames]
    if keys:
        record_keys(os.path.expanduser(known_hosts), keys)


def apply_policy(client: paramiko.SSHClient, known_hosts: str, policy: str) -> None:
    """Load the recorded keys into the client and set the policy for unknown ones."""
    known_hosts = os.path.expanduser(known_hosts)
    if os.path.exists(known_hosts):
        client.load_host_keys(known_hosts)
    client.set_missing_host_key_policy(StrictPolicy(known_hosts) if policy == "strict" else AcceptNewPolicy(known_hosts))


def openssh_config(known_hosts: str, policy: str, learned_file: str | None = None, here: bool = True) -> list[str]:
    """The same policy as ssh config lines, for the OpenSSH client rsync runs (every hop of it), or
    (here=False) the one mpirun runs on a node, where the path is kept as written: ssh expands ~ there.

    Only the cluster's known_hosts counts, as for paramiko: not the system's
    list, which Fabric never reads either. OpenSSH appends a key it learns
    (accept-new) to the first UserKnownHostsFile without any lock, so several
    ssh processes meeting the same new host (the bastion hop of parallel
    rsyncs) would each append it: with learned_file, that file comes first and
    takes what is learned, unhashed, and merge_learned records it in
    known_hosts once, under the lock."""
    def quoted(path):
        path = os.path.abspath(os.path.expanduser(path)) if here else path
        return '"%s"' % path.replace("%", "%%")  # ssh expands %-tokens
    files = [learned_file, known_hosts] if learned_file and policy != "strict" else [known_hosts]
    return [
        f"StrictHostKeyChecking {'yes' if policy == 'strict' else 'accept-new'}",
        f"UserKnownHostsFile {' '.join(quoted(p) for p in files)}",
        "GlobalKnownHostsFile /dev/null",
        *(["HashKnownHosts no"] if len(files) > 1 else []),
    ]
