"""A DDP program under the progress hook exits as it would without the hook, or better: never aborted at exit.

gloo's worker thread drops its last reference to a backward's all-reduce a moment after the work is done;
that work holds the Python context torch keeps with a backward, and if the interpreter is finalizing by
then the process aborts ("terminate called without an active exception", -6), whether or not the program
destroyed its process group (pytorch/pytorch#190489). Seen in a CI run of the torchrun example (a finished
job read as failed). Measured on tests/programs/ddp_exit.py, two ranks that exit right after their last
step: without the hook 11 pairs in 30 had a rank abort; with the hook but without its wait at exit
(progress_frameworks._let_collective_threads_finish: the GIL let go a moment), 3 ranks in one run of
this test; with it, none."""
import os
import subprocess
import sys

from fabtrain.node import launch, progress
from tests.conftest import require_import
from tests.support import REPO
from tests.support.sshd import free_port

PAIRS = 20  # without the hook's wait, a pair aborts with a chance of about 0.15 or more: all 20 pass with < 0.04


def test_ddp_ranks_that_exit_right_after_their_last_backward_are_never_aborted(tmp_path):
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    hook = tmp_path / "stacks" / "hook"
    hook.mkdir(parents=True)
    (hook / "sitecustomize.py").write_text(launch.STACK_HOOK)
    for name, text in progress.sources().items():
        (hook / name).write_text(text)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FABTRAIN_", "PYTHON", "RANK", "LOCAL_RANK"))}
    base.update(PYTHONPATH=str(hook), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", WORLD_SIZE="2")
    exits = []
    for pair in range(PAIRS):
        port = free_port(["127.0.0.1"])
        ranks = [subprocess.Popen([sys.executable, str(REPO / "tests" / "programs" / "ddp_exit.py")],
                                  env={**base, "MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r),
                                       "FABTRAIN_METRICS": str(tmp_path / f"m-{pair}.jsonl")},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        for p in ranks:
            out, _ = p.communicate(timeout=120)
            exits.append((p.returncode, out[-300:]))
        # The hook was there: both ranks wrote records.
        assert {json_rank(line) for line in (tmp_path / f"m-{pair}.jsonl").read_text().splitlines()} == {0, 1}
    assert [e for e in exits if e[0] != 0] == [], exits


def json_rank(line):
    import json
    return json.loads(line)["rank"]
