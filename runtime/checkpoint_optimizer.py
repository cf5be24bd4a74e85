"""The optimizer's state in a checkpoint: its tensors under ``optim.<param name>.<key>``
(:func:`optimizer_state`; a ZeRO-1 rank: its share), and creating that state before a load
(:func:`create_optimizer_state`) so that DCP has tensors to load into."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def optimizer_state(named: Sequence[tuple[str, Any]], optimizer: Any) -> dict[str, Any]:
    """``optim.<param name>.<key>`` -> tensor, for the parameters this rank's optimizer holds
    state for (a ZeRO-1 rank: its share)."""
    if optimizer is None:  # a rank whose stages hold no parameter
        return {}
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    out = {}
    for name, p in named:
        for key, value in inner.state.get(p, {}).items():
            if hasattr(value, "dim"):
                out[f"optim.{name}.{key}"] = value
    return out


def create_optimizer_state(named: Sequence[tuple[str, Any]], optimizer: Any) -> None:
    """Make the optimizer create its state (a step with zero gradients and learning rate 0), so
    that DCP has tensors to load into."""
    import torch

    if optimizer is None:
        return
    inner = getattr(optimizer, "optim", optimizer)
    params = [p for _, p in named]
    if all(p in inner.state for p in params if any(p is q for g in inner.param_groups for q in g["params"])):
        return
    saved = [g["lr"] for g in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        g["lr"] = 0.0
    inner.step()
    for g, lr in zip(inner.param_groups, saved, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None
