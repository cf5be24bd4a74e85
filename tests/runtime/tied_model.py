"""A model with weights tied across stages, for the executor tests.

Six ``Linear`` layers; layer 2 uses layer 0's weight and layer 4 uses layer 1's.  Split into
six stages on two ranks (interleaved), layers 0 and 2 share a rank (one tensor, its gradient
must be averaged over micro-batches once) and layers 1 and 4 sit on different ranks (their
gradients must be summed across ranks).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TiedChain(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(6)])
        self.layers[2].weight = self.layers[0].weight
        self.layers[4].weight = self.layers[1].weight

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def tiny() -> tuple[TiedChain, tuple[Tensor]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TiedChain(), (torch.randn(8, 16),)
