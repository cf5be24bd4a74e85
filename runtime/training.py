"""What the pipelined run and the single-process reference share: data, optimizer, learning
rate, mixed precision, gradient clipping, comparison.

Both sides must see the same batches, build the same optimizer, schedule the learning rate,
scale and clip gradients and reduce losses the same way, or ``--check`` would compare
different things.

Each part lives in its own module, and every name stays importable from here:
:mod:`runtime.batches` (the global batch of a step, a replica's rows, fingerprints),
:mod:`runtime.optimizers` (the optimizer and its kernels), :mod:`runtime.train_options` (the
options, dtypes, tolerances, autocast and float16's loss scale), :mod:`runtime.grad_math`
(norms, clipping, inf/NaN, each parameter once), :mod:`runtime.reference` (the unsplit
reference run) and ``--check``'s comparison: :mod:`runtime.check_compare` (:func:`compare`),
:mod:`runtime.check_gradients` (its gradient categories), :mod:`runtime.check_noise` (the
Adam noise allowance) and :mod:`runtime.check_result` (what it returns).
"""

from __future__ import annotations

from runtime.batches import batch_fingerprint, global_batch, replica_shard, synthetic_batch
from runtime.check_compare import LOSS_FLOOR, PARAM_FLOOR, compare, relative_difference
from runtime.check_gradients import GRAD_FLOOR
from runtime.check_gradients import _compare_gradients as _compare_gradients
from runtime.check_gradients import _gradients_compared as _gradients_compared
from runtime.check_gradients import _Worst as _Worst
from runtime.check_noise import NOISE_LEVEL, NoiseBound, noise_bound
from runtime.check_noise import _noise_allowance as _noise_allowance
from runtime.check_noise import _noise_levels as _noise_levels
from runtime.check_result import Category, Comparison
from runtime.grad_math import _model_grad_norm as _model_grad_norm
from runtime.grad_math import (
    clip_coefficient,
    grad_norm,
    has_nonfinite,
    squared_norm,
    unique_parameters,
)
from runtime.optimizers import make_optimizer, optimizer_class
from runtime.reference import ReferenceResult, train_reference
from runtime.reference import _mark_noise as _mark_noise
from runtime.train_options import (
    DEFAULT_TOLERANCES,
    GRAD_TOLERANCE_FACTOR_16BIT,
    LR_SCHEDULES,
    RUN_DTYPES,
    LossScaler,
    TrainOptions,
    autocast,
    grad_tolerance,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "GRAD_FLOOR",
    "GRAD_TOLERANCE_FACTOR_16BIT",
    "LOSS_FLOOR",
    "LR_SCHEDULES",
    "NOISE_LEVEL",
    "PARAM_FLOOR",
    "RUN_DTYPES",
    "Category",
    "Comparison",
    "LossScaler",
    "NoiseBound",
    "ReferenceResult",
    "TrainOptions",
    "autocast",
    "batch_fingerprint",
    "clip_coefficient",
    "compare",
    "global_batch",
    "grad_norm",
    "grad_tolerance",
    "has_nonfinite",
    "make_optimizer",
    "noise_bound",
    "optimizer_class",
    "relative_difference",
    "replica_shard",
    "squared_norm",
    "synthetic_batch",
    "train_reference",
    "unique_parameters",
]
