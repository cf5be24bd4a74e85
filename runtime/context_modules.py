"""The modules context parallelism (the plan's C) inserts into a unit's graph (needs torch).

* :class:`Gather` (:class:`GatherSequence`, autograd-aware): K or V all-gathered along the
  sequence over the context-parallel group; the backward all-reduces the gradient and keeps
  this rank's rows (gloo has no reduce-scatter).
* :class:`CausalMask`: the causal mask of the global positions, this rank's queries against
  the keys of all ranks.
* :class:`Positions`: this rank's global positions, in place of an ``arange`` of s/C.

Where they are inserted: :class:`runtime.context_parallel.ContextParallel`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


class GatherSequence(torch.autograd.Function):
    """All-gather along dimension -2 over ``group``; backward: all-reduce the gradient (gloo has
    no reduce-scatter) and keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.shape[-2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        whole = grad.contiguous().clone()
        dist.all_reduce(whole, group=ctx.group)
        return whole.narrow(-2, ctx.rank * ctx.rows, ctx.rows), None


class Gather(nn.Module):
    """K or V of every context-parallel rank, along the sequence (dimension -2)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = GatherSequence.apply(x, self.group)  # type: ignore[no-untyped-call]
        return out


class CausalMask(nn.Module):
    """``[queries, keys]`` boolean mask of the gathered keys each local query must not see (True:
    masked), or with ``allowed=True`` of those it may see (SDPA's convention).  Under the
    no-kv-gather fault (``skip()`` true) the keys of the other ranks are masked as well: the
    attention a forgotten gather computes, with every rank's collectives still in step."""

    def __init__(self, queries: Tensor, keys: Tensor, mine: Tensor, skip: Any, *, allowed: bool = False) -> None:
        super().__init__()
        self.queries, self.keys, self.mine, self.skip, self.allowed = queries, keys, mine, skip, allowed

    def forward(self, like: Tensor) -> Tensor:
        masked = self.keys.to(like.device)[None, :] > self.queries.to(like.device)[:, None]
        if self.skip():
            masked = masked | ~self.mine.to(like.device)[None, :]
        return ~masked if self.allowed else masked


class Positions(nn.Module):
    """This rank's global positions, shaped and typed like the ``arange`` they replace."""

    def __init__(self, positions: Tensor) -> None:
        super().__init__()
        self.positions = positions

    def forward(self, like: Tensor) -> Tensor:
        return self.positions.to(device=like.device, dtype=like.dtype)
