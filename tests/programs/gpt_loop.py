"""A nanoGPT-shaped training script (karpathy/nanoGPT train.py and model.py, cut down to a tiny GPT on the CPU); it
knows nothing of fabtrain.

    python gpt_loop.py --data_dir=DIR --out_dir=DIR [--key=value ...]

As nanoGPT's train.py: the config is module globals overridden by `--key=value` (its configurator); batches are
sliced at random from an `np.memmap` of uint16 tokens (DIR/train.bin, DIR/val.bin, written by the caller);
`gradient_accumulation_steps` micro-batches an iteration, each `loss = loss / gradient_accumulation_steps` and
`scaler.scale(loss).backward()` under `torch.amp.GradScaler(enabled=(dtype == 'float16'))` (dtype float16: the
forward under CPU autocast in float16, whose overflows the scaler skips), `scaler.unscale_` then
`clip_grad_norm_`, `scaler.step(optimizer)`, `scaler.update()`; every `eval_interval` iterations, before the
iteration's step, `estimate_loss()` (eval_iters forwards a split under `torch.no_grad()`, no DataLoader) and,
from iteration 1 on, `torch.save` of the checkpoint to out_dir/ckpt.pt; it prints `iter {iter_num}: loss
{lossf:.4f}, ...` after each iteration's optimizer step, with `lossf = loss.item() * gradient_accumulation_steps`
(the last micro-batch's loss, scaled back up), exactly as nanoGPT does, and runs iterations 0 to max_iters.

What a test needs beyond nanoGPT (none of it changes the loop): `eval_sleep` seconds in each evaluation
forward after iteration 0 (a slower model; the evaluation before the first step stays quick); `stuck_eval`, the
number of the evaluation forward that never returns (a Python loop at 100% of a core), counted from 1 over the
run (0: none); `scaler_init_scale`, the GradScaler's init_scale (high: its first iterations overflow and are
skipped); and `trace`: a file of JSON lines, flushed as they happen, with each iteration's micro-batch losses,
the scale and whether the scaler skipped the step, and the times of the evaluation's forwards and of each save's
start and end. At the end it prints `optimizer steps N` (AdamW's own step count: the steps the scaler did not skip).
"""
import json
import math
import os
import sys
import time
from ast import literal_eval
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
# default config values (nanoGPT's names; a tiny model)
out_dir = 'out'
data_dir = 'data'
eval_interval = 10
log_interval = 1
eval_iters = 4
always_save_checkpoint = True
gradient_accumulation_steps = 4
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 64  # nanoGPT reads it from the dataset's meta.pkl
dropout = 0.0
bias = False
learning_rate = 3e-3
max_iters = 24
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 4
lr_decay_iters = 24
min_lr = 3e-4
device = 'cpu'
dtype = 'float32'  # 'float16': CPU autocast in float16 and the GradScaler
# what a test needs (see the docstring)
eval_sleep = 0.0
stuck_eval = 0
scaler_init_scale = 65536.0
trace = ''
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
for arg in sys.argv[1:]:  # nanoGPT's configurator.py, --key=value only
    assert arg.startswith('--') and '=' in arg, arg
    key, val = arg[2:].split('=', 1)
    if key not in config_keys:
        raise ValueError(f"Unknown config key: {key}")
    try:
        attempt = literal_eval(val)
    except (SyntaxError, ValueError):
        attempt = val
    if isinstance(globals()[key], float) and isinstance(attempt, int):
        attempt = float(attempt)
    assert type(attempt) == type(globals()[key]), (key, attempt)
    globals()[key] = attempt
config = {k: globals()[k] for k in config_keys}

_trace = open(trace, 'a', buffering=1) if trace else None


def note(**what):
    if _trace is not None:
        _trace.write(json.dumps({"t": time.time(), **what}) + "\n")


# -----------------------------------------------------------------------------
# model.py, cut down


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd, bias=config.bias), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd, bias=config.bias), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        self.eval_forwards = 0

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx, targets=None):
        if not self.training:  # an evaluation forward (estimate_loss)
            self.eval_forwards += 1
            if self.eval_forwards == stuck_eval:
                note(stuck=self.eval_forwards)
                while True:  # spins for ever
                    pass
            if eval_sleep and iter_num > 0:
                time.sleep(eval_sleep)
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1) \
            if targets is not None else None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        optim_groups = [{'params': [p for p in param_dict.values() if p.dim() >= 2], 'weight_decay': weight_decay},
                        {'params': [p for p in param_dict.values() if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        N, cfg = self.get_num_params(), self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        return (6 * N + 12 * L * H * Q * T) * T * fwdbwd_per_iter / dt / 312e12


# -----------------------------------------------------------------------------
# train.py

master_process = True
os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337)
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)


def get_batch(split):
    # nanoGPT recreates np.memmap every batch to avoid a memory leak
    data = np.memmap(os.path.join(data_dir, 'train.bin' if split == 'train' else 'val.bin'), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=vocab_size, dropout=dropout)
model = GPT(GPTConfig(**model_args))
model.to(device)
scaler = torch.amp.GradScaler(device_type, init_scale=scaler_init_scale, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
raw_model = model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
            note(eval_forward=raw_model.eval_forwards, split=split)
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


X, Y = get_batch('train')
t0 = time.time()
local_iter_num = 0
running_mfu = -1.0
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    if iter_num % eval_interval == 0 and master_process:
        note(eval_start=iter_num)
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses['val']
            if iter_num > 0:
                checkpoint = {
                    'model': raw_model.state_dict(),
                    'optimizer': optimizer.state_dict(),
                    'model_args': model_args,
                    'iter_num': iter_num,
                    'best_val_loss': best_val_loss,
                    'config': config,
                }
                print(f"saving checkpoint to {out_dir}", flush=True)
                note(save_start=iter_num)
                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))
                note(save_end=iter_num)

    micro = []
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        micro.append(loss.item() * gradient_accumulation_steps)  # (the trace's, not nanoGPT's)
        X, Y = get_batch('train')
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    note(iter=iter_num, micro=micro, scale=scale,
         skipped=scaler.is_enabled() and scaler.get_scale() < scale)

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        if local_iter_num >= 5:
            mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%", flush=True)
    iter_num += 1
    local_iter_num += 1

    if iter_num > max_iters:
        break

steps = {int(s['step']) for s in optimizer.state.values()}
print(f"optimizer steps {steps.pop() if len(steps) == 1 else steps}", flush=True)
