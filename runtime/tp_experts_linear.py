"""Whether an MoE region is linear in its row-parallel products' partial sums, so that
:func:`runtime.tp_experts.localize` may combine them first and reduce once
(:func:`partial_sums`), and where the experts start reading the tokens (:func:`token_feeds`)
(needs torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: ops linear in their first argument that only move, cast or add up its elements (the other
#: arguments sizes, dtypes or integer indices): a partial sum in, a partial sum out
_MOVES = frozenset({
    "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "permute", "transpose", "t", "expand",
    "contiguous", "clone", "alias", "to", "_to_copy", "index", "select", "slice", "flatten", "sum", "neg",
    "chunk", "split", "split_with_sizes", "getitem",
})  # fmt: skip
#: products by a second operand: a partial sum times (or over) a replicated factor
_SCALES = frozenset({"mul", "div"})
#: sums of partial sums
_SUMS = frozenset({"add", "sub"})
#: scatter-adds of partial rows into a partial (or all-zero) tensor
_SCATTERS = frozenset({"index_add", "index_add_"})
_ZEROS = frozenset({"zeros", "zeros_like", "new_zeros"})
_ASSERTS = frozenset({"_assert_tensor_metadata"})


def _op(node: Any) -> str:
    """``aten.view.default`` -> ``view``; ``operator.getitem`` -> ``getitem``."""
    target = node.target
    if getattr(target, "__name__", None) == "getitem":
        return "getitem"
    parts = str(target).split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "aten" else str(getattr(target, "__name__", target))


def _is_float(node: Any) -> bool:
    """Whether ``node`` may hold a floating-point tensor (unknown: yes; a size or a tuple: no)."""
    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        return isinstance(node, torch.fx.Node)
    val = node.meta["val"]
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _moved(node: Any) -> Any:
    """The tensor a data-movement node (:data:`_MOVES`) reads, or None for anything else."""
    if node.op != "call_function" or _op(node) not in _MOVES or not node.args:
        return None
    src = node.args[0]
    # its other inputs: sizes, dtypes, integer indices (an input of unknown type, a size helper)
    known = [a.meta["val"] for a in node.all_input_nodes if a is not src and "val" in a.meta]
    if not isinstance(src, torch.fx.Node) or any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in known):
        return None
    return src


def partial_sums(region: Sequence[Any], row: Sequence[Any]) -> dict[str, Any] | str:
    """Everything the row-parallel products' partial sums flow into inside ``region``, if it is
    linear in them (so the sums can be reduced once, where they leave): ``partial`` (the nodes
    holding partial sums), ``factors`` (``(product, factor)``: a replicated factor a partial sum
    is multiplied or divided by, e.g. the routing weights, a shared expert's gate; its gradient
    is a partial sum too).  A string says what is not linear (an added bias or residual, a
    non-linear function, a product of two partial sums)."""
    partial: set[Any] = set(row)
    factors: list[tuple[Any, Any]] = []
    for node in region:  # in graph (topological) order
        mine = [a for a in node.all_input_nodes if a in partial]
        if node in partial or not mine:
            continue
        op = _op(node) if node.op == "call_function" else ""
        tensors = [a for a in node.all_input_nodes if _is_float(a)]
        if op in _ASSERTS:
            continue
        if op in _MOVES and _moved(node) in partial:
            pass
        elif op in _SCALES and len(mine) == 1 and (op == "mul" or node.args[0] in partial):
            factors += [(node, a) for a in tensors if a not in partial]
        elif op in _SUMS and all(a in partial for a in node.args[:2]):
            pass  # (a constant, a bias or a residual added to a partial sum would count T times)
        elif op in _SCATTERS and len(node.args) > 3 and node.args[3] in partial and (
            node.args[0] in partial or (isinstance(node.args[0], torch.fx.Node) and _op(node.args[0]) in _ZEROS)
        ):
            pass
        else:
            what = f"{op or node.op} of " + ", ".join(a.name for a in mine)
            return f"{node.name} ({what}) is not linear in the row-parallel products' partial sums"
        partial.add(node)
    return {"partial": partial, "factors": factors}


def token_feeds(column: Sequence[Any], members: set[Any]) -> tuple[list[Any], list[Any]]:
    """What the column-parallel products read, traced back through data movement
    (:data:`_MOVES`: views, casts, the gather of each expert's tokens) inside the region:
    ``(chain, roots)``, the movement nodes on the way and the tensors they start from (the
    region's entered input: one root, where one ``f`` covers every column product)."""
    chain: list[Any] = []
    roots: list[Any] = []
    stack = [c.args[0] for c in column]
    while stack:
        node = stack.pop()
        if node in chain or node in roots:
            continue
        src = _moved(node) if node in members else None
        if src is None:
            roots.append(node)
        else:
            chain.append(node)
            stack.append(src)
    return chain, roots
