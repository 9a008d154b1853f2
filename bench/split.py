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
also computes every shard's sha256 and line count, fsyncs every file and
writes MANIFEST.json.  So the table also shows, as references measured in
the same run:

* ``split+sync``: GNU split, then ``sync FILES`` (its outputs made durable);
* ``split+sha+sync``: that plus the sha256 of every output, one
  ``openssl dgst -sha256`` per file, all at once (OpenSSL uses the CPU's SHA
  instructions; coreutils' sha256sum may not, and would flatter us) -- what
  a user runs to get what prepare.py writes (shards, their checksums, on
  disk), less the line counts;
* two floors for the contiguous strategy: sha256 of the corpus in one
  thread, and the kernel copy of the same byte ranges plus fsync with no
  checksum at all.  Either one alone is longer than ``split -n l/N`` on a
  small machine, which is why the issue's ratio <= 1.0 against bare split
  cannot be met while the manifest holds checksums and files are durable.

Targets: contiguous ratio (prepare / split) <= 1.0 (and, restated, <= 1.0
against split+sha+sync), round-robin <= 1.5.  Everything is deleted at the
end.
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


def hash_all(files) -> float:
    """sha256 of every file, one process per file, all at once."""
    tool = ["openssl", "dgst", "-sha256"] if shutil.which("openssl") else ["sha256sum"]
    t = time.perf_counter()
    procs = [subprocess.Popen([*tool, f], stdout=subprocess.DEVNULL) for f in files]
    if any(p.wait() for p in procs):
        sys.exit(f"bench: {' '.join(tool)} failed")
    return time.perf_counter() - t


def copy_and_fsync(corpus: str, out: str, n: int) -> float:
    """The floor of a durable contiguous split: the same byte ranges
    (cut at line ends) copied by the kernel, in n threads, and fsynced --
    no checksum, no line count."""
    from concurrent.futures import ThreadPoolExecutor
    size = os.path.getsize(corpus)
    with open(corpus, "rb") as f:
        cuts = [0]
        for k in range(1, n):
            f.seek(k * size // n)
            f.readline()
            cuts.append(f.tell())
        cuts.append(size)

    def one(k):
        src = os.open(corpus, os.O_RDONLY)
        dst = os.open(os.path.join(out, f"x{k}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            off, end = cuts[k], cuts[k + 1]
            while off < end:
                off += os.copy_file_range(src, dst, end - off, off)
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)

    t = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - t


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
        tools = ("split", "prepare", "split+sync", "split+sha+sync")
        for strategy, mode in (("contiguous", "l"), ("round-robin", "r")):
            best = {tool: float("inf") for tool in tools}
            for i in range(args.repeat):
                for tool in tools:
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
                        files = sorted(os.path.join(out, f) for f in os.listdir(out))
                        if tool == "split+sha+sync":
                            dt += hash_all(files)
                        if tool != "split":
                            dt += timed(["sync", *files], work)
                    best[tool] = min(best[tool], dt)
                    shutil.rmtree(out)
            results[strategy] = best
        floor_copy = float("inf")
        for i in range(args.repeat):
            out = os.path.join(work, f"out-floor-{i}")
            os.mkdir(out)
            floor_copy = min(floor_copy, copy_and_fsync(corpus, out, args.n))
            shutil.rmtree(out)
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
        print(f"{'strategy':<12} {'GNU split':>10} {'split+sync':>11} {'split+sha+sync':>15} "
              f"{'prepare.py':>11} {'ratio':>7} {'target':>7}  result")
        ok = True
        for strategy, target in (("contiguous", 1.0), ("round-robin", 1.5)):
            b = results[strategy]
            ratio = b["prepare"] / b["split"]
            good = ratio <= target
            ok &= good
            print(f"{strategy:<12} {b['split']:>9.2f}s {b['split+sync']:>10.2f}s "
                  f"{b['split+sha+sync']:>14.2f}s {b['prepare']:>10.2f}s {ratio:>7.2f} "
                  f"{target:>7.2f}  {'met' if good else 'MISSED'}")
        b = results["contiguous"]
        like = b["prepare"] / b["split+sha+sync"]
        print(f"{'contiguous, against split+sha+sync (restated target <= 1.00)':<62} "
              f"{like:>5.2f}  {'met' if like <= 1.0 else 'MISSED'}")
        print("\nratio = prepare.py / GNU split (lower is better)")
        print(f"floors of the contiguous strategy, same run: sha256 of the whole corpus in one "
              f"thread (python hashlib) {sha_best:.2f}s, over {os.cpu_count()} CPUs at best {sha_best / (os.cpu_count() or 1):.2f}s; kernel copy of the same ranges + fsync, "
              f"no checksum {floor_copy:.2f}s; GNU split -n l/{args.n} {b['split']:.2f}s")
        print(f"load average at the end: {_load()} (other work on the machine slows both tools)")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
