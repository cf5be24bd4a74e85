"""Tensor parallelism (T > 1) on mixture-of-experts blocks, Megatron-LM's expert tensor
parallelism (needs torch).

DTensor has no sharding rule for transformers' grouped products (``grouped_mm``) nor for the
routing's ``histc``, so a block's MoE module (``mlp``: router, routed experts, shared expert)
runs on plain local tensors inside the unit's DTensor graph (:func:`localize`): its nodes (found
by ``nn_module_stack``) read their DTensor inputs as local tensors (activations gathered whole
first: under sequence parallelism the all-gather, its backward a slice), its results re-enter as
replicated DTensors (under sequence parallelism sliced along the sequence, whose backward is the
all-gather).  Each expert's FFN is split along its hidden width: the first product(s)
(``gate_up_proj``, gate and up each split: ``_StridedShard``) column-parallel, the last
(``down_proj``) row-parallel; a shared expert's ``gate_proj``/``up_proj`` and ``down_proj`` the
same; the router and the shared expert's gate stay replicated.  Megatron's ``f`` before each
column product (identity, all-reduce of the input gradient) and ``g`` after each row product
(all-reduce, identity backward).  The weights stay DTensors over "tp" (``--check``, checkpoints,
FSDP2 and ZeRO see the whole parameter); the graph reads their local shards (``to_local``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: column- and row-parallel linears of a shared expert, by name inside the MoE block
SHARED = (("shared_expert", "shared_experts"), ("gate_proj", "up_proj"), ("down_proj",))


def moe_blocks(unit: Any) -> tuple[str, ...]:
    """The MoE modules of a unit (parents of the routed experts: ``model.layers.0.mlp``)."""
    from runtime.experts import find_sites

    sites = find_sites(unit)
    if isinstance(sites, str):
        return ()
    return tuple(sorted({w.rpartition(".")[0].rpartition(".")[0] for s in sites for w in s.weights}))


def _path(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _weight_chain(node: Any) -> tuple[Any, int]:
    """The ``get_attr`` a product's weight comes from and how many transposes lie between."""
    flips = 0
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        flips += "transpose" in str(node.target)
        node = next(a for a in node.args if isinstance(a, torch.fx.Node))
    return node, flips


def layout(unit: Any, blocks: Sequence[str], t: int) -> dict[str, Any] | str:
    """Where :func:`localize` rewrites ``unit``, or why it cannot: ``region`` (the MoE modules'
    nodes), ``column``/``row`` (product nodes), ``shards`` (parameter -> ``(dim, parts)``)."""
    from runtime.experts import find_sites

    inside = tuple(blocks)
    region = [n for n in unit.graph.nodes if n.op in ("call_function", "call_method")
              and any(_path(n) == b or _path(n).startswith(b + ".") for b in inside)]  # fmt: skip
    sites = find_sites(unit)
    if isinstance(sites, str) or not region:
        return sites if isinstance(sites, str) else "its graph has no module paths (nn_module_stack) to find the MoE module by"
    members, shards = set(region), {}
    column: list[Any] = []
    row: list[Any] = []
    for site in sites:
        if len(site.products) < 2 or not set(site.products) <= members:
            return f"its experts' grouped products ({len(site.products)}) are not a first and a last inside {inside}"
        for k, product in enumerate(site.products):
            src, flips = _weight_chain(product.args[1])
            users = list(product.users)
            last = k == len(site.products) - 1
            cut = [u for u in users if "chunk" in str(u.target) or "split" in str(u.target)]
            parts, a = 1, cut[0].args if cut else ()
            if cut and not last:  # gate | up side by side: each rank its share of each
                if len(users) > 1 or "chunk" not in str(cut[0].target) or len(a) != 3 or a[2] not in (-1, 1):
                    return f"the output of grouped product {product.name} is cut other than by one chunk(n, -1)"
                parts = int(a[1])  # type: ignore[arg-type]
            dim = (2 if flips % 2 else 1) if last else (1 if flips % 2 else 2)
            width = unit.get_parameter(str(src.target)).shape[dim]
            if width % (parts * t):
                return f"expert weight {src.target} has a hidden width {width} ({parts} part(s)), not divisible by T={t}"
            shards[str(src.target)] = (dim, parts)
            (row if last else column).append(product)
    params = dict(unit.named_parameters())
    for node in region:
        w: Any = node.args[1] if node.target is torch.ops.aten.linear.default else None
        name = str(w.target)[: -len(".weight")] if getattr(w, "op", None) == "get_attr" else ""
        owner, _, leaf = name.rpartition(".")
        if not any(owner == f"{b}.{s}" for b in inside for s in SHARED[0]) or leaf not in SHARED[1] + SHARED[2]:
            continue
        is_row = leaf in SHARED[2]
        if is_row and f"{name}.bias" in params:
            return f"{name} has a bias, which a row-parallel shared expert would add T times"
        width = params[f"{name}.weight"].shape[1 if is_row else 0]
        if width % t:
            return f"{name} has a hidden width {width}, not divisible by T={t}"
        shards[f"{name}.weight"] = (1, 1) if is_row else (0, 1)
        if not is_row and f"{name}.bias" in params:
            shards[f"{name}.bias"] = (0, 1)
        (row if is_row else column).append(node)
    return {"region": region, "column": column, "row": row, "shards": shards}


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``f``: ``x`` as it is; its gradient (partial sums) all-reduced over ``group``."""
    out: torch.Tensor = _Copy.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``g``: the partial sums of ``x`` all-reduced over ``group``; identity backward."""
    out: torch.Tensor = _Reduce.apply(x, group)  # type: ignore[no-untyped-call]
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


class Boundary(nn.Module):
    """One kind of node :func:`localize` inserts (``kind``: enter, weight, exit, copy, reduce)."""

    def __init__(self, kind: str, mesh: Any, sequence_dim: int | None = None) -> None:
        super().__init__()
        self.kind, self.mesh, self.sequence_dim = kind, mesh, sequence_dim

    def forward(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.kind in ("copy", "reduce"):
            fn = copy_to_region if self.kind == "copy" else reduce_from_region
            return fn(x, self.mesh.get_group())
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
        if self.kind == "enter" and not all(p.is_replicate() for p in x.placements):
            x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)  # the sequence gathered
        return x.to_local()  # a weight: this rank's shard, its gradient the same placement


def localize(unit: Any, blocks: Sequence[str], mesh: Any, *, sequence_dim: int | None = None) -> None:
    """Rewrite ``unit``'s graph (its parameters already DTensors placed by :func:`layout`'s
    ``shards``) so its MoE modules run on local tensors with Megatron's collectives."""
    found = layout(unit, blocks, mesh.size())
    if isinstance(found, str):
        from planner.errors import InputError

        raise InputError(f"tensor parallelism on a mixture-of-experts layer: {found}")
    graph, region = unit.graph, found["region"]
    members = set(region)
    mods = {k: f"pipeplan_tp_experts_{k}" for k in ("enter", "weight", "exit", "copy", "reduce")}
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
    for node in region:
        outside = [u for u in node.users if u not in members]
        if outside:
            with graph.inserting_after(node):
                leave = graph.call_module(mods["exit"], (node,))
            for u in outside:
                u.replace_input_with(node, leave)
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
        node.replace_all_uses_with(summed, delete_user_cb=lambda u, s=summed: u is not s)
    graph.lint()
    unit.recompile()
