"""Where context parallelism (the plan's C) rewrites a unit's graph, and why it cannot (needs
torch).

* :func:`attention_sites`: each ``softmax(mask_fill(q @ k^T * scale)) @ v`` (the zoo GPT) and
  each ``scaled_dot_product_attention`` (Hugging Face decoders).  A mask present in the graph is
  taken for the causal one (no padding masks).
* :func:`position_aranges`: every ``arange`` of s/C elements whose values reach a position
  embedding or leave the unit (the position ids of learned or rotary position embeddings).
* :func:`context_problems`: why the runtime cannot execute a plan's C, before training.

The rewrite itself is :class:`runtime.context_parallel.ContextParallel`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx


def _op(node: Any, *names: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and any(f"aten.{n}." in str(node.target) for n in names)


def _scaled_scores(node: Any) -> Any:
    while _op(node, "mul", "div") and not isinstance(node.args[1], fx.Node):
        node = node.args[0]
    return node


def attention_sites(unit: fx.GraphModule) -> list[tuple[str, tuple[fx.Node, ...]]]:
    """The attentions of ``unit``'s graph: ``("sdpa", (node,))`` for each
    ``scaled_dot_product_attention``; ``("math", (fill or None, transpose of k, matmul with v))``
    for each ``softmax([mask_fill](q @ k^T [* scale])) [dropout] @ v``."""
    sites: list[tuple[str, tuple[Any, ...]]] = []
    for node in unit.graph.nodes:
        if _op(node, "scaled_dot_product_attention"):
            sites.append(("sdpa", (node,)))
            continue
        if not _op(node, "softmax", "_softmax"):
            continue
        fill = node.args[0] if _op(node.args[0], "masked_fill") else None
        scores = _scaled_scores(fill.args[0] if fill is not None else node.args[0])
        if not _op(scores, "matmul") or not _op(scores.args[1], "transpose"):
            continue
        probs = node
        while len(probs.users) == 1 and _op(next(iter(probs.users)), "dropout", "_to_copy", "to"):
            probs = next(iter(probs.users))
        outs = [u for u in probs.users if _op(u, "matmul") and u.args[0] is probs]
        if len(outs) == 1 and len(probs.users) == 1:
            sites.append(("math", (fill, scores.args[1], outs[0])))
    return sites


def _arange_length(node: fx.Node) -> int | None:
    if not _op(node, "arange"):
        return None
    ints = [a for a in node.args if isinstance(a, int)]
    if len(ints) != len(node.args) or not ints:
        return None
    if len(ints) == 1:
        return ints[0]
    step = ints[2] if len(ints) > 2 else 1
    return (ints[1] - ints[0]) // step if step > 0 else None


#: ops through which an arange's values stay position ids (offset, reshaped, cast)
_CARRIES_POSITIONS = ("add", "unsqueeze", "expand", "view", "reshape", "slice", "to", "_to_copy", "clone",
                      "contiguous", "alias")  # fmt: skip


def _is_position(node: fx.Node) -> bool:
    """True when an ``arange``'s values reach a position embedding's indices or leave the unit
    (position ids for rotary embeddings) through ops that carry its values (:data:`_CARRIES_POSITIONS`);
    mask building, which the rewritten attention replaces, indexes local arrays with such aranges
    or compares them, and those stay local."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output" or (_op(user, "embedding") and user.args[1] is n):
                return True
            if user in seen or not _op(user, *_CARRIES_POSITIONS):
                continue
            seen.add(user)
            todo.append(user)
    return False


def position_aranges(unit: fx.GraphModule, length: int) -> list[fx.Node]:
    """The ``arange`` nodes of ``length`` elements in ``unit``'s graph that are position ids."""
    return [n for n in unit.graph.nodes if _arange_length(n) == length and _is_position(n)]


def context_problems(units: Sequence[Any], layer_names: Sequence[str], plan: Any) -> list[str]:
    """Why the runtime cannot execute the plan's C (empty when it can, or C = 1), naming the axis
    or the layer, with the fix."""
    c = plan.context_parallel_degree
    if c <= 1:
        return []
    problems = []
    if plan.tensor_parallel_degree > 1:
        problems.append(f"context parallelism (C={c}) with tensor parallelism (T={plan.tensor_parallel_degree}): "
                        "the runtime executes C with T = 1 only (replan with --tensor-parallel 1)")
    if plan.zero_stage > 0:
        problems.append(f"context parallelism (C={c}) with ZeRO {plan.zero_stage}: the runtime executes C with ZeRO "
                        "0 only (replan with --zero 0)")
    if not any(attention_sites(u) for u in units) and layer_names:
        problems.append(f"context parallelism (C={c}): no layer of this model has an attention the runtime "
                        "recognises (scaled_dot_product_attention, or softmax(q @ k^T) @ v) "
                        f"(layers {layer_names[0]!r}..{layer_names[-1]!r}); replan with --context-parallel 1")
    return problems
