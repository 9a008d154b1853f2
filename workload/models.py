"""The three models, and how each turns sentences into examples and batches.

* word2vec: skip-gram or CBOW with negative sampling. Two embedding tables
  (input and output vectors), both sparse: a batch touches a few hundred rows.
* ngram: the N-gram neural language model of PaddlePaddle's imikolov example:
  N-1 context words through one shared embedding (sparse), a sigmoid hidden
  layer and a dense softmax over the vocabulary.
* mlp: a dense classifier, for the dense path. Its input is a hashed bag of
  words of a sentence (word id mod F, counted) and its label the sentence's
  length bucket (length // 4, at most 7): built from the same text shards,
  deterministic, and learnable, so the loss visibly falls.

Every model keeps its tables as TableSpecs (tables.py): `remote=True` gives
RowTables (PS trainer), else nn.Embedding. Examples are one int64 tensor a
model (one example a row); `make_batch` turns rows into named tensors,
drawing any randomness from the generator it is given. `forward` returns the
loss of each example, so training takes the mean and evaluation the sum.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from workload.tables import TableSpec, make_table

# The optimiser and sizes each model trains with unless flags say otherwise.
DEFAULTS = {
    "word2vec": dict(optimizer="adagrad", lr=0.1, emb_dim=64, hidden=0),
    "ngram": dict(optimizer="adagrad", lr=0.05, emb_dim=32, hidden=256),
    "mlp": dict(optimizer="adagrad", lr=0.05, emb_dim=0, hidden=256),
}


def hyperparameters(args):
    """The model's defaults, overridden by the flags that were given."""
    hp = dict(DEFAULTS[args.model])
    for name in hp:
        if getattr(args, name, None) is not None:
            hp[name] = getattr(args, name)
    return hp


def log_uniform(num, vocab_size, generator):
    """Negative samples: P(k) ~ log((k+2)/(k+1)), which favours frequent (low) ids as in Zipf text."""
    u = torch.rand(num, generator=generator, dtype=torch.float64)
    ids = torch.exp(u * math.log(vocab_size + 1)).long() - 1
    return ids.clamp_(0, vocab_size - 1)


def _concat(sentences):
    """All ids in one tensor, and the sentence index of each id."""
    if not sentences:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    ids = torch.cat(sentences)
    owner = torch.repeat_interleave(torch.arange(len(sentences)), torch.tensor([len(s) for s in sentences]))
    return ids, owner


