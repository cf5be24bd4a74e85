"""Whether a column-parallel projection's output can be cut into heads on T ranks.

A column-parallel linear leaves its output sharded along the features (``Shard(-1)``).  When
the layer's graph then views those features as ``(heads, head_dim)`` (attention's
``view(b, s, -1, head_dim)``), DTensor can unflatten the shard only if the first of the new
dimensions, the heads, is divisible by T: otherwise a rank would hold part of a head.  Llama's
grouped-query attention has fewer key/value heads than query heads (``examples.hf:llama``: 4
query heads, 2 key/value heads), so T = 4 divides its projections' widths (16 features) but
not its key/value heads; the runtime refuses such a plan before training
(:func:`runtime.mesh.refuse_unexecutable`) instead of failing in the first forward.
"""

from __future__ import annotations

import math
from typing import Any

#: operators that only reshape (the view that cuts a projection's features into heads)
_VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def heads_of(unit: Any, module: str) -> tuple[int, int] | None:
    """``(heads, width)`` when ``module``'s linear output (``aten.linear`` on ``module.weight``
    in the unit's graph) goes straight into a view that cuts its ``width`` features into
    several dimensions, ``heads`` being the first of them; None when it does not (an MLP's
    projection) or the graph does not say (no traced graph, no recorded shapes)."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return None
    weight = f"{module}.weight"
    linear = next(
        (
            n
            for n in graph.nodes
            if n.op == "call_function"
            and n.target is torch.ops.aten.linear.default
            and len(n.args) > 1
            and getattr(n.args[1], "op", None) == "get_attr"
            and n.args[1].target == weight
        ),
        None,
    )
    if linear is None:
        return None
    shape = getattr(linear.meta.get("val"), "shape", None)
    if shape is None or len(linear.users) != 1:
        return None
    view = next(iter(linear.users))
    if view.op != "call_function" or str(view.target) not in _VIEWS:
        return None
    sizes = view.args[1] if len(view.args) > 1 else None
    width = shape[-1]
    if not isinstance(sizes, (list, tuple)) or not isinstance(width, int):
        return None
    new = list(sizes[len(shape) - 1 :])
    if len(new) < 2 or not all(isinstance(x, int) for x in new):
        return None
    if -1 in new:
        known = math.prod(x for x in new if x != -1)
        new[new.index(-1)] = width // known if known else 0
    if math.prod(new) != width:
        return None
    return new[0], width


def heads_problem(unit: Any, module: str, t_deg: int) -> str | None:
    """Why ``module``'s output cannot be cut into whole heads on ``t_deg`` ranks, or None."""
    found = heads_of(unit, module)
    if found is None or found[0] % t_deg == 0:
        return None
    heads, width = found
    return (
        f"{module} has {width} output features viewed as {heads} heads of {width // heads}: "
        f"{heads} heads not divisible by T={t_deg} (a rank would hold part of a head)"
    )
