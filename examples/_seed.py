"""Deterministic construction that leaves the caller's global RNG state alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def seeded(seed: int, build: Callable[[], T]) -> T:
    """Run ``build()`` with the CPU RNG seeded to ``seed``; restore the global RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
