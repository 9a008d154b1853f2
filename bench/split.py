#!/usr/bin/env python3
"""Benchmark: prepare.py --no-dict against GNU split, in the same run.

    python bench/split.py                 # ~1 GiB corpus, N=4, best of 3
    python bench/split.py --size-mb 64    # quicker

Generates a text corpus (Penn-Treebank-like lines: 5-40 words, ~110 bytes)
in a temporary directory, then for each strategy times, best of --repeat,
interleaved:

* contiguous:   ``split -n l/N``  vs  ``prepare.py --strategy contiguous``
* round-robin:  ``split -n r/N``  vs  ``prepare.py --strategy round-robin``

Every run writes into a fresh directory next to the corpus (same file
system); removing it is not timed.  The corpus stays in the page cache for
every run (both tools read it warm).  prepare.py does more than split: it
also reads every shard back for its sha256 and line count, fsyncs every
file and writes MANIFEST.json.  For reference the table also shows GNU split
followed by ``sync FILES`` (fsync of its outputs), which is not a target.

Targets: contiguous ratio (prepare / split) <= 1.0, round-robin <= 1.5.
Everything is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPARE = os.path.join(REPO, "prepare.py")


def make_corpus(path: str, size: int, seed: int = 7) -> int:
    """Write about size bytes of text; return the exact size."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
             for _ in range(10000)]
    cum, acc = [], 0.0
    for r in range(len(vocab)):
        acc += 1.0 / (r + 1)
        cum.append(acc)
    block_lines = []
    n = 0
    target = min(size, 32 << 20)
    while n < target:
        line = " ".join(rng.choices(vocab, cum_weights=cum, k=rng.randint(5, 40))) + "\n"
        block_lines.append(line)
        n += len(line)
    block = "".join(block_lines).encode()
    written = 0
    with open(path, "wb") as f:
        while written + len(block) <= size:
            f.write(block)
            written += len(block)
        rest = block[:size - written]
        rest = rest[:rest.rfind(b"\n") + 1]
        f.write(rest)
        written += len(rest)
    return written


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def timed(cmd, cwd) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed: {r.stderr.decode(errors='replace').strip()}")
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="corpus size in MiB (default 1024)")
    ap.add_argument("--n", type=int, default=4, help="shards (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool, best taken (default 3)")
    ap.add_argument("--dir", default=None, help="where the temporary directory goes (default $TMPDIR)")
    args = ap.parse_args(argv)
    split_bin = shutil.which("split")
    if not split_bin:
        sys.exit("bench: GNU split not found")
    version = subprocess.run([split_bin, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    work = tempfile.mkdtemp(prefix="fabtrain-bench-split-", dir=args.dir)
    try:
        corpus = os.path.join(work, "corpus.txt")
        t = time.perf_counter()
        size = make_corpus(corpus, args.size_mb << 20)
        print(f"load average before: {_load()}")
        print(f"corpus: {size / 1048576:.0f} MiB, "
              f"{sum(1 for _ in open(corpus, 'rb')) if size < (64 << 20) else 'many'} lines, "
              f"made in {time.perf_counter() - t:.1f}s; N={args.n}, best of {args.repeat}; {version}; "
              f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
        results = {}
        for strategy, mode in (("contiguous", "l"), ("round-robin", "r")):
            best = {"split": float("inf"), "split+sync": float("inf"), "prepare": float("inf")}
            for i in range(args.repeat):
                for tool in ("split", "prepare", "split+sync"):
                    out = os.path.join(work, f"out-{tool}-{i}")
                    os.mkdir(out)
                    if tool == "prepare":
                        cmd = [sys.executable, PREPARE, "--input", corpus, "--out", out,
                               "--split-count", str(args.n), "--strategy", strategy,
                               "--no-dict", "--quiet", "--force"]
                        dt = timed(cmd, work)
                    else:
                        dt = timed([split_bin, "-n", f"{mode}/{args.n}", corpus,
                                    os.path.join(out, "x")], work)
                        if tool == "split+sync":
                            files = sorted(os.path.join(out, f) for f in os.listdir(out))
                            dt += timed(["sync", *files], work)
                    best[tool] = min(best[tool], dt)
                    shutil.rmtree(out)
            results[strategy] = best
        # the floor of any tool that checksums every byte: sha256 of the corpus
        import hashlib
        sha_best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            h = hashlib.sha256()
            with open(corpus, "rb", buffering=0) as f:
                for block in iter(lambda: f.read(8 << 20), b""):
                    h.update(block)
            sha_best = min(sha_best, time.perf_counter() - t)
        print()
        print(f"{'strategy':<12} {'GNU split':>10} {'split+sync':>11} {'prepare.py':>11} "
              f"{'ratio':>7} {'target':>7}  result")
        ok = True
        for strategy, target in (("contiguous", 1.0), ("round-robin", 1.5)):
            b = results[strategy]
            ratio = b["prepare"] / b["split"]
            good = ratio <= target
            ok &= good
            print(f"{strategy:<12} {b['split']:>9.2f}s {b['split+sync']:>10.2f}s "
                  f"{b['prepare']:>10.2f}s {ratio:>7.2f} {target:>7.2f}  "
                  f"{'met' if good else 'MISSED'}")
        print("\nratio = prepare.py / GNU split (lower is better); split+sync is for reference")
        print(f"reference: sha256 of the whole corpus in one thread (python hashlib): "
              f"{sha_best:.2f}s")
        print(f"load average at the end: {_load()} (other work on the machine slows both tools)")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
