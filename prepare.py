#!/usr/bin/env python3
"""prepare.py: fetch or generate a corpus, build word_dict.json, and split
train/test data into one shard per trainer (train.txt-00000, ...), with a
MANIFEST.json of checksums.  See docs/data.md.

    python prepare.py --input simple-examples.tgz --out data/imikolov --split-count 4
    python prepare.py --sample --out data/sample --split-count 2

The work is done by fabtrain.data: this file is its command line
(``fabtrain.data.cli.main``); ``fab split-data`` calls ``fabtrain.data.prepare``
in-process with the cluster's settings.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from fabtrain.data.cli import main  # noqa: E402
from fabtrain.data.errors import PrepareError  # noqa: E402

__all__ = ["main", "cluster_trainers"]


def cluster_trainers() -> int:
    """--split-count's default: the trainers of the cluster file ($FABTRAIN_CLUSTER or ./cluster.yaml)."""
    try:
        from fabtrain.config.cluster import load_cluster
        from fabtrain.errors import UserError
    except ImportError as exc:
        raise PrepareError(f"--split-count not given and the cluster file cannot be read "
                           f"({exc}); give --split-count N") from None
    try:
        cluster = load_cluster(None)
    except UserError as exc:
        raise PrepareError(f"--split-count not given and {exc}") from None
    if cluster.trainer_count < 1:
        raise PrepareError("--split-count not given and the cluster has no trainers; give --split-count N")
    return cluster.trainer_count


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt  # unwinds, so the temporary directory is removed


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main(sys.argv[1:], split_count_default=cluster_trainers))