class Word2Vec(nn.Module):
    def __init__(self, vocab_size, emb_dim, mode="skipgram", window=2, negatives=5,
                 seed=0, remote=False, sparse_grad=False, **_):
        super().__init__()
        self.vocab_size, self.mode, self.window, self.negatives = vocab_size, mode, window, negatives
        # word2vec's own initialisation: small random input vectors, zero output vectors.
        self.table_specs = [TableSpec("emb_in", vocab_size, emb_dim, 0.5 / emb_dim, seed),
                            TableSpec("emb_out", vocab_size, emb_dim, 0.0, seed)]
        self.emb_in = make_table(self.table_specs[0], remote, sparse_grad)
        self.emb_out = make_table(self.table_specs[1], remote, sparse_grad)

    def make_examples(self, sentences, word_dict):
        ids, owner = _concat(sentences)
        if self.mode == "skipgram":       # rows: (context, center), both directions
            pairs = []
            for d in range(1, self.window + 1):
                same = owner[:-d] == owner[d:]
                a, b = ids[:-d][same], ids[d:][same]
                pairs += [torch.stack([a, b], 1), torch.stack([b, a], 1)]
            return torch.cat(pairs) if pairs else torch.empty(0, 2, dtype=torch.long)
        # cbow rows: (2*window context words..., center); sentences padded with <s> / <e>.
        w = self.window
        padded = [torch.cat([torch.full((w,), word_dict["<s>"]), s, torch.full((w,), word_dict["<e>"])])
                  for s in sentences]
        if not padded:
            return torch.empty(0, 2 * w + 1, dtype=torch.long)
        windows = torch.cat(padded).unfold(0, 2 * w + 1, 1)
        real = torch.cat([torch.cat([torch.ones(len(s), dtype=torch.bool), torch.zeros(2 * w, dtype=torch.bool)])
                          for s in sentences])[:len(windows)]
        windows = windows[real]
        return torch.cat([windows[:, :w], windows[:, w + 1:], windows[:, w:w + 1]], 1)

    def make_batch(self, rows, generator):
        negatives = log_uniform(len(rows) * self.negatives, self.vocab_size, generator).view(len(rows), -1)
        return {"context": rows[:, :-1], "center": rows[:, -1], "negatives": negatives}

    def table_inputs(self, batch):
        """Which ids of the batch each table is asked for."""
        if self.mode == "skipgram":   # predict the context word from the center word
            return {"emb_in": batch["center"], "emb_out": torch.cat([batch["context"][:, 0], batch["negatives"].flatten()])}
        return {"emb_in": batch["context"].flatten(), "emb_out": torch.cat([batch["center"], batch["negatives"].flatten()])}

    def forward(self, batch):
        if self.mode == "skipgram":
            v = self.emb_in(batch["center"])
            target = batch["context"][:, 0]
        else:
            v = self.emb_in(batch["context"]).mean(1)
            target = batch["center"]
        positive = F.logsigmoid((v * self.emb_out(target)).sum(-1))
        negative = F.logsigmoid(-torch.bmm(self.emb_out(batch["negatives"]), v.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return -(positive + negative)


class NGram(nn.Module):
    def __init__(self, vocab_size, emb_dim, hidden, ngram_n=5, seed=0, remote=False, sparse_grad=False, **_):
        super().__init__()
        self.n = ngram_n
        self.table_specs = [TableSpec("emb", vocab_size, emb_dim, 0.05, seed)]
        self.emb = make_table(self.table_specs[0], remote, sparse_grad)
        self.hidden = nn.Linear((ngram_n - 1) * emb_dim, hidden)
        self.output = nn.Linear(hidden, vocab_size)

    def make_examples(self, sentences, word_dict):
        # PaddlePaddle's imikolov reader: <s> w1 ... wk <e>, every window of n words.
        start, end = word_dict["<s>"], word_dict["<e>"]
        sentences = [torch.cat([torch.tensor([start]), s, torch.tensor([end])]) for s in sentences]
        ids, owner = _concat(sentences)
        if len(ids) < self.n:
            return torch.empty(0, self.n, dtype=torch.long)
        windows = ids.unfold(0, self.n, 1)
        same = owner[:len(windows)] == owner[self.n - 1:]
        return windows[same]

    def make_batch(self, rows, generator):
        return {"context": rows[:, :-1], "target": rows[:, -1]}

    def table_inputs(self, batch):
        return {"emb": batch["context"].flatten()}

    def forward(self, batch):
        x = self.emb(batch["context"]).flatten(1)
        logits = self.output(torch.sigmoid(self.hidden(x)))
        return F.cross_entropy(logits, batch["target"], reduction="none")


class MLP(nn.Module):
    MAX_WORDS, CLASSES = 64, 8

    def __init__(self, hidden, mlp_features=512, **_):
        super().__init__()
        self.features = mlp_features
        self.table_specs = []
        self.net = nn.Sequential(nn.Linear(mlp_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, self.CLASSES))

    def make_examples(self, sentences, word_dict):
        # rows: up to MAX_WORDS ids padded with -1, then the label.
        rows = torch.full((len(sentences), self.MAX_WORDS + 1), -1, dtype=torch.long)
        for i, s in enumerate(sentences):
            s = s[:self.MAX_WORDS]
            rows[i, :len(s)] = s
            rows[i, -1] = min(len(s) // 4, self.CLASSES - 1)
        return rows

    def make_batch(self, rows, generator):
        words, label = rows[:, :-1], rows[:, -1]
        present = words >= 0
        x = torch.zeros(len(rows), self.features)
        row_index = torch.arange(len(rows)).unsqueeze(1).expand_as(words)
        x.index_put_((row_index[present], words[present] % self.features), torch.ones(int(present.sum())),
                     accumulate=True)
        return {"x": x, "y": label}

    def table_inputs(self, batch):
        return {}

    def forward(self, batch):
        return F.cross_entropy(self.net(batch["x"]), batch["y"], reduction="none")


def build_model(args, vocab_size, remote=False, sparse_grad=False):
    """The model named by args.model. Dense weights come from torch.manual_seed(args.seed), so every
    process that builds the model starts from the same values."""
    hp = hyperparameters(args)
    torch.manual_seed(args.seed)
    common = dict(seed=args.seed, remote=remote, sparse_grad=sparse_grad)
    if args.model == "word2vec":
        return Word2Vec(vocab_size, hp["emb_dim"], args.w2v_mode, args.window, args.negatives, **common)
    if args.model == "ngram":
        return NGram(vocab_size, hp["emb_dim"], hp["hidden"], args.ngram_n, **common)
    return MLP(hp["hidden"], args.mlp_features)


def optimizer_config(args):
    hp = hyperparameters(args)
    return {"name": hp["optimizer"], "lr": hp["lr"]}


def sparse_modules(model):
    """{table name: module} of the model's embedding tables."""
    return {spec.name: getattr(model, spec.name) for spec in model.table_specs}


def dense_parameters(model, include_tables):
    """The parameters that travel as dense blocks, in a fixed order."""
    skip = set() if include_tables else {id(p) for m in sparse_modules(model).values() for p in m.parameters()}
    return [p for _, p in model.named_parameters() if id(p) not in skip]


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def batch_length(batch):
    return next(iter(batch.values())).shape[0]
