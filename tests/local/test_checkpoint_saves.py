"""Checkpoint saves of unchanged programs, as the launcher's progress hook records them (docs/progress.md,
"Checkpoints"): a save through torch.distributed.checkpoint (`save` and `async_save`) and Lightning's
ModelCheckpoint, each in a record at once with its step, path, bytes and seconds, and in every record after
it; an async save's landing time too. (A raw loop's torch.save, and the views: tests/local/test_checkpoints.py.)"""
import os
import re

import pytest

from tests.conftest import require_import
from tests.support.launched import launched, read_records
from workload.ddp import free_port

pytestmark = pytest.mark.timeout(300)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def size(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)


def saves(records):
    return [r for r in records if r.get("checkpoint") == "saved"]


def test_dcp_saves_and_async_saves_are_recorded_with_their_step_folder_bytes_and_landing(tmp_path):
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    out = tmp_path / "ckpt"
    done = launched(tmp_path / "job", ["tests/programs/dcp_loop.py", str(out), "24", "6"], tmp_path / "m.jsonl",
                    MASTER_PORT=str(free_port()), **ONE_THREAD)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [(folder, int(step)) for folder, step in re.findall(r"saved (\S+) at step (\d+)", done.stdout)]
    assert [s for _, s in printed] == [6, 12, 18, 24], done.stdout
    records = read_records(tmp_path / "m.jsonl")
    said = saves(records)
    # Each save once, in order, with the program's own folder and step, and the bytes on disk.
    assert [(r["ckpt_path"], r["ckpt_step"]) for r in said] == printed, said
    for r in said:
        assert r["ckpt_seconds"] >= 0 and r["between_steps"] and r["busy"] == "saving a checkpoint", r
    # The async ones (the 2nd and 4th) are said to be so; a later record says when each landed, with its bytes
    # then on disk (async_save returns before its writer thread has written them); the others' at once.
    assert [bool(r.get("ckpt_async")) for r in said] == [False, True, False, True], said
    for r in said[0::2]:
        assert r["ckpt_bytes"] == size(r["ckpt_path"]) > 0, r
    landed = [r for r in records if r.get("ckpt_step") == 12 and "ckpt_landed_at" in r]
    assert landed and landed[-1]["ckpt_landed_at"] >= said[1]["ckpt_at"], records[-3:]
    assert landed[-1]["ckpt_bytes"] == size(said[1]["ckpt_path"]) > said[1]["ckpt_bytes"], (landed[-1], said[1])
    # Every step record after a save carries it: the last one says the last checkpoint.
    last = [r for r in records if not r.get("between_steps")][-1]
    assert last["step"] == 24 and last["ckpt_step"] == 24 and last["ckpt_path"] == printed[-1][0], last


def test_lightnings_model_checkpoint_saves_are_recorded_with_their_step_file_and_bytes(tmp_path):
    require_import("pytorch_lightning", "pytorch-lightning", "installed by `make test` (requirements-test.txt)")
    out = tmp_path / "ckpt"
    done = launched(tmp_path / "job", ["tests/programs/lightning_ckpt.py", str(out), "30", "10"],
                    tmp_path / "m.jsonl", **ONE_THREAD)
    assert done.returncode == 0 and "done at step 30" in done.stdout, done.stderr[-3000:]
    files = sorted(out.glob("*.ckpt"), key=lambda p: int(re.search(r"step=(\d+)", p.name).group(1)))
    assert [int(re.search(r"step=(\d+)", p.name).group(1)) for p in files] == [10, 20, 30], files
    said = saves(read_records(tmp_path / "m.jsonl"))
    assert [(r["ckpt_path"], r["ckpt_step"]) for r in said] == [(str(p), s) for p, s in zip(files, (10, 20, 30))], said
    assert all(r["ckpt_bytes"] == size(r["ckpt_path"]) > 0 and r["framework"] == "lightning" for r in said), said
