"""Data, reference training and the comparison that --check relies on (one process)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from runtime.training import (
    ReferenceResult,
    compare,
    make_optimizer,
    relative_difference,
    replica_shard,
    synthetic_batch,
    train_reference,
    unique_parameters,
)


def test_synthetic_batch_follows_the_examples() -> None:
    ids = torch.randint(3, 50, (4, 7))
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    a = synthetic_batch((ids, x), 12, seed=1, step=2)
    b = synthetic_batch((ids, x), 12, seed=1, step=2)
    c = synthetic_batch((ids, x), 12, seed=1, step=3)
    assert a[0].shape == (12, 7) and a[0].dtype == ids.dtype
    assert int(a[0].min()) >= int(ids.min()) and int(a[0].max()) <= int(ids.max())
    assert a[1].shape == (12, 3, 5) and a[1].dtype == torch.float64
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[1], c[1])


def test_replica_shards_partition_the_batch() -> None:
    batch = (torch.arange(12).view(12, 1),)
    shards = [replica_shard(batch, d, 3)[0] for d in range(3)]
    assert torch.equal(torch.cat(shards), batch[0])


def test_unique_parameters_counts_tied_weights_once() -> None:
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    assert len(unique_parameters([a, b])) == 3


@pytest.mark.parametrize("name", ["sgd", "sgd-momentum", "adam", "adamw"])
def test_optimizers(name: str) -> None:
    p = nn.Parameter(torch.ones(2))
    opt = make_optimizer(name, [p], lr=0.1)
    p.grad = torch.ones(2)
    opt.step()
    assert float(p.detach()[0]) < 1.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_reference_equals_a_plain_full_batch_step_for_a_mean_loss() -> None:
    """With a per-sample mean loss, micro-batch accumulation equals one full-batch step."""
    example = (torch.randn(2, 4),)
    ref = train_reference(
        _model(), example, lambda out: out.pow(2).mean(), steps=2, global_batch_size=8,
        microbatch_size=2, replicas=2, optimizer="sgd", lr=0.1, seed=3,
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        (x,) = synthetic_batch(example, 8, seed=3, step=step)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert ref.losses == pytest.approx(losses, rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(ref.params[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_compare_detects_differences() -> None:
    params = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    ref = ReferenceResult(losses=[1.0, 0.5], params={k: v.clone() for k, v in params.items()})
    same = compare([1.0, 0.5], params, ref)
    assert same.max_loss_rel_diff == 0 and same.max_param_rel_diff == 0 and not same.missing
    moved = compare([1.0, 0.5001], {**params, "w": torch.tensor([1.0, 2.002])}, ref)
    # a loss below 1 is compared by its absolute difference (the floor)
    assert moved.max_loss_rel_diff == pytest.approx(1e-4, rel=1e-3)
    big = compare([20.0, 10.002], params, ReferenceResult(losses=[20.0, 10.0], params=ref.params))
    assert big.max_loss_rel_diff == pytest.approx(2e-4, rel=1e-3)  # relative above it
    assert moved.max_param_rel_diff == pytest.approx(1e-3, rel=1e-3) and moved.worst_param == "w"
    missing = compare([1.0, 0.5], {"w": params["w"]}, ref)
    assert math.isinf(missing.max_param_rel_diff) and missing.missing == ["b"]


def test_tied_weights_are_matched_by_storage() -> None:
    """T5's ``shared`` embedding is never called: the pipeline holds it under another of its
    names; every tensor is still compared once."""
    w = torch.tensor([1.0, 2.0])
    ref = ReferenceResult(
        losses=[1.0],
        params={"shared.weight": w, "encoder.embed.weight": w, "head.weight": w, "b": torch.ones(1)},
        groups=[["shared.weight", "encoder.embed.weight", "head.weight"], ["b"]],
    )
    ok = compare([1.0], {"encoder.embed.weight": w.clone(), "b": torch.ones(1)}, ref)
    assert ok.max_param_rel_diff == 0 and not ok.missing
    off = compare([1.0], {"head.weight": w + 1e-3, "b": torch.ones(1)}, ref)
    assert off.max_param_rel_diff == pytest.approx(5e-4, rel=1e-3) and off.worst_param == "head.weight"
    lost = compare([1.0], {"b": torch.ones(1)}, ref)
    assert math.isinf(lost.max_param_rel_diff) and lost.missing == ["shared.weight"]


def test_parameters_near_zero_are_compared_by_absolute_difference() -> None:
    """A zero-initialised bias with a zero true gradient moves by rounding noise only."""
    ref = ReferenceResult(losses=[1.0], params={"key.bias": torch.tensor([3e-10, -1e-10])})
    noise = compare([1.0], {"key.bias": torch.tensor([-2e-10, 1e-10])}, ref)
    assert noise.max_param_rel_diff < 1e-5
    real = compare([1.0], {"key.bias": torch.tensor([2e-6, 0.0])}, ref)
    assert real.max_param_rel_diff > 1e-3


def test_relative_difference_is_per_tensor_scale() -> None:
    assert relative_difference(torch.tensor([0.0, 10.0]), torch.tensor([1e-9, 10.0])) == pytest.approx(1e-10)
