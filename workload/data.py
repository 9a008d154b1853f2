"""The data prepare.py writes, and the batches the trainers read from it.

A data dir holds train.txt-00000, train.txt-00001, ... and test.txt-00000, ...
(plain text, one sentence a line, words separated by spaces; bytes that are
not UTF-8 are decoded as U+FFFD), word_dict.json (word -> id, with <unk>, <s>,
<e>) and MANIFEST.json.

Which files a process reads:
* a PS trainer I of T reads the files whose numeric suffix is I mod T
  (PaddlePaddle's rule), for train and for test, so a node only needs the
  files of its own trainers;
* a collective rank r of W does the same when there are at least W files,
  else it reads every file and keeps the lines whose index is r mod W.
"""
import json
import math
import re
from pathlib import Path

import torch

from workload.config import UsageError

SHARD_NAME = re.compile(r"^(train|test)\.txt-(\d+)$")
SPECIAL_WORDS = ("<unk>", "<s>", "<e>")


def list_shards(data_dir, split):
    """[(suffix, path)] of the `split` ("train" or "test") files in data_dir, by suffix."""
    found = []
    for path in Path(data_dir).iterdir():
        m = SHARD_NAME.match(path.name)
        if m and m.group(1) == split and path.is_file():
            found.append((int(m.group(2)), path))
    return sorted(found)


def shards_for(shards, index, count):
    """PaddlePaddle's rule: process `index` of `count` reads the files whose suffix is index mod count."""
    return [path for suffix, path in shards if suffix % count == index]


def collective_sources(data_dir, split, rank, world_size, local_rank=0, local_size=1):
    """(paths, line_shard) for a collective rank: its own files, or every file and a line shard.

    Where this node holds only some of the data set's files (`fab copy-data` gives each node its
    trainers' shards), those are its ranks' to read, split among them by local rank: in a smaller world
    (a node lost under min_nodes, the first one included) rank r of W need not be the trainer the node's
    files were copied for, and the shards of the node that left are not read. Where it holds every file
    (shared data, a spare), rank r of W reads the files whose suffix is r mod W."""
    shards = list_shards(data_dir, split)
    total = shard_count(data_dir, split, shards)
    if 0 < len(shards) < total and len(shards) >= local_size:
        return [path for _, path in shards][local_rank::local_size], None
    if total >= world_size:
        return shards_for(shards, rank, world_size), None
    return [path for _, path in shards], (rank, world_size)


def shard_count(data_dir, split, shards):
    """How many `split` files the whole data set has: from MANIFEST.json ("files" entries of that
    kind) when it can be read, else what is here (suffixes start at 0: the highest suffix + 1)."""
    try:
        manifest = json.loads((Path(data_dir) / "MANIFEST.json").read_text())
        return sum(1 for entry in manifest["files"].values() if entry.get("kind") == split)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return shards[-1][0] + 1 if shards else 0


def read_sentences(paths, line_shard=None):
    """Sentences (lists of words) of the files, in order; with line_shard=(r, W) only lines r mod W."""
    sentences, line_no = [], 0
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                words = line.split()
                if not words:
                    continue
                if line_shard is None or line_no % line_shard[1] == line_shard[0]:
                    sentences.append(words)
                line_no += 1
    return sentences


def load_word_dict(data_dir):
    path = Path(data_dir) / "word_dict.json"
    try:
        word_dict = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    if not isinstance(word_dict, dict) or not all(isinstance(v, int) and v >= 0 for v in word_dict.values()):
        raise UsageError(f"{path} is not a JSON object of word -> non-negative integer id")
    missing = [w for w in SPECIAL_WORDS if w not in word_dict]
    if missing:
        raise UsageError(f"{path} lacks {', '.join(missing)}")
    return word_dict


def vocab_size(word_dict):
    return max(word_dict.values()) + 1


def encode(sentences, word_dict):
    """Sentences as int64 id tensors; unknown words become <unk>."""
    unk = word_dict["<unk>"]
    return [torch.tensor([word_dict.get(w, unk) for w in words], dtype=torch.long) for words in sentences]


def derive_seed(*parts):
    """One 63-bit seed from several integers (seed, rank, step...), the same in every process."""
    seed = 0x5EED
    for part in parts:
        seed = (seed * 1_000_003 + int(part) + 1) % (1 << 63)
    return seed


class BatchStream:
    """Batches of a fixed example tensor, in an order that depends only on (seed, rank, pass).

    Global step s is batch s % per_epoch of pass s // per_epoch, so a trainer
    that resumes at step s reads exactly the batches it would have read.
    """

    def __init__(self, examples, batch_size, seed, rank, per_epoch=None):
        self.examples, self.batch_size, self.seed, self.rank = examples, batch_size, seed, rank
        # Collective ranks agree on one (the smallest) number of batches a pass: see ddp.py.
        self.per_epoch = per_epoch or math.ceil(len(examples) / batch_size)
        self._order = (None, None)

    def position(self, step):
        return divmod(step, self.per_epoch)   # (epoch, index within the epoch)

    def rows(self, step):
        epoch, index = self.position(step)
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(derive_seed(self.seed, self.rank, epoch))
            self._order = (epoch, torch.randperm(len(self.examples), generator=g))
        picked = self._order[1][index * self.batch_size:(index + 1) * self.batch_size]
        return self.examples[picked]

    def generator(self, step):
        """The random generator of step `step` (negative sampling), also reproduced on resume."""
        return torch.Generator().manual_seed(derive_seed(self.seed, self.rank, step, 7))


def eval_batches(examples, batch_size):
    """Every test example exactly once, in order: no shuffling, no padding."""
    for start in range(0, len(examples), batch_size):
        yield start // batch_size, examples[start:start + batch_size]


def load_examples(model, paths, word_dict, line_shard=None):
    """The model's example tensor for these files."""
    return model.make_examples(encode(read_sentences(paths, line_shard), word_dict), word_dict)
