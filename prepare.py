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

__all__ = ["main"]


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt  # unwinds, so the temporary directory is removed


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main(sys.argv[1:]))
