"""The word dictionary: ``word_dict.json``.

Words are whitespace-separated byte tokens (``bytes.split()``: space, tab,
CR, LF, VT, FF).  Counting is done on raw bytes; a token is turned into a
JSON key by decoding it as UTF-8 with ``errors="surrogateescape"``, so a
byte that is not UTF-8 becomes a lone surrogate U+DC80..U+DCFF, written in
the file as the JSON escape ``\\udcXX``.  ``key.encode("utf-8",
"surrogateescape")`` gives the original bytes back (see load_word_dict).

Ids: every entry's id is its rank by (count descending, token bytes
ascending).  The special tokens are always present:

* ``<s>`` and ``<e>`` count once per line (as PaddlePaddle's imikolov
  reader does), plus any literal occurrences;
* ``<unk>`` counts every token dropped by ``--min-freq`` plus any literal
  ``<unk>`` in the text (the Penn Treebank has many).

Words seen fewer than min_freq times are left out (they map to ``<unk>``).
The dictionary is built from the training input only.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from .progress import Progress

UNK, BOS, EOS = "<unk>", "<s>", "<e>"
SPECIALS = (UNK, BOS, EOS)
_SPECIAL_BYTES = {s.encode(): s for s in SPECIALS}


def count_tokens(blocks, progress=None) -> tuple[Counter, int]:
    """Token counts (bytes keys) and the number of lines of a block stream."""
    counts: Counter = Counter()
    lines = 0
    carry = b""
    for block in blocks:
        if progress is not None:
            progress.update(len(block))
        data = carry + block if carry else block
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            carry = data
            continue
        body = data[:cut] if cut < len(data) else data
        carry = data[cut:]
        counts.update(body.split())
        lines += body.count(b"\n")
    if carry:
        counts.update(carry.split())
        lines += 1
    return counts, lines


def build_word_dict(counts: Counter, lines: int, min_freq: int = 1) -> dict[str, int]:
    """word -> id as described in the module docstring."""
    if min_freq < 1:
        raise ValueError("min_freq must be >= 1")
    special = {b: counts.get(b, 0) for b in _SPECIAL_BYTES}
    special[b"<s>"] += lines
    special[b"<e>"] += lines
    kept = []
    dropped = 0
    for tok, c in counts.items():
        if tok in special:
            continue
        if c >= min_freq:
            kept.append((tok, c))
        else:
            dropped += c
    special[b"<unk>"] += dropped
    kept.extend(special.items())
    kept.sort(key=lambda tc: (-tc[1], tc[0]))
    return {tok.decode("utf-8", "surrogateescape"): i for i, (tok, _c) in enumerate(kept)}


def dumps_word_dict(word_dict: dict[str, int]) -> bytes:
    """JSON text, one entry a line in id order; UTF-8 where the word is
    UTF-8 and ``\\udcXX`` escapes for raw bytes."""
    items = sorted(word_dict.items(), key=lambda kv: kv[1])
    body = ",\n".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in items)
    text = "{\n" + body + "\n}\n" if items else "{}\n"
    return text.encode("utf-8", "backslashreplace")


def load_word_dict(path: str, as_bytes: bool = False) -> dict:
    """Load word_dict.json (plain JSON: no code runs).  With as_bytes the
    keys are the raw token bytes."""
    with open(path, "rb") as f:
        d = json.loads(f.read().decode("utf-8"))
    if as_bytes:
        return {k.encode("utf-8", "surrogateescape"): v for k, v in d.items()}
    return d


def write_word_dict(stream, path: str, min_freq: int, *, progress_enabled: bool = True
                    ) -> dict[str, int]:
    """Count the stream, write the dictionary to path (new file, fsynced)."""
    with Progress("counting words", stream.size, enabled=progress_enabled) as bar:
        counts, lines = count_tokens(stream.iter_blocks(16 << 20), bar)
    wd = build_word_dict(counts, lines, min_freq)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(dumps_word_dict(wd))
        f.flush()
        os.fsync(f.fileno())
    return wd
