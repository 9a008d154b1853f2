"""A Hugging Face Trainer with gradient accumulation and evaluation every few steps, on a tiny model built from a
config (nothing downloaded); it knows nothing of fabtrain.

    python hf_accum.py OUT_DIR MAX_STEPS K [EVAL_STEPS [EVAL_SECONDS]]

A 2-layer GPT-2 of width 32 on token sequences with a pattern to learn; `gradient_accumulation_steps=K`,
`logging_steps=1` (the Trainer logs every optimizer step's loss), `eval_strategy="steps"` every EVAL_STEPS
(default 10) steps over an evaluation set of 48 sequences, each read in EVAL_SECONDS (default 0: a slow disk
under a DataLoader, for a long evaluation); no checkpoints. At the end it writes the Trainer's own
`state.log_history` (what it logged, with its global step) to OUT_DIR/log_history.json and prints `trained at
step N`.
"""
import json
import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, read_seconds: float = 0.0):
        self.read_seconds = read_seconds
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 64, (n, 1), generator=g)
        self.ids = (start + 3 * torch.arange(16)) % 64  # a pattern the model learns
        noise = torch.rand(n, 16, generator=g) < 0.2
        self.ids[noise] = torch.randint(0, 64, (int(noise.sum()),), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.read_seconds:
            time.sleep(self.read_seconds)
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    out, max_steps, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    eval_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    eval_seconds = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accum, logging_steps=1, eval_strategy="steps",
                             eval_steps=eval_steps, per_device_eval_batch_size=8, save_strategy="no", report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, learning_rate=3e-3)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(1024, 1),
                      eval_dataset=Tokens(48, 2, eval_seconds))
    trainer.train()
    with open(os.path.join(out, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)
    print(f"trained at step {trainer.state.global_step}", flush=True)
