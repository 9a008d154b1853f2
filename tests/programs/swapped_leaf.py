"""A training loop that swaps a leaf's data between steps, as the reference pserver trainer does with the
sparse rows it pulls (workload/trainer.py): each step's embedding table has another number of rows. Autograd
holds up only if nothing keeps the last step's graph alive (the step's loss is dropped with its function, as
there). Prints the sum of the last gradient."""
import torch


def run_batch(rows, n):
    ids = torch.randint(0, n, (8,))
    loss = torch.nn.functional.embedding(ids, rows).pow(2).mean()
    loss.backward()
    return loss.item()


torch.manual_seed(0)
rows = torch.zeros(1, 4, requires_grad=True)
counted = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # a step the hook counts
total = 0.0
for step in range(30):
    n = 5 + step % 7  # another size every step
    rows.data = torch.randn(n, 4)
    rows.grad = None
    run_batch(rows, n)
    total = float(rows.grad.sum())
    counted.step()
print("grad sum %.6f" % total)
