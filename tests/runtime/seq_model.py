"""A plain ``nn.Sequential`` for the schedule end-to-end tests: eight Linear + Tanh pairs."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def tiny() -> tuple[nn.Sequential, tuple[Tensor]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        return nn.Sequential(*layers), (torch.randn(8, 16),)
