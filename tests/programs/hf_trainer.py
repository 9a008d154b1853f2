"""A Hugging Face Trainer on a tiny model built from a config (nothing downloaded); it knows nothing of
fabtrain.

    python hf_trainer.py OUT_DIR MAX_STEPS

A 2-layer GPT-2 of width 32 on random token sequences, logging every 5 steps, no checkpoints.
"""
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=int(sys.argv[2]), per_device_train_batch_size=8,
                             logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3)
    Trainer(model=model, args=args, train_dataset=Tokens(256)).train()
    print("trained", flush=True)
