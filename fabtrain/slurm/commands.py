"""Slurm's own commands, run where `fab` can reach them: here (the login node) or on `scheduler.login`.

Only what every installation has: sbatch, squeue, scontrol, scancel (and srun
for `fab check`). `sacct` is asked only when the others no longer know a job,
and its "accounting storage is disabled" is an answer, not an error. Values
go to the login node as one argv, each word quoted, never a shell string
built from them.
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from fabtrain.errors import UserError
from fabtrain.remote.session import Session
from fabtrain.remote.transport import NodeError

TOOLS = ("sbatch", "squeue", "scontrol", "scancel")


@dataclass(frozen=True)
class Output:
    code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.code == 0

    def error(self) -> str:
        return (self.stderr.strip().splitlines() or [f"exit code {self.code}"])[-1]


class SlurmCommands:
    def __init__(self, session: Session):
        self.session = session
        self.login = session.cluster.scheduler.login
        self._home: str | None = None

    def where(self) -> str:
        return f"on {self.login}" if self.login else "here"

    def run(self, argv: list[str], stdin: str | None = None, timeout: float = 60) -> Output:
        if self.login:
            return self._remote(argv, stdin, timeout)
        try:
            out = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise UserError(f"{argv[0]} not found here: run fab on the cluster's login node, "
                            "or set scheduler.login") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"{argv[0]} gave no answer within {timeout:g} s (is slurmctld up?)") from None
        return Output(out.returncode, out.stdout, out.stderr)

    def _remote(self, argv: list[str], stdin: str | None, timeout: float) -> Output:
        """argv on the login node through the cluster's SSH connection (the one stream mechanism of node ops)."""
        t = self.session.transport(self.session.cluster.nodes[0])
        deadline = time.monotonic() + timeout
        try:
            stream = t.open_stream(argv, timeout=timeout)
        except NodeError as e:
            raise UserError(f"scheduler.login {self.login}: {e}") from None
        try:
            if stdin:
                stream.send(stdin.encode(), deadline)
            stream.close_input()
            out = b""
            while True:
                chunk = stream.recv(max(0.0, deadline - time.monotonic()))
                if chunk is None:
                    raise UserError(f"{argv[0]} on {self.login} gave no answer within {timeout:g} s")
                if not chunk:
                    break
                out += chunk
            last, how = stream.ended()
        except (OSError, TimeoutError):
            raise UserError(f"scheduler.login {self.login}: the connection closed during {argv[0]}") from None
        finally:
            stream.close()
        code = int(how.rsplit(" ", 1)[1]) if how.startswith("exit code ") else -1
        if code == 127:
            raise UserError(f"{argv[0]} not found on {self.login} (scheduler.login): is it a Slurm login node?")
        return Output(code, out.decode("utf-8", "replace"), last)

    def home(self) -> str:
        """The home folder where the workspace is (sbatch expands no ~)."""
        if self._home is None:
            if self.login:
                out = self.run(["printenv", "HOME"])
                self._home = out.stdout.strip() if out.ok else "~"
            else:
                self._home = os.path.expanduser("~")
        return self._home
