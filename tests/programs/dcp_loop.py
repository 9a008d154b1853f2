"""A training loop that checkpoints with torch.distributed.checkpoint (DCP), as PyTorch's "Getting Started with
Distributed Checkpoint" recipe does, on the CPU; it knows nothing of fabtrain.

    python dcp_loop.py OUT_DIR STEPS EVERY

A world of one over gloo; every EVERY steps `dcp.save` of the model's and the optimizer's state dicts to
OUT_DIR/step-<N>, alternating with `dcp.async_save` (whose future it waits for before the next save); prints
`saved <folder> at step <N>` after each.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

out, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
pending = None
for step in range(1, steps + 1):
    x = torch.randn(16, 64)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % every == 0:
        if pending is not None:
            pending.result()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        folder = os.path.join(out, "step-%d" % step)
        if (step // every) % 2:
            dcp.save(state, checkpoint_id=folder)
            pending = None
        else:
            pending = dcp.async_save(state, checkpoint_id=folder)
        print("saved %s at step %d" % (folder, step), flush=True)
if pending is not None:
    pending.result()
dist.destroy_process_group()
