"""A small deterministic corpus in prepare.py's layout, for tests, demos and the benchmark.

    python -m workload.sample DIR [--vocab 200] [--train_shards 4] [--test_shards 2] [--sentences 40]

Words are w0, w1, ... drawn from a Zipf distribution, with a bigram habit
(a word is often followed by the same successor) so that the language models
have something to learn. word_dict.json lists every word (id = rank) and
then <s>, <e>, <unk>. The first line of train.txt-00000 holds a byte that is
not UTF-8, as real crawls do.
"""
import argparse
import hashlib
import json
import random
from itertools import accumulate
from pathlib import Path


def write_sample_corpus(directory, vocab=200, train_shards=4, test_shards=2, sentences=40,
                        test_sentences=None, seed=0, min_len=3, max_len=20, bad_bytes=True):
    """Write the corpus into `directory`; returns the word dict. `test_sentences` may be a list,
    one count per test shard (uneven test sets)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cumulative = list(accumulate(1.0 / (k + 1) for k in range(vocab)))
    successor = [rng.randrange(vocab) for _ in range(vocab)]

    def sentence():
        words = rng.choices(range(vocab), cum_weights=cumulative, k=1)
        for _ in range(rng.randint(min_len, max_len) - 1):
            follow = rng.random() < 0.6
            words.append(successor[words[-1]] if follow else rng.choices(range(vocab), cum_weights=cumulative)[0])
        return " ".join(f"w{w}" for w in words)

    if test_sentences is None:
        test_sentences = [max(1, sentences // 4)] * test_shards
    elif isinstance(test_sentences, int):
        test_sentences = [test_sentences] * test_shards
    files = {}

    def write(name, data, **entry):
        (directory / name).write_bytes(data)
        files[name] = dict(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), lines=data.count(b"\n"),
                           **entry)

    for split, counts in (("train", [sentences] * train_shards), ("test", test_sentences)):
        for shard, count in enumerate(counts):
            lines = [sentence().encode() for _ in range(count)]
            if split == "train" and shard == 0 and bad_bytes and lines:
                lines[0] = lines[0] + b" w\xff1 w2"
            write(f"{split}.txt-{shard:05d}", b"".join(line + b"\n" for line in lines), kind=split, shard=shard)
    word_dict = {f"w{i}": i for i in range(vocab)}
    word_dict.update({"<s>": vocab, "<e>": vocab + 1, "<unk>": vocab + 2})
    write("word_dict.json", json.dumps(word_dict).encode(), kind="dict")
    # The shape of prepare.py's MANIFEST.json (version 1), so fabtrain's tools accept this corpus too.
    manifest = {"version": 1, "created_by": "workload.sample", "strategy": "generated",
                "test_strategy": "generated", "split_count": train_shards, "synthetic": True,
                "source": f"workload.sample seed {seed}", "dictionary": {"words": len(word_dict)}, "files": files}
    (directory / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return word_dict


def main():
    p = argparse.ArgumentParser(prog="workload.sample", description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--vocab", type=int, default=200)
    p.add_argument("--train_shards", type=int, default=4)
    p.add_argument("--test_shards", type=int, default=2)
    p.add_argument("--sentences", type=int, default=40, help="sentences per train shard")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write_sample_corpus(a.directory, a.vocab, a.train_shards, a.test_shards, a.sentences, seed=a.seed)
    print(f"wrote a {a.vocab}-word corpus to {a.directory}")


if __name__ == "__main__":
    main()
