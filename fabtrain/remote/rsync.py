"""The one rsync runner: `fab deploy`, `fab provision --wheelhouse` and `fab copy-data`.

Over SSH, rsync runs OpenSSH's client, which must keep to what Fabric keeps
to: the cluster's known_hosts and host_key_policy on EVERY hop, a ProxyJump
bastion included; the ssh config files Fabric read (`fab -S FILE`, else
~/.ssh/config and /etc/ssh/ssh_config); and never a prompt. Options on
ssh's command line reach only the last hop (OpenSSH starts a jump host's
ssh with the -F file but none of the -o options), so the policy goes into
a config file written for each rsync: a `Host *` block first (in an ssh
config the first value found wins), then the files Fabric read, included.
The node's port, user and key stay on the command line: they are the
node's, not the bastion's (as in Fabric, whose gateway gets only its own
ssh config entry).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from fabtrain.remote import hostkeys
from fabtrain.remote.transport import NodeError, SSHTransport, Transport, quote_path


SERVER_ALIVE_INTERVAL = 5  # seconds between ssh's keepalives to the node, inside the encrypted channel
SERVER_ALIVE_COUNT = 3  # unanswered in a row: the connection is gone


def ssh_config_text(t: SSHTransport, learned_file: str | None = None) -> str:
    """The config file rsync's ssh reads (-F): the cluster's policy for every host, then Fabric's files.
    learned_file: where ssh puts keys it learns, for hostkeys.merge_learned."""
    ssh = t.node.ssh
    policy = hostkeys.openssh_config(ssh.known_hosts, ssh.host_key_policy, learned_file)
    lines = ["# Written by fabtrain for one rsync: the cluster's host-key policy on every hop.",
             "Host *",
             "    BatchMode yes",
             f"    ConnectTimeout {max(1, round(ssh.connect_timeout))}",
             # A link cut mid-file (a dead switch port drops packets, no reset comes) ends the copy in
             # about 15 s instead of hanging until TCP gives up; the next copy resumes from --partial-dir.
             f"    ServerAliveInterval {SERVER_ALIVE_INTERVAL}",
             f"    ServerAliveCountMax {SERVER_ALIVE_COUNT}",
             *(f"    {line}" for line in policy)]
    lines += [f'    Include "{path}"' for path in t.ssh_config_files()]
    return "\n".join(lines) + "\n"


def reason(stderr: str, code: int) -> str:
    """The one line of rsync's (or ssh's) stderr that says what went wrong."""
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr:
        host = re.search(r"Host key for (\S+) has changed", stderr)
        return (f"HOST KEY CHANGED{' for ' + host.group(1) if host else ''}: ssh refused to connect "
                f"(if the server was reinstalled: ssh-keygen -R)")
    lines = [l.strip() for l in stderr.splitlines() if l.strip() and not l.startswith("@")]
    # What follows the cause (the connection closing, rsync giving up) and what is no failure.
    useful = [l for l in lines if not l.startswith(("rsync: connection unexpectedly closed", "rsync error:",
                                                       "Connection closed by", "kex_exchange_identification:",
                                                       "Host key verification failed.", "Warning: Permanently added"))]
    return (useful or lines or [f"exit code {code}"])[0]


class Rsync:
    """One rsync of sources into remote_dir on one node (the directory is made if missing).

    It starts at once. With files_from_stdin (options hold --files-from=-)
    it waits for give_files(): rsync opens its SSH connection and starts the
    node's side before it reads the list, so that work overlaps whatever
    decides the list. records() streams what it prints; finish() waits and
    says why it failed; cancel() stops it. Use it in a `with` block (or call
    cancel) so its ssh config file is removed."""

    def __init__(self, t: Transport, sources: list[str], remote_dir: str, options: list[str] = (),
                 files_from_stdin: bool = False):
        self.node = t.node.name
        self.config_file: str | None = None
        self.learned_file: str | None = None  # keys its ssh learns, merged into known_hosts at the end
        self.known_hosts = t.node.ssh.known_hosts if isinstance(t, SSHTransport) else None
        self.proc: subprocess.Popen | None = None
        self.stderr = tempfile.TemporaryFile()  # read only at the end: no pipe to drain
        self.file_list = None  # our end of its stdin (a pipe of our own: communicate() leaves it alone)
        try:
            if isinstance(t, SSHTransport):
                fd, self.learned_file = tempfile.mkstemp(prefix="fabtrain-learned-")  # 0600
                os.close(fd)
                fd, self.config_file = tempfile.mkstemp(prefix="fabtrain-ssh-", suffix=".conf")  # 0600
                with os.fdopen(fd, "w") as f:
                    f.write(ssh_config_text(t, self.learned_file))
                transport_args, dest = self._ssh_destination(t, remote_dir)
            else:
                path = Path(remote_dir).expanduser()
                path.mkdir(parents=True, exist_ok=True)
                transport_args, dest = [], f"{path}/"
            argv = ["rsync", "-a", *options, *transport_args, *sources, dest]
            stdin = subprocess.DEVNULL
            if files_from_stdin:
                stdin, w = os.pipe()
                self.file_list = os.fdopen(w, "wb")
            try:
                self.proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=self.stderr)
            finally:
                if files_from_stdin:
                    os.close(stdin)
        except FileNotFoundError:
            self._cleanup()
            raise NodeError(f"{self.node}: rsync is not installed on this machine") from None
        except BaseException:
            self._cleanup()
            raise

    def _ssh_destination(self, t: SSHTransport, remote_dir: str) -> tuple[list[str], str]:
        ssh = t.node.ssh
        cmd = ["ssh", "-F", self.config_file]
        if ssh.port:
            cmd += ["-p", str(ssh.port)]
        if ssh.user:
            cmd += ["-l", ssh.user]
        if ssh.key:
            cmd += ["-i", str(Path(ssh.key).expanduser())]
        remote_dir = remote_dir.rstrip("/")
        # rsync's remote paths are relative to the login's home, so ~/x -> x.
        path = remote_dir[2:] if remote_dir.startswith("~/") else remote_dir
        return ["-e", shlex.join(cmd), f"--rsync-path=mkdir -p {quote_path(remote_dir)} && rsync"], f"{t.node.host}:{path}/"

    def give_files(self, names: list[str]) -> None:
        """The files to copy, relative to the source (for --files-from=- --from0)."""
        try:
            with self.file_list:
                self.file_list.write(b"\0".join(n.encode() for n in names))
        except BrokenPipeError:  # rsync already failed (say, the node refused it): finish() says why
            pass

    def records(self) -> Iterator[bytes]:
        """What rsync prints, a line or a progress update (\\r) at a time, until it ends."""
        buf = b""
        while chunk := self.proc.stdout.read1(4096):
            buf += chunk
            *done, buf = re.split(rb"[\r\n]", buf)
            yield from done
        if buf:
            yield buf

    def finish(self, timeout: float | None = None) -> str:
        """Wait for it; what it printed (the rest of it); NodeError with rsync's reason if it failed."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cancel()
            raise NodeError(f"{self.node}: rsync timed out after {timeout:g} s") from None
        self.stderr.seek(0)
        stderr = self.stderr.read().decode(errors="replace")
        self._cleanup()
        if self.proc.returncode != 0:
            raise NodeError(f"{self.node}: rsync failed: {reason(stderr, self.proc.returncode)}")
        return out.decode(errors="replace")

    def cancel(self) -> None:
        """Stop it if it still runs (rsync ends its ssh and the node's side on SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        for f in (self.file_list, self.proc and self.proc.stdout):
            if f:
                try:
                    f.close()
                except OSError:
                    pass
        self.stderr.close()
        if self.learned_file:
            hostkeys.merge_learned(self.learned_file, self.known_hosts)
        for path in (self.config_file, self.learned_file):
            if path:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        self.config_file = self.learned_file = None

    def __enter__(self) -> "Rsync":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def rsync(t: Transport, sources: list[str], remote_dir: str, options: list[str] = (), timeout: float = 3600) -> dict:
    """Copy sources into remote_dir on the node and wait; {"files": n, "bytes": n} sent."""
    with Rsync(t, sources, remote_dir, ["--stats", *options]) as run:
        out = run.finish(timeout)
    stats = {}
    for line in out.splitlines():
        if line.startswith("Number of regular files transferred:"):
            stats["files"] = int(line.split(":")[1].strip().replace(",", ""))
        elif line.startswith("Total transferred file size:"):
            stats["bytes"] = int(line.split(":")[1].split()[0].replace(",", ""))
    return stats
