"""``--check`` with Adam or AdamW: how far the optimizer can move a parameter whose gradient is
rounding noise (:class:`NoiseBound`), the gradient size below which an element counts as noise
(:data:`NOISE_LEVEL`) and the per-element allowance :func:`runtime.check_compare.compare` takes
off the parameters' difference (:func:`_noise_allowance`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from runtime.grad_math import _model_grad_norm

if TYPE_CHECKING:
    from runtime.reference import ReferenceResult


@dataclass(frozen=True)
class NoiseBound:
    """How far an Adam-type optimizer moves a parameter whose gradient is rounding noise.

    Adam steps by ``lr * m / (sqrt(v) + eps)`` (bias-corrected moments): whatever the gradient's
    size, one step moves an element by at most ``lr * max(1, (1 - beta1) / sqrt(1 - beta2))``
    (Kingma and Ba, section 2.1; 3.16 lr with torch's betas (0.9, 0.999)).  Where the true
    gradient is zero (an attention key bias: softmax ignores it) the gradient is rounding noise,
    different in two runs that sum the same terms in another order, and the step is noise of
    order ``lr * |g| / (|g| + eps)``.  :func:`compare` allows a parameter element to differ by
    ``2 * max_move * sum(lr) * min(1, rho)``, ``rho = |g_a - g_b| / (min(|g_a|, |g_b|) + eps)``:
    the relative disagreement of its gradients (1 or more: noise), ``eps`` keeping gradients far
    below ``eps`` (which Adam barely moves on) from counting as unresolved."""

    #: the largest move of one step, in units of lr
    max_move: float
    eps: float


def noise_bound(opt: torch.optim.Optimizer) -> NoiseBound | None:
    """The :class:`NoiseBound` of an Adam or AdamW optimizer (its first group's betas and eps);
    None for other optimizers (SGD's step is linear in the gradient: no allowance)."""
    if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        return None
    group = opt.param_groups[0]
    beta1, beta2 = group["betas"]
    return NoiseBound(max_move=max(1.0, (1.0 - beta1) / math.sqrt(1.0 - beta2)), eps=float(group["eps"]))


#: with Adam or AdamW, a gradient element below NOISE_LEVEL of the model's root-mean-square
#: gradient element (``||G|| / sqrt(N)``) at a compared step counts as rounding noise
#: (:func:`_noise_allowance`).  Measured (float32, 2 ranks, 10 steps of Adam at lr 1e-3): the
#: attention key biases' gradients, zero in exact arithmetic, are ~1e-11 of that root mean
#: square on the zoo's GPT-2 and BERT; Qwen2's key biases (rotary: a real, tiny gradient) have
#: elements at ~1e-6 of it at the first and last steps that moved 3e-7 differently (between those
#: steps, not compared whole, their gradient was noise), hence the margin up to 1e-4
NOISE_LEVEL = 1e-4


def _noise_levels(
    reference: ReferenceResult, groups: Sequence[Sequence[str]], grads: Mapping[int, Any]
) -> dict[int, float]:
    """Step -> the gradient size below which an element counts as rounding noise:
    ``NOISE_LEVEL`` of the model's root-mean-square gradient element, ``||G|| / sqrt(N)``."""
    n = sum(reference.params[g[0]].numel() for g in groups if g[0] in reference.params)
    out = {}
    for step in grads:
        if step < len(reference.tensor_grad_norms) and reference.tensor_grad_norms[step] and n:
            out[step] = NOISE_LEVEL * _model_grad_norm(reference.tensor_grad_norms[step], groups) / math.sqrt(n)
    return out


def _noise_allowance(
    name: str,
    shape: Any,
    grads: Mapping[int, Mapping[str, Tensor | None]],
    ref_grads: Mapping[int, Mapping[str, Tensor]],
    noise: NoiseBound,
    lr_sum: float,
    levels: Mapping[int, float],
    *,
    before: Tensor | None = None,
) -> Tensor | None:
    """Per element, how far the optimizer may have moved ``name`` on gradient noise, over the
    compared steps (:class:`NoiseBound`): ``2 * max_move * lr_sum`` where the element's gradient
    is rounding noise at one of them (below ``levels[step]`` in either run), else that times
    ``min(1, rho)``, ``rho`` its gradients' largest relative disagreement (Adam's step is a smooth
    function of a resolved gradient); None without gradients.

    ``before`` (a resumed run, :attr:`ReferenceResult.noise_before`): the elements whose
    gradient was noise, in the reference, at a step before the checkpoint.  ``lr_sum`` counts
    every step from 0, those steps included, and the parameters' difference accumulated over
    them as well: such an element gets the whole allowance, as it would have in the
    uninterrupted run.  The resumed run's own gradients of those steps are gone (the checkpoint
    holds none, and the run that wrote it may not have been checked), so the reference's gradient
    alone says where they were noise; the other elements keep ``rho`` of the compared steps, which
    stands for every step as it does in an uninterrupted run."""
    rho: Tensor | None = None
    if before is not None and tuple(before.shape) == tuple(shape):
        rho = before.double()
    for step, mine in grads.items():
        b = ref_grads.get(step, {}).get(name)
        if b is None or tuple(b.shape) != tuple(shape) or step not in levels:
            continue
        a = mine.get(name)
        b64 = b.detach().double()
        a64 = a.detach().double().cpu() if a is not None else torch.zeros_like(b64)
        r = (a64 - b64).abs() / (torch.minimum(a64.abs(), b64.abs()) + noise.eps)
        r = torch.where(torch.minimum(a64.abs(), b64.abs()) <= levels[step], torch.ones_like(r), r)
        rho = r if rho is None else torch.maximum(rho, r)
    if rho is None:
        return None
    return 2.0 * noise.max_move * lr_sum * rho.clamp(max=1.0)
