"""Gradient arithmetic the pipelined run, the reference and ``--check`` share: squared and L2
norms in float64, the clipping coefficient, inf/NaN detection and each parameter once (tied
weights)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn


def squared_norm(grads: Iterable[Tensor]) -> Tensor:
    """Sum of squared L2 norms of ``grads`` in float64 (a part of the global norm; parts add)."""
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        total = total + torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double().cpu() ** 2
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies gradients by: min(1, max / (norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def has_nonfinite(grads: Iterable[Tensor]) -> bool:
    return any(not bool(torch.isfinite(g).all()) for g in grads)


def unique_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters of ``modules``, each tensor once (tied weights are one parameter)."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def grad_norm(g: Tensor | None) -> float:
    """The L2 norm of a gradient in float64 (None: 0)."""
    return 0.0 if g is None else float(torch.linalg.vector_norm(g.detach().double()))


def _model_grad_norm(norms: Mapping[str, float], groups: Sequence[Sequence[str]]) -> float:
    """The whole model's gradient norm from per-tensor norms (each tensor once)."""
    return math.sqrt(sum(norms.get(g[0], 0.0) ** 2 for g in groups))
