"""Where expert parallelism (the plan's E) applies, and why it cannot (needs torch).

The splitter's units are flattened aten graphs, so a mixture-of-experts layer is found in the
graph, not as a module: Hugging Face's fused experts (``Mixtral``, ``Qwen2-MoE`` and every
``@use_experts_implementation`` class of transformers 5) run as grouped matrix products
(``grouped_mm``) of the tokens sorted by expert, with the per-expert ``offsets`` (cumulative
token counts) and 3-D expert weights ``[experts, out, in]``.  A *site* (:class:`Site`) is the
grouped products sharing one ``offsets``: :func:`find_sites` lists a unit's.
:func:`expert_problems` says, before training, why the runtime cannot execute a plan's E.

The rewrite of a site is :class:`runtime.experts.ExpertParallel`'s; the collectives it inserts
are in :mod:`runtime.expert_dispatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn


@dataclass
class Site:
    """One mixture-of-experts layer inside a unit's graph."""

    offsets: fx.Node
    products: list[fx.Node]  # grouped_mm nodes, in graph order
    weights: dict[str, fx.Node] = field(default_factory=dict)  # parameter name -> get_attr node
    experts: int = 0


def _is_grouped_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and "grouped_mm" in str(node.target)


def _weight_source(node: Any) -> fx.Node | None:
    """The ``get_attr`` a grouped product's weight argument comes from through single-input
    ops (transpose, dtype casts), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return node if isinstance(node, fx.Node) and node.op == "get_attr" else None


def find_sites(unit: fx.GraphModule) -> list[Site] | str:
    """The mixture-of-experts sites of ``unit``, or why the runtime cannot shard its experts."""
    sites: dict[fx.Node, Site] = {}
    for node in unit.graph.nodes:
        if not _is_grouped_mm(node):
            continue
        if len(node.args) < 3 or not isinstance(node.args[2], fx.Node):
            return f"grouped product {node.name} has no per-expert offsets argument"
        src = _weight_source(node.args[1])
        if src is None:
            return f"the weight of grouped product {node.name} is not a parameter of the layer"
        param = unit.get_parameter(str(src.target))
        site = sites.setdefault(node.args[2], Site(node.args[2], []))
        if param.dim() != 3 or (site.experts and param.shape[0] != site.experts):
            return f"expert weight {src.target} has shape {tuple(param.shape)}, not [experts, out, in]"
        site.experts = int(param.shape[0])
        site.products.append(node)
        site.weights[str(src.target)] = src
    return list(sites.values())


def _three_d_expert_params(unit: nn.Module) -> list[str]:
    return [n for n, p in unit.named_parameters() if p.dim() == 3 and "expert" in n]


def _axis_problems(e: int, units: Sequence[Any], layer_names: Sequence[str], plan: Any) -> list[str]:
    """The plan's other axes the runtime cannot combine with E."""
    problems: list[str] = []
    if plan.tensor_parallel_degree > 1:
        moe = [f"layer {i} '{layer_names[i]}'" for i, u in enumerate(units) if find_sites(u)]
        problems.append(f"expert parallelism (E={e}) with tensor parallelism (T={plan.tensor_parallel_degree})"
                        f"{' on ' + ', '.join(moe) if moe else ''}: the runtime shards a layer's experts over "
                        "data-parallel ranks (E) or along their hidden width (T, runtime/tp_experts.py), not both "
                        "(replan with --tensor-parallel 1 or --expert-parallel 1)")
    if plan.context_parallel_degree > 1:
        problems.append(f"expert parallelism (E={e}) with context parallelism (C={plan.context_parallel_degree}): "
                        "the runtime draws the E ranks from D only (replan with --context-parallel 1)")
    if plan.zero_stage > 0:
        problems.append(f"expert parallelism (E={e}) with ZeRO {plan.zero_stage}: the runtime's ZeRO would "
                        "shard or broadcast the expert shards over ranks holding other experts (replan with --zero 0)")
    if plan.data_parallel_degree % e:
        problems.append(f"expert parallelism (E={e}) does not divide the data-parallel degree "
                        f"D={plan.data_parallel_degree} (replan with an E dividing D)")
    return problems


def expert_problems(units: Sequence[Any], layer_names: Sequence[str], plan: Any) -> list[str]:
    """Why the runtime cannot execute the plan's E (empty when it can, or E = 1), each naming
    the layer or the axis, torch-side facts only (the graphs)."""
    e = plan.expert_parallel_degree
    if e <= 1:
        return []
    problems = _axis_problems(e, units, layer_names, plan)
    found = 0
    for i, unit in enumerate(units):
        sites = find_sites(unit)
        name = layer_names[i]
        if isinstance(sites, str):
            problems.append(f"layer {i} '{name}': expert parallelism (E={e}): {sites}")
            continue
        if not sites and _three_d_expert_params(unit):
            problems.append(f"layer {i} '{name}': expert parallelism (E={e}): its experts "
                            f"({', '.join(_three_d_expert_params(unit))}) do not run as grouped products the "
                            "runtime recognises (transformers' fused experts); replan with --expert-parallel 1")
        for site in sites:
            found += 1
            if site.experts % e:
                problems.append(f"layer {i} '{name}': {site.experts} experts are not divisible by E={e} "
                                "(replan with an E dividing the expert count)")
    if found == 0 and layer_names:
        problems.append(f"expert parallelism (E={e}): no layer of this model is a mixture-of-experts layer the "
                        f"runtime recognises (layers {layer_names[0]!r}..{layer_names[-1]!r}); replan with "
                        "--expert-parallel 1")
    return problems
