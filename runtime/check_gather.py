"""Whole parameters and gradients gathered from their shards for ``--check``
(part of :mod:`runtime.mesh`): :func:`full_parameters`, :func:`full_gradients`,
:func:`gradient_norms` (collectives over a DTensor's mesh: every rank of it must call them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def full_parameters(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Name -> the whole parameter on CPU (a DTensor gathered: every rank of its mesh must call
    this, with the same parameters), for ``--check``."""
    from torch.distributed.tensor import DTensor

    from runtime._strided_shard import full_tensor

    out = {}
    for name, p in named:
        t = p.detach()
        out[name] = (full_tensor(t) if isinstance(t, DTensor) else t).cpu().clone()
    return out


def full_gradients(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Name -> the whole gradient on CPU (``None``: the parameter has none; a DTensor gathered:
    every rank of its mesh must call this, with the same parameters), for ``--check``."""
    from torch.distributed.tensor import DTensor

    from runtime._strided_shard import full_tensor

    out: dict[str, Any] = {}
    for name, p in named:
        g = p.grad
        if g is None:
            out[name] = None
            continue
        g = g.detach()
        out[name] = (full_tensor(g) if isinstance(g, DTensor) else g).cpu().clone()
    return out


def gradient_norms(named: Iterable[tuple[str, Any]]) -> dict[str, float]:
    """Name -> the L2 norm of the whole gradient in float64 (0 without one; a DTensor's is a
    collective over its mesh, as in :func:`full_gradients`), for ``--check``."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, float] = {}
    for name, p in named:
        if p.grad is None:
            out[name] = 0.0
            continue
        n = torch.linalg.vector_norm(p.grad.detach().double())
        out[name] = float(n.full_tensor() if isinstance(n, DTensor) else n)
    return out
