"""Data, reference training and the comparison that --check relies on (one process)."""

from __future__ import annotations

import itertools
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


# ---- the training knobs: learning-rate schedule, mixed precision, clipping, targets


def test_learning_rate_warms_up_linearly_then_holds_or_decays() -> None:
    from runtime.training import TrainOptions

    const = TrainOptions(optimizer="sgd", lr=1.0, steps=10, warmup_steps=4)
    assert [const.lr_at(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = TrainOptions(optimizer="sgd", lr=1.0, steps=10, lr_schedule="cosine", warmup_steps=2, min_lr=0.1)
    lrs = [cos.lr_at(s) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warm-up, then the cosine starts at lr
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the 8 decay steps
    assert 0.1 < lrs[-1] < 0.2  # every step trains: the last one is still above min_lr
    assert TrainOptions(optimizer="sgd", lr=2.0, steps=3).lr_at(2) == 2.0


def test_loss_scaler_halves_on_overflow_and_grows_after_good_steps() -> None:
    from runtime.training import LossScaler

    off = LossScaler(False)
    off.update(True)
    assert off.scale == 1.0
    s = LossScaler(True, init_scale=8.0, growth_interval=2)
    s.update(True)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0


def test_clipping_to_the_global_norm_is_torch_s_clip_grad_norm() -> None:
    from runtime.training import clip_coefficient, squared_norm

    torch.manual_seed(1)
    grads = [torch.randn(5, 3), torch.randn(7)]
    ours = [g.clone() for g in grads]
    theirs = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(theirs, grads, strict=True):
        p.grad = g.clone()
    # two ranks each hold one tensor: their squared norms add to the global one
    norm = math.sqrt(float(squared_norm(ours[:1]) + squared_norm(ours[1:])))
    coef = clip_coefficient(norm, 1.5)
    for g in ours:
        g.mul_(coef)
    total = torch.nn.utils.clip_grad_norm_(theirs, 1.5)
    assert norm == pytest.approx(float(total), rel=1e-6) and coef < 1
    for g, p in zip(ours, theirs, strict=True):
        assert torch.allclose(g, p.grad, rtol=1e-6)  # type: ignore[arg-type]
    assert clip_coefficient(0.5, 1.0) == 1.0


def test_reference_with_targets_clipping_and_schedule_equals_a_full_batch_step() -> None:
    """Targets reach the loss micro-batch by micro-batch; the clipped, scheduled step is one full-batch step."""
    from profiler.loading import check_entrypoint_result
    from runtime.data import DataSource
    from runtime.training import TrainOptions

    torch.manual_seed(0)
    x, y = torch.randn(24, 4), torch.randn(24, 1)
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 24, 8)]
    entry = check_entrypoint_result((_model(), x[:2], torch.nn.functional.mse_loss, data), spec="t:f")
    opts = TrainOptions(optimizer="sgd-momentum", lr=0.5, steps=3, lr_schedule="cosine", warmup_steps=1, clip_grad_norm=0.1)
    ref = train_reference(entry.model, entry.example_inputs, entry.loss, steps=3, global_batch_size=8, microbatch_size=2,
                          replicas=2, optimizer="sgd-momentum", lr=0.5, seed=0, options=opts,
                          source=DataSource.of(entry, global_batch_size=8, steps=3))  # fmt: skip
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, norms = [], []
    for step, (xb, yb) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
        for g in opt.param_groups:
            g["lr"] = opts.lr_at(step)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert ref.losses == pytest.approx(losses, rel=1e-6)
    assert ref.grad_norms == pytest.approx(norms, rel=1e-5) and min(norms) > 0.1  # it did clip
    for name, p in model.named_parameters():
        assert torch.allclose(ref.params[name], p.detach(), rtol=1e-5, atol=1e-7)


def test_reference_runs_under_autocast_in_16_bit() -> None:
    from runtime.training import TrainOptions

    example = (torch.randn(2, 4),)
    kw = dict(steps=1, global_batch_size=4, microbatch_size=2, optimizer="sgd", lr=0.1, seed=3)
    seen: list[torch.dtype] = []

    def loss(out: torch.Tensor) -> torch.Tensor:
        seen.append(out.dtype)
        return out.float().pow(2).mean()

    fp32 = train_reference(_model(), example, loss, **kw)  # type: ignore[arg-type]
    bf16 = train_reference(_model(), example, loss, **kw, options=TrainOptions(optimizer="sgd", lr=0.1, steps=1, dtype="bfloat16"))  # type: ignore[arg-type]
    assert seen == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert bf16.losses[0] != fp32.losses[0] and bf16.losses[0] == pytest.approx(fp32.losses[0], rel=2e-2)
    assert all(p.dtype == torch.float32 for p in bf16.params.values())  # float32 master weights


def test_float16_step_with_an_overflow_is_skipped() -> None:
    from runtime.training import TrainOptions

    example = (torch.randn(2, 4),)
    opts = TrainOptions(optimizer="sgd", lr=0.1, steps=1, dtype="float16")
    before = {n: p.detach().clone() for n, p in _model().named_parameters()}
    # d(loss)/d(output) = 1e3 x the scale 65536: beyond float16's 65504, so the gradient is inf
    ref = train_reference(_model(), example, lambda out: out.float().sum() * 1e3, steps=1, global_batch_size=4,
                          microbatch_size=2, optimizer="sgd", lr=0.1, seed=0, options=opts)  # fmt: skip
    assert all(torch.equal(before[n], p) for n, p in ref.params.items())
    # a mean loss: the bias gradient is 1 x 65536, one too many for float16 at the first step; the
    # halved scale fits at the second, which trains
    for steps, trained in ((1, False), (2, True)):
        two = TrainOptions(optimizer="sgd", lr=0.1, steps=steps, dtype="float16")
        fine = train_reference(_model(), example, lambda out: out.float().mean(), steps=steps, global_batch_size=4,
                               microbatch_size=2, optimizer="sgd", lr=0.1, seed=0, options=two)  # fmt: skip
        assert (not all(torch.equal(before[n], p) for n, p in fine.params.items())) is trained
