"""A small deterministic synthetic corpus for the demo (``--sample``).

It is NOT real text: made-up words drawn from a Zipf-like distribution
(weight ~ 1/rank**1.1) over a vocabulary of a few thousand words, with a
little bigram structure (after a word, one of its two fixed successors
follows 40% of the time) so that a language model has something to learn
beyond word frequencies and its loss visibly drops within a minute on a
CPU.  The generator is a self-contained 64-bit PRNG (splitmix64) with
integer arithmetic only, so the bytes are the same on every machine and
every Python version.
"""

from __future__ import annotations

import bisect
import os

GENERATOR_VERSION = 1
DEFAULTS = {"seed": 1, "train_lines": 4000, "test_lines": 400, "vocab": 3000}
_MASK = (1 << 64) - 1
_CONS = "bdfghklmnprstvz"
_VOWELS = "aeiou"


class _Rng:
    def __init__(self, seed: int):
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


def vocabulary(size: int, rng: _Rng) -> list[str]:
    """size distinct made-up words; frequent (low rank) words are short."""
    syll = [c + v for c in _CONS for v in _VOWELS]          # 75 syllables
    for i in range(len(syll) - 1, 0, -1):                   # Fisher-Yates
        j = rng.below(i + 1)
        syll[i], syll[j] = syll[j], syll[i]
    words = []
    r = 0
    length = 1
    while len(words) < size:
        cap = len(syll) ** length
        if r >= cap:
            r -= cap
            length += 1
            continue
        x, parts = r, []
        for _ in range(length):
            x, d = divmod(x, len(syll))
            parts.append(syll[d])
        words.append("".join(parts))
        r += 1
    return words


def generate(seed: int = 1, train_lines: int = 4000, test_lines: int = 400,
             vocab: int = 3000) -> tuple[bytes, bytes]:
    """(train text, test text), each a line a sentence, newline-terminated."""
    rng = _Rng(seed)
    words = vocabulary(vocab, rng)
    scale = 1 << 40
    cum, acc = [], 0
    for r in range(vocab):
        acc += int(scale / (r + 1) ** 1.1) + 1
        cum.append(acc)
    succ = [(rng.below(vocab), rng.below(vocab)) for _ in range(vocab)]

    def sentence() -> str:
        n = 6 + rng.below(19)
        out, prev = [], -1
        for _ in range(n):
            if prev >= 0 and rng.below(10) < 4:
                w = succ[prev][rng.below(2)]
            else:
                w = bisect.bisect_right(cum, rng.below(acc))
            out.append(words[w])
            prev = w
        return " ".join(out)

    train = "".join(sentence() + "\n" for _ in range(train_lines)).encode()
    test = "".join(sentence() + "\n" for _ in range(test_lines)).encode()
    return train, test


def describe(params: dict) -> str:
    return (f"synthetic Zipf sample (seed {params['seed']}: {params['train_lines']} train + "
            f"{params['test_lines']} test lines, {params['vocab']}-word vocabulary; not real text)")


def write_sample(dest_dir: str, params: dict | None = None) -> tuple[str, str]:
    """Write train.txt and test.txt under dest_dir; return their paths."""
    p = dict(DEFAULTS, **(params or {}))
    train, test = generate(p["seed"], p["train_lines"], p["test_lines"], p["vocab"])
    paths = []
    for name, data in (("sample-train.txt", train), ("sample-test.txt", test)):
        path = os.path.join(dest_dir, name)
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths[0], paths[1]
