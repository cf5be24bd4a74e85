"""runtime.tp_experts.partial_sums: whether a MoE region is linear in its row-parallel products'
partial sums, so that they can be combined first and reduced once (issue 32's follow-up), on
small aten graphs (make_fx) standing in for the combine after the experts' down products."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def _graph(fn: Callable[..., Any], *shapes: tuple[int, ...]) -> tuple[list[Any], list[Any]]:
    """The call nodes of ``fn``'s aten graph and its row product (the first ``mm``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn)(*(torch.randn(s) for s in shapes))
    region = [n for n in gm.graph.nodes if n.op == "call_function"]
    return region, [n for n in region if "mm" in str(n.target)][:1]


def test_a_weighted_scatter_and_a_gated_shared_sum_are_linear() -> None:
    """Routed rows (partial sums) times their routing weights, gathered back to token order and
    summed per token, plus a gated shared output: linear; the two replicated factors (routing
    weights, gate) are named, their gradients being partial sums too."""
    from runtime.tp_experts import partial_sums

    def combine(h: Any, w: Any, r: Any, g: Any) -> Any:
        rows = torch.mm(h, w) * r.unsqueeze(-1)  # [tokens * top_k, hidden]
        routed = rows.view(4, 2, 3).sum(1).to(torch.float32)
        shared = torch.mm(h[:4], w)
        return (routed + torch.sigmoid(g) * shared).reshape(1, 4, 3)

    region, row = _graph(combine, (8, 5), (5, 3), (8,), (4, 1))
    shared_row = [n for n in region if "mm" in str(n.target)][1]
    found = partial_sums(region, [*row, shared_row])
    assert isinstance(found, dict), found
    names = {str(p.target).split(".")[1] for _, p in found["factors"]}
    assert names == {"unsqueeze", "sigmoid"}, names
    assert any("view" in str(n.target) for n in found["partial"])


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (lambda h, w, b: torch.mm(h, w) + b, "add"),  # a bias after the row product: T times
        (lambda h, w, b: torch.mm(h, w) + 1.0, "add"),  # a constant: T times
        (lambda h, w, b: torch.relu(torch.mm(h, w)) * b, "relu"),  # not linear
        (lambda h, w, b: torch.mm(h, w) * torch.mm(h, w), "mul"),  # a product of two partial sums
    ],
)
def test_what_is_not_linear_in_the_partial_sums_is_named(fn: Callable[..., Any], why: str) -> None:
    """A bias or constant added to a partial sum, a non-linear function of one, a product of two:
    not linear, so localize falls back to a reduction after each row product (the string)."""
    from runtime.tp_experts import partial_sums

    region, row = _graph(fn, (4, 5), (5, 3), (3,))
    if why == "mul":
        row = [n for n in region if "mm" in str(n.target)]
    found = partial_sums(region, row)
    assert isinstance(found, str) and why in found and "not linear" in found, found
