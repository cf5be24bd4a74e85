"""``--check``'s comparison of a pipelined run with the unsplit reference (:func:`compare`):
losses, gradients (:mod:`runtime.check_gradients`) and parameters, these less the Adam noise
allowance (:mod:`runtime.check_noise`), each as the largest relative difference
(:func:`relative_difference`) in its :class:`~runtime.check_result.Category`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import Tensor

from runtime.check_gradients import _compare_gradients, _gradients_compared
from runtime.check_noise import NOISE_LEVEL, _noise_allowance, _noise_levels
from runtime.check_result import Category, Comparison
from runtime.reference import ReferenceResult


def relative_difference(a: Tensor, b: Tensor, *, floor: float = 0.0, allowance: Tensor | None = None) -> float:
    """``max|a - b| / max(max|b|, floor)`` (per tensor, so near-zero entries do not blow it up);
    with ``allowance`` (shaped like ``b``) each element's difference is first reduced by its
    allowance (not below 0)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    scale = max(float(b64.abs().max()) if b64.numel() else 0.0, floor)
    delta = (a64 - b64).abs()
    if allowance is not None:
        delta = (delta - allowance.double().cpu()).clamp(min=0.0)
    diff = float(delta.max()) if b64.numel() else 0.0
    if scale == 0.0:
        return diff
    return diff / scale


#: losses are compared relative to max(|reference loss|, LOSS_FLOOR): a loss near zero is
#: compared by its absolute difference
LOSS_FLOOR = 1.0
#: parameters are compared relative to max(max|reference tensor|, PARAM_FLOOR): a tensor that
#: stays near zero (a zero-initialised bias whose true gradient is zero, such as BERT's
#: attention key biases) moves only by rounding noise, which must not count as a relative error
PARAM_FLOOR = 1e-3


def compare(
    losses: Sequence[float],
    params: Mapping[str, Tensor],
    reference: ReferenceResult,
    *,
    grads: Mapping[int, Mapping[str, Tensor | None]] | None = None,
    grad_norms: Mapping[int, Mapping[str, float]] | None = None,
    tolerance: float | None = None,
) -> Comparison:
    """Max relative differences between a pipelined run and the reference.

    Losses: ``|a - b| / max(|b|, LOSS_FLOOR)``.  Gradients (what the optimizer stepped on),
    per tensor: ``||a - b|| / max(||b||, GRAD_FLOOR * ||G||)`` at the steps of ``grads``
    (step -> name -> gradient; the reference kept the same steps, ``grad_steps``), and the
    norms' difference ``| ||a|| - ||b|| |`` on the same scale at the steps of ``grad_norms``
    (step -> name -> norm) that ``grads`` lacks.  Parameters: per tensor ``max|a - b| /
    max(max|b|, PARAM_FLOOR)``, where with Adam or AdamW each element's difference is first
    reduced by the move the optimizer can make on gradient noise (:class:`NoiseBound`, judged
    from the gradients of ``grads``).  ``tolerance``: to name the tensors that are within it
    only with that allowance.  Tied weights are matched by storage: every tensor of the
    reference (under any of its names) must have a pipelined value under one of those names,
    so a shared weight whose owner module is never called (T5's ``shared``) is still compared once.
    """
    loss_diff, worst_loss = 0.0, ""
    if len(losses) != len(reference.losses):
        loss_diff, worst_loss = math.inf, f"{len(losses)} steps against {len(reference.losses)}"
    for step, (a, b) in enumerate(zip(losses, reference.losses, strict=False)):
        d = abs(a - b) / max(abs(b), LOSS_FLOOR)
        if not d <= loss_diff:  # NaN counts as the worst
            loss_diff, worst_loss = (d if d == d else math.inf), f"step {step}"
    categories = [
        Category("losses", f"|a - b| / max(|b|, {LOSS_FLOOR:g}) per step", len(losses), loss_diff, worst_loss)
    ]
    groups = reference.groups or [[name] for name in reference.params]
    whole, norms = _gradients_compared(reference, grads or {}, grad_norms or {})
    grad_cats = _compare_gradients(reference, groups, whole, norms)
    categories.extend(grad_cats)
    grad_worst = max(grad_cats, key=lambda c: c.max_diff, default=None)

    noise = reference.noise
    lr_sum = sum(reference.lrs)
    noise_levels = _noise_levels(reference, groups, grads or {}) if noise is not None else {}
    worst, worst_name = 0.0, ""
    allowed: list[tuple[float, str]] = []  # (difference before the allowance, name)
    missing = [g[0] for g in groups if not any(name in params for name in g)]
    for name, value in params.items():
        ref = reference.params.get(name)
        if ref is None or ref.shape != value.shape:
            missing.append(name)
            continue
        raw = relative_difference(value, ref, floor=PARAM_FLOOR)
        d = raw
        if noise is not None and lr_sum > 0 and raw > 0:
            allowance = _noise_allowance(name, value.shape, grads or {}, reference.grads, noise, lr_sum, noise_levels,
                                         before=reference.noise_before.get(name))  # fmt: skip
            if allowance is not None:
                d = relative_difference(value, ref, floor=PARAM_FLOOR, allowance=allowance)
        if not d <= worst or not worst_name:
            worst, worst_name = (d if d == d else math.inf), name
        if tolerance is not None and raw > tolerance >= d:
            allowed.append((raw, name))
    if missing:
        worst = math.inf
        worst_name = f"{len(missing)} parameter(s) not matched, e.g. {missing[0]}"
    measure = f"max|a - b| / max(max|b|, {PARAM_FLOOR:g}) per tensor"
    if noise is not None:
        measure += (
            f", each element's difference less the optimizer's move on gradient noise (2 x {noise.max_move:.3g} x "
            f"sum(lr) = {2 * noise.max_move * lr_sum:.3g} where its gradient is below {NOISE_LEVEL:g} of the model's "
            "root-mean-square gradient element, that times its gradients' relative disagreement elsewhere)"
        )
        if reference.noise_before:
            measure = measure[:-1] + (
                f"; the reference's gradients of steps 0..{reference.first_step - 1}, before the checkpoint, "
                "say where they were noise)"
            )
    categories.append(Category("parameters", measure, len(params), worst, worst_name))
    if noise is not None and tolerance is not None:
        allowed.sort(reverse=True)
        categories.append(
            Category(
                "parameters within the tolerance only with the noise allowance",
                f"max|a - b| / max(max|b|, {PARAM_FLOOR:g}) per tensor, before the allowance",
                len(allowed),
                allowed[0][0] if allowed else 0.0,
                allowed[0][1] if allowed else "",
                [n for _, n in allowed],
            )
        )
    return Comparison(
        max_loss_rel_diff=loss_diff,
        max_param_rel_diff=worst,
        worst_param=worst_name,
        params_compared=len(params),
        missing=missing,
        max_grad_rel_diff=grad_worst.max_diff if grad_worst is not None else 0.0,
        worst_grad=grad_worst.worst if grad_worst is not None else "",
        categories=categories,
    )
