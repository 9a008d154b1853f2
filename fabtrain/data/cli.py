"""The command line of prepare.py (``main(argv) -> int``)."""

from __future__ import annotations

import argparse
import sys

from .archive import DEFAULT_MAX_EXPANSION, DEFAULT_MAX_EXTRACT_MB, ExtractLimits
from .errors import PrepareError
from .strategies import STRATEGIES

PROG = "prepare.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message):           # one line, no usage dump
        raise PrepareError(message)

    def exit(self, status=0, message=None):
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


class _Exit(Exception):
    def __init__(self, status):
        self.status = status


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=(
        "Prepare training data for distributed training: fetch or generate a corpus, "
        "build word_dict.json, split train and test data into shards "
        "train.txt-00000 ... (trainer k of M reads the shards whose suffix mod M is k), "
        "and write MANIFEST.json with every file's sha256, size and line count."))
    src = p.add_argument_group("input")
    src.add_argument("--input", metavar="PATH_OR_URL",
                     help="a text file, a directory of files, a tarball, or a URL "
                          "(http, https, ftp, file) of either; the imikolov "
                          "simple-examples.tgz layout is recognised")
    src.add_argument("--sample", action="store_true",
                     help="write a small deterministic SYNTHETIC corpus instead (demo)")
    src.add_argument("--test", metavar="PATH",
                     help="test data (file or directory) to split the same way; "
                          "default: the tarball's ptb.test.txt, if any")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory")
    p.add_argument("--split-count", metavar="N", type=int, default=None,
                   help="number of shards (default: the number of trainers in the "
                        "cluster file, $FABTRAIN_CLUSTER or ./cluster.yaml)")
    p.add_argument("--strategy", choices=STRATEGIES, default="contiguous",
                   help="contiguous (byte ranges at line boundaries, default), "
                        "round-robin (line i -> shard i mod N), files (file i -> shard i mod N)")
    p.add_argument("--no-dict", action="store_true", help="do not build word_dict.json")
    p.add_argument("--min-freq", metavar="K", type=int, default=None,
                   help="leave out words seen fewer than K times (default 1)")
    p.add_argument("--max-extract-mb", metavar="MB", type=int, default=None,
                   help=f"refuse a tarball that extracts to more than MB MiB "
                        f"(default {DEFAULT_MAX_EXTRACT_MB})")
    p.add_argument("--max-expansion", metavar="X", type=float, default=None,
                   help=f"refuse a tarball that extracts to more than X times its own size "
                        f"(default {DEFAULT_MAX_EXPANSION}; the first MiB is always allowed)")
    p.add_argument("--force", action="store_true",
                   help="replace an output directory prepared from other inputs or options")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress and no summary")
    return p


def _no_split_count() -> int:
    raise PrepareError("--split-count N is required")


def main(argv=None, split_count_default=_no_split_count) -> int:
    """Run prepare.py with argv (default sys.argv[1:]); return the exit
    status (0 done or up to date, 2 bad input, 1 I/O failure, 130
    interrupted).  Never raises for those; safe to call in-process.

    split_count_default: called for the shard count when --split-count is not
    given (prepare.py reads the cluster file's trainers: data preparation
    itself never imports the cluster config); it raises PrepareError to refuse."""
    from .pipeline import prepare

    if argv is None:
        argv = sys.argv[1:]
    try:
        args = build_parser().parse_args(list(argv))
        if args.no_dict and args.min_freq is not None:
            raise PrepareError("--min-freq has no effect with --no-dict")
        if args.max_extract_mb is not None and args.max_extract_mb < 1:
            raise PrepareError(f"--max-extract-mb {args.max_extract_mb}: must be at least 1")
        if args.max_expansion is not None and not args.max_expansion >= 1:
            raise PrepareError(f"--max-expansion {args.max_expansion:g}: must be at least 1")
        n = args.split_count if args.split_count is not None else split_count_default()
        result = prepare(args.out, n, input=args.input, sample=args.sample,
                         strategy=args.strategy, test=args.test, build_dict=not args.no_dict,
                         min_freq=args.min_freq if args.min_freq is not None else 1,
                         force=args.force, progress=not args.quiet,
                         limits=ExtractLimits.from_mb(args.max_extract_mb, args.max_expansion))
    except _Exit as exc:
        return exc.status
    except PrepareError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (temporary files removed)", file=sys.stderr)
        return 130
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{PROG}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{PROG}: {result.summary()}")
    return 0
