"""A sharded unit's random draws with the unsharded model's numbers (part of
:mod:`runtime.mesh`): its ``aten.dropout`` calls become :func:`whole_dropout` (the whole tensor's
mask drawn, each rank keeping its shard), its attention with dropout
:func:`attention_whole_dropout` (:func:`_whole_randomness`).
"""

from __future__ import annotations

from typing import Any


def whole_dropout(x: Any, p: float, train: bool) -> Any:
    """``aten.dropout`` of a DTensor with the mask the unsharded tensor gets: the whole tensor's
    noise is drawn with the generator calls torch's CPU dropout makes (``empty``, ``bernoulli_(1 -
    p)``, ``div_(1 - p)``: same shape, same dtype, so the same numbers, and the generator ends
    where the unsharded model's does), and each rank keeps its shard of it.  Called from a
    sharded unit's graph in place of ``aten.dropout`` (:func:`_whole_randomness`): left to
    itself, each rank drew a mask of its own shard's size, so the attention dropout of the heads
    and every later draw of the unit differed from the unsharded model's (``--check`` 9e-4 off
    on ``examples.hf:bert`` at T = 2)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if not isinstance(x, DTensor) or not train or p == 0:
        return torch.ops.aten.dropout.default(x, p, train)
    if any(pl.is_partial() for pl in x.placements):
        x = x.redistribute(x.device_mesh, [Replicate() if pl.is_partial() else pl for pl in x.placements])
    local = x.to_local()
    if p == 1:
        return x * 0.0
    noise = torch.empty(tuple(x.shape), dtype=local.dtype, device=local.device).bernoulli_(1 - p).div_(1 - p)
    return x * distribute_tensor(noise, x.device_mesh, x.placements, src_data_rank=None)


def attention_whole_dropout(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """``aten.scaled_dot_product_attention`` with dropout, as torch's math composition (the kernel
    torch picks on CPU when there is dropout) with :func:`whole_dropout` on the probabilities:
    each rank keeps its heads' share of the mask of all heads."""
    import math

    import torch

    if dropout_p == 0 or enable_gqa:
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    attn = torch.matmul(q * factor, k.transpose(-2, -1) * factor)
    if is_causal:
        n, m = attn.shape[-2], attn.shape[-1]
        attn_mask = torch.ones(n, m, dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(attn.dtype)
        attn = attn + attn_mask
    attn = torch.softmax(attn, -1)
    return torch.matmul(whole_dropout(attn, dropout_p, True), v)


def _whole_randomness(unit: Any) -> None:
    """Give a sharded unit's random draws the unsharded model's numbers: its ``aten.dropout``
    calls become :func:`whole_dropout`, its attention with dropout
    :func:`attention_whole_dropout`."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return
    # operator -> (its replacement, the position of its dropout probability)
    swap = {
        torch.ops.aten.dropout.default: (whole_dropout, 1),
        torch.ops.aten.scaled_dot_product_attention.default: (attention_whole_dropout, 4),
    }
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in swap:
            continue
        fn, at = swap[node.target]
        p = node.args[at] if len(node.args) > at else node.kwargs.get("dropout_p", 0.0)
        if p != 0:  # a traced constant; without dropout the operator stays as it is
            node.target = fn
            changed = True
    if changed:
        graph.lint()
        unit.recompile()
