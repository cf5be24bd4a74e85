"""Tensor parallelism (T > 1) on mixture-of-experts blocks, Megatron-LM's expert tensor
parallelism (needs torch).

DTensor has no sharding rule for transformers' grouped products (``grouped_mm``) nor for the
routing's ``histc``, so a block's MoE module (``mlp``: router, routed experts, shared expert)
runs on plain local tensors inside the unit's DTensor graph (:func:`localize`): its nodes (found
by ``nn_module_stack``) read their DTensor inputs as local tensors (activations whole).  Each
expert's FFN is split along its hidden width: the first product(s) (``gate_up_proj``, gate and
up each split: ``_StridedShard``) column-parallel, the last (``down_proj``) row-parallel; a
shared expert's ``gate_proj``/``up_proj`` and ``down_proj`` the same; the router and the shared
expert's gate stay replicated.  The weights stay DTensors over "tp" (``--check``, checkpoints,
FSDP2 and ZeRO see the whole parameter); the graph reads their local shards (``to_local``).

Collectives, combine first and reduce once (:func:`partial_sums` checks the region is linear in
the row products' partial sums: in Mixtral's and Qwen2-MoE's the routing-weight multiply, the
gather back to token order, the sum over each token's ``top_k`` rows, the shared expert's
sigmoid-gate multiply, the sum with the routed output, casts and views; no bias):

* forward: each rank combines its partial sums; the MoE output is reduced once where it leaves
  the region (``sum``: one all-reduce of the block's output size; under sequence parallelism a
  reduce-scatter along the sequence, :func:`sum_partials`);
* backward: that reduction's backward (identity; under sequence parallelism an all-gather); one
  Megatron ``f`` where the experts (routed and shared) start reading the tokens (the movement
  after that point duplicated where the router reads it too, so the router's replicated
  gradient is not summed T times; under sequence parallelism the tokens' all-gather itself,
  whose backward reduce-scatters, :func:`gather_tokens`, the router's side scaling its gradient
  by 1/T, :func:`share_gradient`); an ``f`` on each replicated factor of a partial sum (the
  routing weights, the shared gate: their gradient is a partial sum; ``top_k`` and 1 values a
  token).

A region that is not linear in the partial sums (a bias added after a row product, a non-linear
function of them) falls back to an ``f`` before each column product and a ``g`` (all-reduce,
identity backward) after each row product, the output leaving replicated (under sequence
parallelism sliced).

Its parts: :mod:`runtime.tp_experts_layout` (the region and its products, :func:`layout`),
:mod:`runtime.tp_experts_linear` (the linearity check, :func:`partial_sums`) and
:mod:`runtime.tp_experts_comm` (the collectives and :class:`Boundary`); here the rewrite
(:func:`localize`).  Every name stays importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.graph_edit import redirect_users
from runtime.tp_experts_comm import KINDS as KINDS
from runtime.tp_experts_comm import Boundary as Boundary
from runtime.tp_experts_comm import copy_to_region as copy_to_region
from runtime.tp_experts_comm import gather_tokens as gather_tokens
from runtime.tp_experts_comm import reduce_from_region as reduce_from_region
from runtime.tp_experts_comm import share_gradient as share_gradient
from runtime.tp_experts_comm import sum_partials as sum_partials
from runtime.tp_experts_layout import SHARED as SHARED
from runtime.tp_experts_layout import layout as layout
from runtime.tp_experts_layout import moe_blocks as moe_blocks
from runtime.tp_experts_linear import _ASSERTS, _op
from runtime.tp_experts_linear import partial_sums as partial_sums
from runtime.tp_experts_linear import token_feeds as token_feeds


def localize(unit: Any, blocks: Sequence[str], mesh: Any, *, sequence_dim: int | None = None) -> str:
    """Rewrite ``unit``'s graph (its parameters already DTensors placed by :func:`layout`'s
    ``shards``) so its MoE modules run on local tensors with Megatron's collectives; returns
    how: ``"combined"`` (the partial sums reduced once where they leave the region, one ``f``
    on the experts' input; the module docstring) or ``"per product"`` (an ``f`` before each
    column product and a ``g`` after each row product: the region is not linear in the row
    products' partial sums, :func:`partial_sums`)."""
    found = layout(unit, blocks, mesh.size())
    if isinstance(found, str):
        from planner.errors import InputError

        raise InputError(f"tensor parallelism on a mixture-of-experts layer: {found}")
    graph, region = unit.graph, found["region"]
    members = set(region)
    mods = {k: f"pipeplan_tp_experts_{k}" for k in KINDS}
    for kind, name in mods.items():
        unit.add_submodule(name, Boundary(kind, mesh, sequence_dim))
    entered: dict[Any, Any] = {}
    for node in region:
        for a in node.all_input_nodes:
            if a in members or ("val" in a.meta and not isinstance(a.meta["val"], torch.Tensor)):
                continue  # sizes (symbolic integers) pass as they are
            if a not in entered:
                with graph.inserting_before(node):
                    entered[a] = graph.call_module(mods["weight" if a.op == "get_attr" else "enter"], (a,))
            node.replace_input_with(a, entered[a])
    sums = partial_sums(region, found["row"])
    combined = not isinstance(sums, str)
    partial = sums["partial"] if not isinstance(sums, str) else set()
    for node in region:
        outside = [u for u in node.users if u not in members]
        if outside:
            with graph.inserting_after(node):
                leave = graph.call_module(mods["sum" if node in partial else "exit"], (node,))
            for u in outside:
                u.replace_input_with(node, leave)
    if isinstance(sums, str):
        _per_product(graph, found, mods)
    else:
        copied: dict[Any, Any] = {}
        for product, factor in sums["factors"]:  # its gradient: partial sums, all-reduced
            if factor not in copied:
                with graph.inserting_before(product):
                    copied[factor] = graph.call_module(mods["copy"], (factor,))
            product.replace_input_with(factor, copied[factor])
        _copy_tokens_once(graph, found["column"], members, mods, set(entered.values()), sequence_dim is not None)
    graph.lint()
    unit.recompile()
    return "combined" if combined else "per product"


def _per_product(graph: Any, found: dict[str, Any], mods: dict[str, str]) -> None:
    """An ``f`` before each column product's input and a ``g`` after each row product."""
    copied: dict[Any, Any] = {}
    for node in found["column"]:
        x = node.args[0]
        if x not in copied:
            with graph.inserting_before(node):
                copied[x] = graph.call_module(mods["copy"], (x,))
        node.replace_input_with(x, copied[x])
    for node in found["row"]:
        with graph.inserting_after(node):
            summed = graph.call_module(mods["reduce"], (node,))
        redirect_users(node, summed)


def _copy_tokens_once(
    graph: Any, column: Sequence[Any], members: set[Any], mods: dict[str, str], entries: set[Any], sp: bool
) -> None:
    """One ``f`` where the column products' inputs start (:func:`token_feeds`), the data
    movement after it duplicated where the router (or anything else replicated) reads it too,
    so the replicated consumers' gradient is not summed T times.  Under sequence parallelism a
    root that is the region's entered input becomes :func:`gather_tokens` (all-gather forward,
    reduce-scatter backward) and its replicated consumers read it through ``share`` instead."""
    chain, roots = token_feeds(column, members)
    feeding = set(chain) | set(column)
    expert: dict[Any, Any] = {}  # what the experts' side reads for a node
    other: dict[Any, Any] = {}  # what everything else (the router) reads for it
    for root in roots:
        if sp and root in entries and root.target == mods["enter"]:
            root.target = mods["gather"]
            with graph.inserting_after(root):
                other[root] = graph.call_module(mods["share"], (root,))
        else:
            with graph.inserting_after(root):
                expert[root] = graph.call_module(mods["copy"], (root,))
        for u in list(root.users):
            if u not in feeding and u not in (expert.get(root), other.get(root)) and root in other:
                u.replace_input_with(root, other[root])
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(chain, key=order.__getitem__):
        if all(u in feeding or _op(u) in _ASSERTS for u in node.users):
            node.args = torch.fx.map_arg(node.args, lambda a: expert.get(a, a))
            node.kwargs = torch.fx.map_arg(node.kwargs, lambda a: expert.get(a, a))
            continue
        # read by the router too: the experts' side gets its own copy of the movement
        with graph.inserting_after(node):
            expert[node] = graph.node_copy(node, lambda a: expert.get(a, a))
        node.args = torch.fx.map_arg(node.args, lambda a: other.get(a, a))
        node.kwargs = torch.fx.map_arg(node.kwargs, lambda a: other.get(a, a))
    for node in column:
        x = node.args[0]
        if x in expert:
            node.update_arg(0, expert[x])
