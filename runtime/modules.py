"""Module wrappers and example activations for the executor's stages (needs torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class CheckpointedUnit(nn.Module):
    """Runs ``inner`` (one unit of a :class:`profiler.split.StageModule`) under
    ``torch.utils.checkpoint`` (non-reentrant): the unit keeps only its inputs per micro-batch
    and re-runs its own forward in the backward pass, when its first saved tensor is needed.

    The recomputation draws the same random numbers as the forward: the stage module seeds
    the unit's own stream (:attr:`StageModule.rng`) right before calling it, so the RNG state
    the checkpoint stashes on entry (``preserve_rng_state``) is that stream's start, and it is
    restored for the recomputation -- whatever step or micro-batch the streams are at by then.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True)


def checkpoint_layers(stage_module: nn.Module, layers: int) -> nn.Module:
    """Checkpoint the first ``layers`` units of ``stage_module`` (a ``StageModule``) one by one,
    as Megatron-LM (``--recompute-method block``), torchtitan and DeepSpeed do; returns it.

    Each of them becomes a :class:`CheckpointedUnit` in place (the stage's other units, its
    parameters and their names inside the units stay as they are)."""
    units: Any = getattr(stage_module, "units", None)
    if units is None:
        raise TypeError(f"{type(stage_module).__name__} has no units to checkpoint: give a profiler StageModule")
    if not 0 <= layers <= len(units):
        raise ValueError(
            f"cannot checkpoint {layers} layer(s) of a stage of {len(units)}: give a count from 0 to "
            f"{len(units)} (the plan's recompute_layers)"
        )
    for i in range(layers):
        if not isinstance(units[i], CheckpointedUnit):
            units[i] = CheckpointedUnit(units[i])
    return stage_module


class SkipFrom(nn.Module):
    """Test-only (``--inject-fault RANK:STEP:skip-layer``): from step ``step`` on (the step is
    ``step_box[0]``) hands its inputs on unchanged instead of running ``inner``, as a split that
    lost a layer would; ``--check`` must fail.  ``inner``'s outputs must be shaped like its inputs."""

    def __init__(self, inner: nn.Module, step_box: Sequence[int], step: int) -> None:
        super().__init__()
        self.inner = inner
        self.step_box = step_box
        self.step = step

    def forward(self, *args: Any) -> Any:
        if self.step_box[0] >= self.step:
            return tuple(args)
        return self.inner(*args)


class Autocast(nn.Module):
    """Runs ``inner`` under ``torch.autocast`` to a 16-bit ``dtype`` (float32 parameters stay
    the master weights: autocast casts them per operation, and their gradients are float32)."""

    def __init__(self, inner: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.inner(*args)


class NoViewOutputs(nn.Module):
    """Runs ``inner`` and copies each output that is a view of another tensor.  torch's split
    backward (a zero-bubble schedule's ``I``) detaches the stage's outputs in place afterwards,
    which a view refuses (a ``flatten`` or ``reshape`` at the end of a stage)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        out = self.inner(*args)
        if isinstance(out, Tensor):
            return out.clone() if out._is_view() else out
        if isinstance(out, tuple):
            return tuple(t.clone() if isinstance(t, Tensor) and t._is_view() else t for t in out)
        return out


def stage_examples(
    split: Any,
    example_inputs: Sequence[Tensor],
    microbatch_size: int,
    device: torch.device,
    *,
    dtype: str = "float32",
) -> list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]:
    """Per unit: (its inputs, its outputs) on one micro-batch of the example inputs.

    Real values, as a training step computes them (integer ids in their range, masks,
    ``requires_grad`` as in training, the dtypes autocast to ``dtype`` gives), for
    ``PipelineStage(input_args=..., output_args=...)``; outputs contiguous, as a pipeline
    stage sends them.  The model's state (BatchNorm statistics) and the RNG are left as they
    were.
    """
    from profiler.measure import resize_batch
    from runtime.training import autocast

    model = split.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    devices = [device.index or 0] if device.type == "cuda" else []
    out: list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            x: tuple[Any, ...] = tuple(t.to(device) for t in resize_batch(example_inputs, microbatch_size))
            for u, unit in enumerate(split.units):
                with autocast(device, dtype):
                    y = unit(*x)
                ins = x if u == 0 else tuple(t.contiguous() for t in x)  # received as sent: contiguous
                out.append((_fresh(ins), _fresh(tuple(t.contiguous() for t in y))))
                x = tuple(t.detach().requires_grad_(t.requires_grad) for t in y)
    finally:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(state[k])
        model.zero_grad(set_to_none=True)
    return out


def _fresh(values: tuple[Any, ...]) -> tuple[Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in values)
