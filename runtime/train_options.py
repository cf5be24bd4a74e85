"""How each step trains, the same in the pipelined run and the reference: the options
(:class:`TrainOptions`: optimizer, learning-rate schedule, clipping, dtype), the ``--dtype``
names, the ``--check`` tolerances per dtype, autocast and float16's dynamic loss scale
(:class:`LossScaler`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

LR_SCHEDULES = ("constant", "cosine")
#: ``--dtype`` names (short and long) -> torch's name
RUN_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32",
              "bfloat16": "bfloat16", "float16": "float16"}  # fmt: skip
#: the --check tolerance when none is given, per dtype.  The stages run the same 16-bit
#: operations on the same values as the unsplit model, so the measured differences are float32
#: rounding of the gradient reductions (~1e-8 on examples.charlm); but such a difference can tip
#: a weight's 16-bit cast to the neighbouring value, one 16-bit rounding step (bfloat16: 2**-7,
#: float16: 2**-10) in what follows, which the tolerance allows (see the README)
DEFAULT_TOLERANCES = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
#: in a 16-bit run --check judges gradients at this many times the tolerance: a weight whose
#: 16-bit cast tipped to the neighbouring value (above) changes the gradients computed from it
#: by about a 16-bit step in every layer it feeds (measured: 1.1e-2 on a LayerNorm bias of
#: examples.charlm after 20 AdamW steps in bf16, clipping and cosine schedule, lr 3e-3, where
#: the parameters differ by 9.7e-4); float32 runs judge gradients at the tolerance itself
GRAD_TOLERANCE_FACTOR_16BIT = 4.0


def grad_tolerance(tolerance: float, dtype: str) -> float:
    """The tolerance ``--check`` judges gradients at (:data:`GRAD_TOLERANCE_FACTOR_16BIT`)."""
    return tolerance if dtype == "float32" else GRAD_TOLERANCE_FACTOR_16BIT * tolerance


@dataclass(frozen=True)
class TrainOptions:
    """How each step trains, the same in the pipelined run and the reference."""

    optimizer: str
    lr: float
    steps: int
    lr_schedule: Literal["constant", "cosine"] = "constant"
    #: steps of linear warm-up from lr / warmup_steps to lr
    warmup_steps: int = 0
    #: the learning rate a cosine schedule ends at
    min_lr: float = 0.0
    #: clip the gradient to this global L2 norm (every stage, every replica); None: no clipping
    clip_grad_norm: float | None = None
    #: compute dtype: float32, or bfloat16/float16 under autocast with float32 master weights
    dtype: str = "float32"
    #: fused Adam/AdamW kernels (the plan's ``TrainingSetup.fused_optimizer``); else foreach
    fused_optimizer: bool = False

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (0-based): linear warm-up over ``warmup_steps``, then
        constant or a cosine decay to ``min_lr`` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        span = self.steps - self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, span)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def mixed(self) -> bool:
        return self.dtype != "float32"


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to ``dtype`` on ``device`` (nothing for float32)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype={"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])


class LossScaler:
    """Dynamic loss scaling for float16 (``torch.amp.GradScaler``'s rule): the loss is
    multiplied by ``scale`` before backward; a step whose gradients hold an inf or NaN is
    skipped and halves the scale; 2000 good steps in a row double it.  Disabled (scale 1)
    for other dtypes.  The decision needs every rank's gradients, so the caller reduces
    ``found_inf`` over the whole job before :meth:`update`."""

    def __init__(self, enabled: bool, *, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good = 0

    def state(self) -> tuple[float, int] | None:
        """``(scale, good steps in a row)`` to checkpoint; ``None`` when disabled."""
        return (self.scale, self._good) if self.enabled else None

    def restore(self, scale: float | None, good_steps: int) -> None:
        """Continue from a checkpoint's :meth:`state` (nothing when disabled or not saved)."""
        if self.enabled and scale is not None:
            self.scale, self._good = float(scale), int(good_steps)

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= 0.5
            self._good = 0
        else:
            self._good += 1
            if self._good == self.growth_interval:
                self.scale *= 2.0
                self._good = 0
