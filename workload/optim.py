"""The optimisers, written once for the three places that apply updates.

A pserver updates its dense block and the rows of its sparse tables; DDP and
the single-process reference update whole modules. All of them call the same
`update(param, grad, state)` on plain tensors, so sync SGD on pservers and one
process on the concatenated batches do exactly the same arithmetic. Rows are
updated by gathering them, updating, and scattering them back: untouched rows
(and their AdaGrad accumulators) do not move, as with a dense zero gradient.
"""
import torch


class SGD:
    state_names = ()

    def __init__(self, lr):
        self.lr = lr

    def update(self, param, grad, state):
        param.add_(grad, alpha=-self.lr)


class AdaGrad:
    """AdaGrad (Duchi et al.), as PaddlePaddle's: accumulate squared gradients, scale each step by them."""
    state_names = ("sum",)

    def __init__(self, lr, eps=1e-6):
        self.lr, self.eps = lr, eps

    def update(self, param, grad, state):
        acc = state["sum"]
        acc.addcmul_(grad, grad)
        param.addcdiv_(grad, acc.sqrt().add_(self.eps), value=-self.lr)


def make_optimizer(config):
    """config: {"name": "sgd" | "adagrad", "lr": float}."""
    kinds = {"sgd": SGD, "adagrad": AdaGrad}
    return kinds[config["name"]](config["lr"])


def new_state(optimizer, like):
    return {name: torch.zeros_like(like) for name in optimizer.state_names}


def update_rows(optimizer, table, state, rows, grad_rows):
    """Apply `grad_rows` to rows `rows` (unique local indices) of `table` and of each state tensor."""
    param = table.index_select(0, rows)
    row_state = {name: s.index_select(0, rows) for name, s in state.items()}
    optimizer.update(param, grad_rows, row_state)
    table.index_copy_(0, rows, param)
    for name, s in state.items():
        s.index_copy_(0, rows, row_state[name])


class ModuleOptimizer:
    """Applies an optimiser to a module's parameters, dense or sparse (nn.Embedding(sparse=True)) gradients."""

    def __init__(self, optimizer, params):
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.state = [new_state(optimizer, p.data) for p in self.params]

    @torch.no_grad()
    def step(self):
        for param, state in zip(self.params, self.state):
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad = grad.coalesce()   # sums the gradients of repeated rows
                rows = grad.indices()[0]
                update_rows(self.optimizer, param.data, state, rows, grad.values())
            else:
                self.optimizer.update(param.data, grad, state)

    def zero_grad(self):
        for param in self.params:
            param.grad = None

    def state_dict(self):
        return [dict(s) for s in self.state]

    def load_state_dict(self, states):
        for mine, saved in zip(self.state, states):
            for name in mine:
                mine[name].copy_(saved[name])
