"""``--check``'s gradient categories: which steps' gradients are compared whole and which by
their per-tensor norms (:func:`_gradients_compared`), and the comparison itself, relative to
each tensor's norm or, near zero, to the model's (:data:`GRAD_FLOOR`,
:func:`_compare_gradients`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.check_result import Category
from runtime.grad_math import _model_grad_norm, grad_norm
from runtime.reference import ReferenceResult

#: gradients are compared per tensor by ``||a - b|| / max(||b||, GRAD_FLOOR * ||G||)``, ``G``
#: the whole model's gradient that step (the reference's): relative to the tensor's own norm,
#: except for a tensor whose gradient is near zero in the reference (an attention key bias of
#: its own, whose true gradient is zero: what remains is rounding noise of terms that cancel),
#: which is compared absolutely, against ``GRAD_FLOOR`` of the model's gradient norm.  Measured
#: on the zoo's GPT-2 (float32, 2 ranks, Adam): after 10 steps every tensor's gradient differs
#: by at most 6.4e-7 of its own norm, the smallest tensors (4e-5 of the model's norm) included,
#: and a key bias's gradient is ~1e-13 of the model's norm, 1e-8 of the floor
GRAD_FLOOR = 1e-5


@dataclass
class _Worst:
    """A running count and maximum, NaN counting as the worst."""

    count: int = 0
    max: float = 0.0
    where: str = ""

    def add(self, d: float, where: str) -> None:
        self.count += 1
        if not d <= self.max:
            self.max, self.where = (d if d == d else math.inf), where


def _gradients_compared(
    reference: ReferenceResult,
    grads: Mapping[int, Mapping[str, Tensor | None]],
    grad_norms: Mapping[int, Mapping[str, float]],
) -> tuple[dict[int, Mapping[str, Tensor | None]], dict[int, Mapping[str, float]]]:
    """The whole gradients and the norms :func:`compare` compares.  With Adam or AdamW
    (``reference.noise``), whole gradients at the first kept step only: later steps run on
    weights that already differ by the optimizer's move on rounding noise (what the parameters'
    allowance admits), and their gradients differ with them (HF Llama at D = 2 x T = 2: step 1's
    3.1e-5 apart, 4.5e-7 at lr 1e-6); their per-tensor norms are compared instead, which a lost
    gradient still fails.  A resumed run (``reference.first_step`` > 0) has no such first step:
    its first step runs on weights the steps before the checkpoint set apart, so every step is
    compared by its norms.  SGD's step is linear in the gradient: every kept step whole."""
    whole, norms = dict(grads), dict(grad_norms)
    if reference.noise is None or not whole or (len(whole) < 2 and not reference.first_step):
        return whole, norms
    first = min(whole) if not reference.first_step else -1
    for step in [s for s in whole if s != first]:
        norms[step] = {name: grad_norm(g) for name, g in whole.pop(step).items()}
    return whole, norms


def _compare_gradients(
    reference: ReferenceResult,
    groups: Sequence[Sequence[str]],
    grads: Mapping[int, Mapping[str, Tensor | None]],
    grad_norms: Mapping[int, Mapping[str, float]],
) -> list[Category]:
    """The gradient categories of :func:`compare`: whole gradients (relative to their norm, and
    near zero against the model's), then the norms of the other steps (empty: none compared)."""
    if not grads and not grad_norms:
        return []
    full, near, norm = _Worst(), _Worst(), _Worst()
    near_names: set[str] = set()
    for step in sorted(set(grads) | set(grad_norms)):
        ref_norms = reference.tensor_grad_norms[step] if step < len(reference.tensor_grad_norms) else {}
        mine = grad_norms.get(step, {})
        whole = grads.get(step)
        if not ref_norms or not (whole or mine):
            if bool(ref_norms) != bool(whole or mine):
                norm.add(math.inf, f"step {step}: skipped for inf/NaN gradients in one run only")
            continue
        floor = GRAD_FLOOR * _model_grad_norm(ref_norms, groups)
        ref_whole = reference.grads.get(step, {})
        for name in whole if whole else mine:
            if name not in ref_norms:
                continue  # not a parameter of the reference: the parameters' comparison says so
            nb = ref_norms[name]
            scale = max(nb, floor)
            if whole and name in ref_whole:
                b = ref_whole[name].double()
                a = whole[name]
                diff = grad_norm((a.detach().double().cpu() if a is not None else torch.zeros_like(b)) - b)
                d = diff / scale if scale > 0 else diff
                if nb < floor:
                    near_names.add(name)
                    near.add(d, f"{name} (step {step})")
                else:
                    full.add(d, f"{name} (step {step})")
            else:
                diff = abs(mine.get(name, 0.0) - nb)
                norm.add(diff / scale if scale > 0 else diff, f"{name} (step {step})")
    at = ", ".join(map(str, sorted(grads)))
    out = []
    if grads:
        out.append(Category("gradients", f"||a - b|| / ||b|| per tensor at step(s) {at}", full.count, full.max, full.where))
    if near.count:
        out.append(
            Category(
                "near-zero gradients",
                f"||a - b|| / ({GRAD_FLOOR:g} x the model's gradient norm) per tensor at step(s) {at}, for the "
                "tensors whose gradient norm is below that",
                near.count, near.max, near.where, sorted(near_names),
            )
        )  # fmt: skip
    if norm.count:
        out.append(
            Category(
                "gradient norms",
                f"| ||a|| - ||b|| | / max(||b||, {GRAD_FLOOR:g} x the model's gradient norm) per tensor at the "
                "steps whose whole gradients are not compared",
                norm.count, norm.max, norm.where,
            )
        )  # fmt: skip
    return out
