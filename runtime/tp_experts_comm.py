"""The collectives of tensor-parallel MoE blocks (needs torch): Megatron's ``f`` and ``g``
(:func:`copy_to_region`, :func:`reduce_from_region`), the region's partial sums reduced once
(:func:`sum_partials`), the experts' tokens gathered under sequence parallelism
(:func:`gather_tokens`, :func:`share_gradient`), and the graph nodes that call them
(:class:`Boundary`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``f``: ``x`` as it is; its gradient (partial sums) all-reduced over ``group``."""
    out: torch.Tensor = _Copy.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``g``: the partial sums of ``x`` all-reduced over ``group``; identity backward."""
    out: torch.Tensor = _Reduce.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def sum_partials(x: torch.Tensor, mesh: Any, sequence_dim: int | None) -> Any:
    """The region's output ``x`` (this rank's partial sums) summed over ``mesh`` once, as a
    DTensor: all-reduced (``Replicate``; identity backward), or under sequence parallelism
    reduce-scattered along ``sequence_dim`` (``Shard``; its backward all-gathers)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    d = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    seq = sequence_dim is not None and x.dim() > sequence_dim
    return d.redistribute(mesh, [Shard(sequence_dim) if seq else Replicate()])  # type: ignore[arg-type]


def gather_tokens(x: Any) -> torch.Tensor:
    """A sequence-sharded DTensor ``x`` all-gathered whole (local tensor) for the experts; the
    backward reduce-scatters the gradient (partial sums) back to this rank's slice (Megatron's
    ``g``-bar under sequence parallelism)."""
    from torch.distributed.tensor import Shard

    (place,) = x.placements
    if not isinstance(place, Shard):
        raise ValueError(f"the experts' input under sequence parallelism is {x.placements}, not Shard(sequence) on 'tp'")
    local = x.to_local()
    out: torch.Tensor = _Gather.apply(local, x.device_mesh, place.dim, x.shape, x.stride())  # type: ignore[no-untyped-call]
    return out


def share_gradient(x: torch.Tensor, parts: int) -> torch.Tensor:
    """``x`` as it is; its gradient divided by ``parts`` (a replicated consumer's whole gradient
    entering a reduce-scatter with the experts' partial sums counts once, not ``parts`` times)."""
    out: torch.Tensor = _Share.apply(x, parts)  # type: ignore[no-untyped-call]
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: Any, dim: int, shape: Any, stride: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        ctx.mesh, ctx.dim = mesh, dim
        d = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=stride)
        return d.redistribute(mesh, [Replicate()]).to_local()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        from torch.distributed.tensor import DTensor, Partial, Shard

        d = DTensor.from_local(grad.contiguous(), ctx.mesh, [Partial()], run_check=False)
        return d.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local(), None, None, None, None


class _Share(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, parts: int) -> torch.Tensor:
        ctx.parts = parts
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.parts, None


#: the kinds of :class:`Boundary` node :func:`localize` inserts
KINDS = ("enter", "weight", "exit", "copy", "reduce", "sum", "gather", "share")


class Boundary(nn.Module):
    """One kind of node :func:`localize` inserts (``kind``, one of :data:`KINDS`): ``enter`` (a
    DTensor input as a whole local tensor), ``weight`` (a parameter's local shard), ``exit`` (a
    replicated result as a DTensor), ``copy``/``reduce`` (Megatron's ``f``/``g``), ``sum`` (the
    region's partial sums reduced once: :func:`sum_partials`), ``gather`` (the experts' input
    all-gathered under sequence parallelism, :func:`gather_tokens`), ``share`` (a replicated
    consumer's gradient over T: :func:`share_gradient`)."""

    def __init__(self, kind: str, mesh: Any, sequence_dim: int | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown boundary kind {kind!r} (expected one of {', '.join(KINDS)})")
        self.kind, self.mesh, self.sequence_dim = kind, mesh, sequence_dim

    def forward(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.kind in ("copy", "reduce"):
            fn = copy_to_region if self.kind == "copy" else reduce_from_region
            return fn(x, self.mesh.get_group())
        if self.kind == "sum":
            return sum_partials(x, self.mesh, self.sequence_dim if x.is_floating_point() else None)
        if self.kind == "share":
            return share_gradient(x, self.mesh.size())
        if self.kind == "exit":
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return x
            d = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            seq = self.sequence_dim
            if seq is not None and x.is_floating_point() and x.dim() > seq:
                d = d.redistribute(self.mesh, [Shard(seq)])  # a slice; its backward all-gathers
            return d
        if not isinstance(x, DTensor):
            return x
        if self.kind == "gather" and not all(p.is_replicate() for p in x.placements):
            return gather_tokens(x)
        if self.kind in ("enter", "gather") and not all(p.is_replicate() for p in x.placements):
            x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)  # the sequence gathered
        return x.to_local()  # a weight: this rank's shard, its gradient the same placement
