"""Where :func:`runtime.tp_experts.localize` rewrites a unit's graph (needs torch): the MoE
modules of a unit (:func:`moe_blocks`), and the region, column- and row-parallel products and
weight shards of its experts and shared expert (:func:`layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

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
