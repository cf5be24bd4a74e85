"""The collectives of expert parallelism (the plan's E; needs torch): tokens to the rank that
owns their expert and back.

* :func:`all_to_all`: autograd-aware ``all_to_all_single`` of a tensor's rows (its backward is
  the reverse all-to-all); gloo runs ``all_to_all_single`` on CPU (torch 2.13), so no fallback
  is needed.
* :class:`Dispatch`, inserted before a site's first grouped product: the per-expert counts are
  exchanged (``all_to_all_single`` of integers), then the sorted tokens themselves, and what
  arrived is regrouped expert-major with the local offsets.
* :class:`Combine`, inserted after the last: the inverse regrouping and the reverse all-to-all,
  so the layer goes on (routing weights, un-sorting, shared experts) on its own tokens.

Where they are inserted: :class:`runtime.experts.ExpertParallel`.  Only public torch APIs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x``; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """Autograd-aware ``all_to_all_single`` of ``x``'s rows over ``group``."""
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, group)  # type: ignore[no-untyped-call]
    return out


class Dispatch(nn.Module):
    """Send each token (sorted by expert) to the rank owning its expert; returns the received
    tokens grouped by local expert, the local offsets, and the routing for :class:`Combine`."""

    def __init__(self, group: Any, *, experts: int, fault_from: tuple[list[int], int] | None = None) -> None:
        super().__init__()
        self.group, self.experts = group, experts
        # --inject-fault R:S:wrong-expert: (the runtime's step box, S)
        self.fault_from = fault_from

    def forward(self, x: Tensor, offsets: Tensor) -> tuple[Any, ...]:
        e = dist.get_world_size(self.group)
        local = self.experts // e
        offs = offsets.long()
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        if self.fault_from is not None and self.fault_from[0][0] >= self.fault_from[1]:
            # a wrong implementation for tests: each block of tokens goes to the next rank's experts
            chunks = torch.split(x, counts.view(e, local).sum(1).tolist())
            x = torch.cat([*chunks[-1:], *chunks[:-1]])
            counts = counts.view(e, local).roll(1, 0).flatten()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # src j's counts for my experts
        matrix = received.view(e, local)
        send = counts.view(e, local).sum(1).tolist()
        recv = matrix.sum(1).tolist()
        rows = all_to_all(x, recv, send, self.group)
        # rows arrive source-major (src, local expert); the products want them expert-major
        key = (torch.arange(local).repeat(e) * e + torch.arange(e).repeat_interleave(local)).to(offs.device)
        order = torch.argsort(key.repeat_interleave(matrix.flatten()), stable=True)
        local_offsets = torch.cumsum(matrix.sum(0), 0).to(offsets.dtype)
        return rows[order], local_offsets, order, send, recv


class Combine(nn.Module):
    """Undo :class:`Dispatch`: back to source-major order, and each row to the rank it came from."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, y: Tensor, order: Tensor, send: list[int], recv: list[int]) -> Tensor:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all(y[inverse], send, recv, self.group)
