"""Every private torch API pipeplan uses (profiler/_torch_private.py) still exists and behaves.

A torch upgrade that moves one of them fails here, with its name, instead of deep inside a
profile or a pipelined run.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from profiler import _torch_private as private


def test_pytree_flattens_and_rebuilds_sizes_tuples_and_dicts() -> None:
    value = {"shape": torch.Size([2, 3]), "pair": (torch.ones(1), None), "n": 4}
    leaves, spec = private.tree_flatten(value)
    assert leaves[:2] == [2, 3] and isinstance(leaves[2], torch.Tensor) and leaves[3:] == [None, 4]
    rebuilt = private.tree_unflatten(leaves, spec)
    assert rebuilt["shape"] == torch.Size([2, 3]) and isinstance(rebuilt["shape"], torch.Size)
    assert rebuilt["n"] == 4 and rebuilt["pair"][1] is None
    assert private.is_leaf_spec(private.tree_flatten(torch.ones(1))[1])
    assert not private.is_leaf_spec(spec)


def test_version_counter_counts_in_place_writes_through_views() -> None:
    t = torch.zeros(4)
    before = private.version_counter(t)
    t[1:].add_(1)
    assert private.version_counter(t) > before
    same = private.version_counter(t)
    _ = t + 1
    assert private.version_counter(t) == same


def test_aten_operators_say_whether_they_are_random_or_write() -> None:
    aten = torch.ops.aten
    assert private.op_is_random(aten.bernoulli_.float) is True
    assert private.op_is_random(aten.native_dropout.default) is True
    assert private.op_is_random(aten.add.Tensor) is False
    assert private.op_is_mutating(aten.add_.Tensor) is True
    assert private.op_is_mutating(aten.add.Tensor) is False
    assert private.op_is_random(torch.add) is None and private.op_is_mutating("relu_") is None


def test_fx_real_calls_runs_modules_while_tracing() -> None:
    seen: list[str] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with private.fx_real_calls():
                out = nn.Identity()(torch.ones(1))
                seen.append(type(out).__name__)
            return x + 1

    fx.symbolic_trace(Probe())
    assert seen == ["Tensor"]  # a real call, not a traced Proxy


def test_split_backward_gives_the_gradients_of_a_whole_backward() -> None:
    """torch's stage_backward_input / stage_backward_weight (the profiler times I and W with them)."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(5, 4, requires_grad=True)
    upstream = torch.randn(5, 2)
    layer(x).backward(upstream)
    want = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]  # type: ignore[union-attr]
    layer.zero_grad(set_to_none=True)
    x2 = x.detach().requires_grad_(True)
    weights = list(layer.parameters())
    state = private.backward_input([layer(x2)], [upstream], [x2], weights)
    assert x2.grad is not None and all(p.grad is None for p in weights)  # I: the input gradient only
    private.backward_weight(weights, state)
    got = [x2.grad, *(p.grad for p in weights)]
    for g, w in zip(got, want, strict=True):
        assert g is not None and torch.allclose(g, w)


def test_dispatch_mode_sees_the_aten_operators_below_autograd() -> None:
    """torch's TorchDispatchMode (the profiler finds attention's score tensors with it)."""
    seen: list[str] = []

    class Spy(private.dispatch_mode()):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    a = torch.randn(2, 3, 4, requires_grad=True)
    with Spy():
        out = torch.softmax(a @ a.transpose(1, 2), dim=-1)
    assert out.shape == (2, 3, 3) and out.requires_grad  # autograd still records above the mode
    assert "bmm" in seen and "_softmax" in seen
