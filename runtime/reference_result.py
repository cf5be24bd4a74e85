"""What ``--check``'s unsplit reference keeps for the comparison: the records its steps add to
(:class:`ReferenceRecords`, filled by :class:`runtime.reference_trainer.ReferenceTrainer`) and
the finished run's :class:`ReferenceResult`, which :func:`runtime.check_compare.compare` reads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from runtime.check_noise import NOISE_LEVEL, NoiseBound
from runtime.grad_math import grad_norm


@dataclass(frozen=True)
class ReferenceResult:
    losses: list[float]
    params: dict[str, Tensor]
    #: names of one tensor (tied weights: several names), every tensor once
    groups: list[list[str]] = field(default_factory=list)
    #: per step: the global gradient norm before clipping (when clipping), else empty
    grad_norms: list[float] = field(default_factory=list)
    #: step -> name -> the gradient the optimizer stepped on (after averaging, unscaling and
    #: clipping; every name of a tied tensor), for the steps asked for (``grad_steps``)
    grads: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    #: per step: name -> the L2 norm of that gradient (a tensor without a gradient: 0); a step
    #: skipped for inf/NaN gradients: empty
    tensor_grad_norms: list[dict[str, float]] = field(default_factory=list)
    #: per step: the learning rate it stepped with (0 for a skipped step)
    lrs: list[float] = field(default_factory=list)
    #: Adam and AdamW: the optimizer's :class:`NoiseBound`; None for SGD
    noise: NoiseBound | None = None
    #: the step the compared run started at: a run resumed from a checkpoint, the checkpoint's
    #: step (the reference still trains every step from the seed's weights); else 0
    first_step: int = 0
    #: Adam and AdamW after ``--resume``: name -> per element, whether the reference's gradient
    #: was rounding noise (below the noise level, :data:`NOISE_LEVEL`) at one of the steps before
    #: ``first_step``, which moved the parameters too but whose gradients the resumed run never
    #: saw (:func:`_noise_allowance`); empty otherwise
    noise_before: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class ReferenceRecords:
    """What the reference's steps record so far: :class:`ReferenceResult`'s fields of the same
    names, and the noise masks of Adam after ``--resume``."""

    #: the unsplit model's parameters, every tensor once, and id of one -> its names
    params: list[nn.Parameter]
    names_of: dict[int, list[str]]
    #: the steps whose gradients to keep, and the step a resumed run started at
    grad_steps: set[int]
    first_step: int
    noise: NoiseBound | None
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    tensor_grad_norms: list[dict[str, float]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    #: id of a parameter -> where its gradient was noise at a step before ``first_step``
    noise_masks: dict[int, Tensor] = field(default_factory=dict)

    def gradients(self, step: int, skip: bool) -> None:
        """What the optimizer steps on at ``step`` (nothing for a skipped step): each tensor's
        norm, the noise masks before ``first_step``, the gradients themselves at ``grad_steps``."""
        norms_now: dict[str, float] = {}
        if not skip:
            for p in self.params:
                size = grad_norm(p.grad)
                for name in self.names_of.get(id(p), []):
                    norms_now[name] = size
            if self.noise is not None and step < self.first_step:
                grads = [p.grad for p in self.params if p.grad is not None]
                model_norm = math.sqrt(sum(v * v for v in map(grad_norm, grads)))
                _mark_noise(self.noise_masks, self.params, model_norm, sum(p.numel() for p in self.params))
            if step in self.grad_steps:
                kept: dict[str, Tensor] = {}
                for p in self.params:
                    g = p.grad.detach().cpu().clone() if p.grad is not None else torch.zeros_like(p, device="cpu")
                    kept.update((name, g) for name in self.names_of.get(id(p), []))
                self.grads[step] = kept
        self.tensor_grad_norms.append(norms_now)

    def result(self, model: nn.Module) -> ReferenceResult:
        """The finished run: these records and ``model``'s final parameters (every name)."""
        masks, names_of = self.noise_masks, self.names_of
        return ReferenceResult(
            losses=self.losses,
            params={name: p.detach().cpu().clone() for name, p in model.named_parameters(remove_duplicate=False)},
            groups=list(names_of.values()),
            grad_norms=self.grad_norms,
            grads=self.grads,
            tensor_grad_norms=self.tensor_grad_norms,
            lrs=self.lrs,
            noise=self.noise,
            first_step=self.first_step,
            noise_before={name: masks[id(p)] for p in self.params if id(p) in masks for name in names_of.get(id(p), [])},
        )


def _mark_noise(masks: dict[int, Tensor], params: Sequence[nn.Parameter], model_norm: float, numel: int) -> None:
    """Mark, in ``masks`` (id of a parameter -> boolean tensor, on CPU), the elements whose
    gradient this step is rounding noise: at most :data:`NOISE_LEVEL` of the model's
    root-mean-square gradient element, ``||G|| / sqrt(N)`` (:func:`_noise_levels`' level); a
    parameter without a gradient counts as noise everywhere (Adam moves it on its moments)."""
    level = NOISE_LEVEL * model_norm / math.sqrt(max(1, numel))
    for p in params:
        g = p.grad
        now = torch.ones(p.shape, dtype=torch.bool) if g is None else (g.detach().abs() <= level).cpu()
        prev = masks.get(id(p))
        masks[id(p)] = now if prev is None else prev | now
