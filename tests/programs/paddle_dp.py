"""A plain PaddlePaddle DataParallel script, unchanged from what users write.

    python paddle_dp.py OUT_DIR   (with PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM,
    PADDLE_TRAINER_ENDPOINTS, PADDLE_CURRENT_ENDPOINT, PADDLE_MASTER and, on CPU,
    PADDLE_DISTRI_BACKEND=gloo in the environment, as fabtrain gives them)

Writes the final weights to OUT_DIR/paddle-rank-<id>.json; DataParallel keeps
them equal on every rank.
"""
import json
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

dist.init_parallel_env()
rank, world = dist.get_rank(), dist.get_world_size()
paddle.seed(0)
model = paddle.DataParallel(paddle.nn.Linear(4, 1))
opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
rng = np.random.default_rng(100 + rank)
for step in range(10):
    x = paddle.to_tensor(rng.standard_normal((8, 4)).astype("float32"))
    loss = ((model(x) - x.sum(axis=1, keepdim=True)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    print(f"paddle rank {rank}/{world} step {step} loss {float(loss):.4f}", flush=True)
weights = [p.numpy().flatten().tolist() for p in model.parameters()]
with open(os.path.join(sys.argv[1], f"paddle-rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "weights": weights}, f)
