"""prepare(): inputs -> shards + dictionary + MANIFEST.json, atomically.

Everything is built in a temporary directory next to the output directory
(``.<name>.prepare-XXXXXX`` in its parent, so renames stay on one file
system); each file is fsynced; then the files are renamed into place and
MANIFEST.json is written last.  When the output directory does not exist
(or is empty) the whole temporary directory is renamed onto it in one step.
On any error the temporary directory is removed, and nothing half-written
is left under a final name.

A rerun with the same inputs and options finds the manifest, verifies the
files against it and does nothing.  A manifest from different inputs or
options is refused unless ``force``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

from . import fetch, manifest as mf, sample as sm, strategies as st
from .archive import ExtractLimits
from .dictionary import write_word_dict
from .errors import PrepareError
from .shardio import describe_file
from .stream import Stream, require_lines

OUR_NAMES = re.compile(r"^(train\.txt|test\.txt)-\d{5,}$|^word_dict\.json$")
MAX_SPLIT = 100000


class Result:
    def __init__(self, status: str, out_dir: str, manifest: dict):
        self.status = status          # "written" | "up-to-date"
        self.out_dir = out_dir
        self.manifest = manifest

    def summary(self) -> str:
        m = self.manifest
        if self.status == "up-to-date":
            return (f"{self.out_dir} is up to date (same input and options; "
                    f"files verified against MANIFEST.json)")
        files = m["files"].values()
        tr = [e for e in files if e["kind"] == "train"]
        te = [e for e in files if e["kind"] == "test"]
        parts = [f"{len(tr)} train shard{'s' if len(tr) != 1 else ''} "
                 f"({sum(e['lines'] for e in tr)} lines)"]
        if te:
            parts.append(f"{len(te)} test shard{'s' if len(te) != 1 else ''} "
                         f"({sum(e['lines'] for e in te)} lines)")
        if m.get("dictionary"):
            parts.append(f"word_dict.json ({m['dictionary']['words']} words)")
        syn = " [synthetic sample data]" if m.get("synthetic") else ""
        return (f"wrote {', '.join(parts)} and MANIFEST.json to {self.out_dir} "
                f"(strategy {m['strategy']}){syn}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _write_new(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _Lock:
    """An exclusive flock on the parent directory, so two prepare runs never
    write the same output directory at once (the second waits, then
    usually finds the work done).  No lock file is left behind."""

    def __init__(self, parent: str):
        self.parent = parent
        self.fd = None

    def __enter__(self):
        import fcntl
        self.fd = os.open(self.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"prepare.py: waiting for another prepare.py writing in {self.parent}",
                  file=sys.stderr)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)


def _input_request(input_spec, sample, flag="--input") -> dict:
    if sample:
        return {"sample": dict(sm.DEFAULTS), "generator": sm.GENERATOR_VERSION}
    if fetch.is_url(input_spec):
        return {"url": input_spec}
    return fetch.fingerprint_local(input_spec, flag)


def _read_old_manifest(out_dir: str):
    """(state, manifest or None): state is absent | ours | foreign | invalid."""
    path = os.path.join(out_dir, mf.MANIFEST_NAME)
    if not os.path.lexists(path):
        return "absent", None
    try:
        data = mf.load_manifest(path)
    except PrepareError:
        return "invalid", None
    return "ours", data


def _difference(old: dict, new: dict) -> str:
    req = old.get("request") or {}
    keys = [k for k in ("strategy", "split_count", "input", "test", "dict")
            if req.get(k) != new.get(k)]
    labels = {"strategy": f"strategy {req.get('strategy')} there, {new['strategy']} asked",
              "split_count": f"split count {req.get('split_count')} there, "
                             f"{new['split_count']} asked",
              "input": f"input {old.get('source')}", "test": "a different test input",
              "dict": "different dictionary options"}
    return ", ".join(labels[k] for k in keys) or "options"


def _install(stage: str, out_dir: str, manifest: dict) -> None:
    data = mf.dumps(manifest)
    names = list(manifest["files"])
    empty_dir = os.path.isdir(out_dir) and not os.listdir(out_dir)
    if not os.path.lexists(out_dir) or empty_dir:
        _write_new(os.path.join(stage, mf.MANIFEST_NAME), data)
        os.chmod(stage, 0o777 & ~_umask())
        _fsync_dir(stage)
        os.rename(stage, out_dir)     # onto a missing or empty dir: atomic
        _fsync_dir(os.path.dirname(out_dir))
        return
    mpath = os.path.join(out_dir, mf.MANIFEST_NAME)
    old_names = set()
    try:
        with open(mpath, "rb") as f:
            import json
            old_names = set((json.loads(f.read()) or {}).get("files", {}))
    except (OSError, ValueError, AttributeError):
        pass
    if os.path.lexists(mpath):
        os.unlink(mpath)              # no manifest while files change
        _fsync_dir(out_dir)
    for nm in names:
        os.replace(os.path.join(stage, nm), os.path.join(out_dir, nm))
    stale = {n for n in os.listdir(out_dir) if OUR_NAMES.match(n)} | \
            {n for n in old_names if "/" not in n and n != mf.MANIFEST_NAME}
    for nm in sorted(stale - set(names)):
        try:
            os.unlink(os.path.join(out_dir, nm))
        except FileNotFoundError:
            pass
    _fsync_dir(out_dir)
    tmp = os.path.join(out_dir, f".{mf.MANIFEST_NAME}.tmp-{os.getpid()}")
    try:
        _write_new(tmp, data)
        os.replace(tmp, mpath)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    _fsync_dir(out_dir)


def prepare(out: str, split_count: int, *, input: str | None = None, sample: bool = False,
            strategy: str = "contiguous", test: str | None = None, build_dict: bool = True,
            min_freq: int = 1, force: bool = False, progress: bool = True,
            limits: ExtractLimits | None = None) -> Result:
    """Prepare the data directory `out` (`limits`: what a tarball may expand to). PrepareError for bad input."""
    if strategy not in st.STRATEGIES:
        raise PrepareError(f"--strategy {strategy}: unknown (use one of {', '.join(st.STRATEGIES)})")
    if isinstance(split_count, bool) or not isinstance(split_count, int) \
            or not 1 <= split_count <= MAX_SPLIT:
        raise PrepareError(f"--split-count {split_count}: must be a whole number from 1 to {MAX_SPLIT}")
    if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
        raise PrepareError(f"--min-freq {min_freq}: must be a whole number >= 1")
    if bool(sample) == bool(input):
        raise PrepareError("give exactly one of --input PATH_OR_URL and --sample")
    if sample and test:
        raise PrepareError("--test cannot be used with --sample (the sample has its own test set)")
    if not out:
        raise PrepareError("--out: an output directory is needed")
    if test and (fetch.is_url(test) or fetch.is_tar_name(test)):
        raise PrepareError(f"--test {test}: must be a local text file or directory "
                           f"(a tarball's test file is found from --input)")
    n = split_count
    shown_out = out
    out_dir = os.path.realpath(out)   # a symlinked DIR stays a symlink
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise PrepareError(f"--out {shown_out}: exists and is not a directory")
    parent, name = os.path.dirname(out_dir), os.path.basename(out_dir)

    request = {
        "strategy": strategy, "split_count": n,
        "input": _input_request(input, sample),
        "test": fetch.fingerprint_local(test, "--test") if test else None,
        "dict": {"min_freq": min_freq} if build_dict else None,
    }
    for flag, spec in (("--input", input), ("--test", test)):
        if spec and not fetch.is_url(spec) and os.path.isdir(spec):
            src = os.path.realpath(spec)
            if out_dir == src or out_dir.startswith(src.rstrip(os.sep) + os.sep):
                raise PrepareError(f"--out {shown_out}: is inside {flag} {spec}; "
                                   f"choose an output directory outside the input")

    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise PrepareError(f"--out {shown_out}: cannot create {parent}: "
                           f"{fetch._os_reason(exc)}") from None
    # the temporary directory goes next to DIR (same file system, whole-dir
    # rename); inside DIR when only DIR is writable (say --out . in $HOME)
    if os.access(parent, os.W_OK | os.X_OK):
        work_parent = parent
    elif os.path.isdir(out_dir) and os.access(out_dir, os.W_OK | os.X_OK):
        work_parent = out_dir
    else:
        raise PrepareError(f"--out {shown_out}: {parent} is not writable")

    with _Lock(parent):
        state, old = _read_old_manifest(out_dir)
        if not force:
            if state == "ours" and old.get("request") == request:
                problems = mf.verify(out_dir, old)
                if not problems:
                    return Result("up-to-date", out_dir, old)
                # same request, damaged output: rebuild it (it is ours)
            elif state == "ours":
                raise PrepareError(f"--out {shown_out}: holds MANIFEST.json of a different "
                                   f"preparation ({_difference(old, request)}); use --force "
                                   f"to replace it")
            elif state == "invalid":
                raise PrepareError(f"--out {shown_out}: holds a MANIFEST.json that prepare.py "
                                   f"cannot read; use --force to replace it")
            elif os.path.isdir(out_dir) and any(OUR_NAMES.match(x) for x in os.listdir(out_dir)):
                raise PrepareError(f"--out {shown_out}: holds shard files but no MANIFEST.json "
                                   f"(an interrupted run?); use --force to replace them")
        work = tempfile.mkdtemp(prefix=f".{name}.prepare-", dir=work_parent)
        try:
            return _build(work, out_dir, request, input=input, sample=sample, strategy=strategy,
                          test=test, build_dict=build_dict, min_freq=min_freq, n=n,
                          progress=progress, limits=limits)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _build(work, out_dir, request, *, input, sample, strategy, test, build_dict, min_freq, n,
           progress, limits) -> Result:
    src = os.path.join(work, "src")
    stage = os.path.join(work, "out")
    os.mkdir(src)
    os.mkdir(stage)
    facts: dict = {}
    if sample:
        tr_path, te_path = sm.write_sample(src)
        train = fetch.InputSet([tr_path], [os.path.getsize(tr_path)], sm.describe(sm.DEFAULTS))
        test_inp = fetch.InputSet([te_path], [os.path.getsize(te_path)], sm.describe(sm.DEFAULTS))
        what, test_what = "--sample", "--sample (test)"
    else:
        train, test_inp, facts = fetch.materialize(input, src, "--input",
                                                   progress_enabled=progress, limits=limits)
        what = f"--input {input}"
        test_what = f"--input {input} (test file)"
        if test:
            test_inp = fetch.local_input(test, "--test")
            test_what = f"--test {test}"
    # check both inputs before writing anything
    for inp, w in ((train, what), (test_inp, test_what)):
        if inp is None:
            continue
        if inp.total_bytes == 0:
            raise PrepareError(f"{w}: empty input")
        if strategy == "files" and inp.is_dir:
            if len(inp.files) < n:
                raise PrepareError(f"{w}: {len(inp.files)} files, fewer than the {n} shards asked "
                                   f"for (strategy files gives each shard whole files)")
        else:
            require_lines(Stream(inp), n, w)

    files: dict = {}
    used, res = st.split(strategy, train, n, stage, mf.TRAIN_BASE, "train", what,
                         progress_enabled=progress, label="splitting train")
    for r in res:
        files[r.name] = r.entry()
    test_used = None
    if test_inp is not None:
        test_used, res = st.split(strategy, test_inp, n, stage, mf.TEST_BASE, "test", test_what,
                                  progress_enabled=progress, label="splitting test")
        for r in res:
            files[r.name] = r.entry()
    dictionary = None
    if build_dict:
        dpath = os.path.join(stage, mf.DICT_NAME)
        wd = write_word_dict(Stream(train), dpath, min_freq, progress_enabled=progress)
        files[mf.DICT_NAME] = describe_file(dpath, mf.DICT_NAME, "dict").entry()
        dictionary = {"min_freq": min_freq, "words": len(wd), "built_from": "train"}
    manifest = {
        "version": mf.VERSION,
        "created_by": "fabtrain prepare.py",
        "strategy": used,
        "test_strategy": test_used,
        "split_count": n,
        "synthetic": bool(sample),
        "source": train.description,
        "test_source": test_inp.description if test_inp is not None else None,
        **facts,
        "dictionary": dictionary,
        "request": request,
        "files": files,
    }
    _install(stage, out_dir, manifest)
    return Result("written", out_dir, manifest)
