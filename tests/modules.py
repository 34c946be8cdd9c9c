"""Small torch modules shared by tests."""

import torch


class Fn(torch.nn.Module):
    """Wraps a function as a module, so torch.export can export it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)
