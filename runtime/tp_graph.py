"""Where a unit's traced graph uses its linears (part of :mod:`runtime.mesh`): the
``aten.linear``/``aten.addmm`` call of each weight (:func:`_linear_sites`), and the split of a fused
projection's output (GPT-2's ``c_attn``: Q, K, V side by side), rerouted through
:func:`split_fused` so each rank cuts its own heads without communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from planner.errors import InputError


def _linear_sites(unit: Any, weights: Iterable[str], *, transposed: Iterable[str] = ()) -> list[Any] | str:
    """The ``aten.linear`` node of each weight (qualified names inside the unit) in a unit's
    graph, in order, or why they cannot be found (one linear call per weight expected); for the
    modules in ``transposed`` (``Conv1D``: ``x @ weight + bias``), the ``aten.addmm`` node."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return "the layer is not a traced graph"
    attrs = {n.target: n for n in graph.nodes if n.op == "get_attr"}
    flipped = {f"{m}.weight" for m in transposed}
    out = []
    for weight in weights:
        op, at = (torch.ops.aten.addmm.default, 2) if weight in flipped else (torch.ops.aten.linear.default, 1)
        node = attrs.get(weight)
        users = [u for u in node.users if u.op == "call_function"] if node is not None else []
        if len(users) != 1 or users[0].target is not op or users[0].args[at] is not node:
            return f"{weight} is not used by exactly one aten.{op.__name__.split('.')[0]} call in the layer's graph"
        out.append(users[0])
    return out


#: operators that only reshape, between a fused projection and the split of its output
_RESHAPES = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def _fused_split_site(unit: Any, module: str, parts: int) -> Any:
    """The ``aten.split`` node that cuts fused projection ``module``'s output (its ``addmm`` or
    ``linear``, then only reshapes) into ``parts`` equal projections along the last dimension,
    or why there is none."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return "the layer is not a traced graph"
    weight = f"{module}.weight"
    node = next((n for n in graph.nodes if n.op == "get_attr" and n.target == weight), None)
    users = list(node.users) if node is not None else []
    why = f"{module}'s output is not split into {parts} projections by one aten.split in the layer's graph"
    if len(users) != 1 or users[0].op != "call_function":
        return why
    node = users[0]
    width = None
    while True:
        nxt = list(node.users)
        if len(nxt) != 1 or nxt[0].op != "call_function":
            return why
        node = nxt[0]
        if str(node.target) in _RESHAPES:
            sizes = node.args[1]
            width = sizes[-1] if isinstance(sizes, (list, tuple)) and isinstance(sizes[-1], int) else None
            continue
        break
    if node.target is not torch.ops.aten.split.Tensor or width is None:
        return why
    size, dim = node.args[1], node.args[2] if len(node.args) > 2 else 0
    if not isinstance(size, int) or size * parts != width or dim not in (-1, len(node.args[0].args[1]) - 1):
        return why
    return node


def split_fused(y: Any, split_size: int, dim: int, parts: int) -> Any:
    """``aten.split`` of a fused projection's output into its ``parts`` projections (GPT-2's
    Q, K, V).  Sharded by heads (:func:`runtime._strided_shard.strided_shard`: this rank holds
    its heads of each projection side by side), each rank cuts its own piece into ``parts``,
    each a ``Shard(dim)`` DTensor of the projection: no communication (DTensor's own split would
    gather the whole output).  Anything else: ``aten.split`` as traced."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from runtime._strided_shard import is_strided

    if isinstance(y, DTensor) and y.device_mesh.ndim == 1:
        d = dim % y.dim()
        if is_strided(y.placements[0], d, parts):
            local = y.to_local()
            pieces = torch.split(local, local.shape[d] // parts, d)
            return [DTensor.from_local(p, y.device_mesh, [Shard(d)], run_check=False) for p in pieces]
    return torch.ops.aten.split.Tensor(y, split_size, dim)


def _split_fused_by_heads(unit: Any, fused: Mapping[str, int]) -> None:
    """Route each fused projection's split through :func:`split_fused` in a unit's graph
    (:func:`refuse_unexecutable` refused units where the split is not found)."""
    graph = getattr(unit, "graph", None)
    changed = False
    for module, parts in fused.items():
        node = _fused_split_site(unit, module, parts)
        if isinstance(node, str):
            raise InputError(f"tensor parallelism: {node}")
        node.target = split_fused
        node.args = (node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else 0, parts)
        changed = True
    if changed and graph is not None:
        graph.lint()
        unit.recompile()
