"""The steps of ``--check``'s unsplit reference (:func:`runtime.reference.train_reference`): the
model, its optimizer and float16's loss scale in one process (:class:`ReferenceTrainer`), each
step in the order GPipe's maths and the pipelined run take it: the micro-batches' forward and
backward, the gradient averages, unscaling, clipping, then the optimizer step (what each step
records: :mod:`runtime.reference_result`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from runtime.check_noise import noise_bound
from runtime.grad_math import clip_coefficient, has_nonfinite, squared_norm, unique_parameters
from runtime.optimizers import make_optimizer
from runtime.reference_result import ReferenceRecords
from runtime.train_options import LossScaler, TrainOptions, autocast


class ReferenceTrainer:
    """The unsplit model, its optimizer and loss scale, and what its steps recorded
    (:attr:`records`)."""

    def __init__(
        self, model: nn.Module, opts: TrainOptions, device: torch.device, *, seed: int,
        microbatches: int, microbatch_size: int, keywords: Sequence[str] = (),
        seed_hooks: Callable[[nn.Module, Any], list[Any]] | None = None,
        grad_steps: Sequence[int] = (), first_step: int = 0,
    ) -> None:  # fmt: skip
        from profiler.split import RngStreams

        self.model, self.opts, self.device, self.keywords = model, opts, device, keywords
        self.microbatches, self.microbatch_size = microbatches, microbatch_size
        model.to(device).train()
        self.streams = RngStreams(seed=seed)
        self.handles = seed_hooks(model, self.streams) if seed_hooks is not None else []
        self.params = unique_parameters([model])
        names_of: dict[int, list[str]] = {}  # id of a parameter -> its names (tied weights: several)
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
        self.opt = make_optimizer(opts.optimizer, self.params, lr=opts.lr, fused=opts.fused_optimizer)
        self.scaler = LossScaler(opts.dtype == "float16")
        self.records = ReferenceRecords(
            self.params, names_of, set(grad_steps), first_step, noise=noise_bound(self.opt)
        )

    def step(self, step: int, shards: Sequence[Any], loss: Any) -> None:
        """One training step on ``shards`` (each replica's rows of the global batch)."""
        self.streams.step = step
        total = self._accumulate(shards, loss)
        skip = self._unscale_check_clip()
        for group in self.opt.param_groups:
            group["lr"] = self.opts.lr_at(step)
        self.records.gradients(step, skip)
        self.records.lrs.append(0.0 if skip else self.opts.lr_at(step))
        if not skip:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.records.losses.append(total / (self.microbatches * len(shards)))

    def _accumulate(self, shards: Sequence[Any], loss: Any) -> float:
        """Every micro-batch's forward and backward, replica by replica; leaves the averaged
        gradient (mean over a replica's micro-batches, then over replicas) in ``p.grad``, still
        scaled; returns the sum of the micro-batches' losses."""
        total = 0.0
        summed: list[Tensor | None] = [None] * len(self.params)
        n = self.microbatch_size
        for d, shard in enumerate(shards):
            self.streams.replica = d
            for i in range(self.microbatches):
                self.streams.microbatch = i
                total += self._forward_backward(shard.rows(i * n, (i + 1) * n), loss)
            # as the schedule does: the replica's gradient is the mean over its micro-batches,
            # then the data-parallel all-reduce sums the replicas and divides by their number
            for j, p in enumerate(self.params):
                if p.grad is not None:
                    g = p.grad / self.microbatches
                    prev = summed[j]
                    summed[j] = g if prev is None else prev + g
                    p.grad = None
        for p, total_grad in zip(self.params, summed, strict=True):
            if total_grad is not None and len(shards) > 1:
                total_grad = total_grad / len(shards)
            if total_grad is not None and self.scaler.enabled:
                total_grad = total_grad / self.scaler.scale
            p.grad = total_grad
        return total

    def _forward_backward(self, mb: Any, loss: Any) -> float:
        """One micro-batch under the stages' autocast; its loss, before loss scaling."""
        from profiler.loading import call_model

        inputs = [t.to(self.device) for t in mb.inputs]
        with autocast(self.device, self.opts.dtype):
            out = call_model(self.model, inputs, self.keywords)
            value = loss(out) if mb.targets is None else loss(out, mb.targets.to(self.device))
        (value * self.scaler.scale if self.scaler.enabled else value).backward()
        return float(value.detach())

    def _unscale_check_clip(self) -> bool:
        """Whether to skip the step (float16: an inf or NaN gradient; the loss scale updates),
        else clip the gradient to ``clip_grad_norm``, recording its norm."""
        grads = [p.grad for p in self.params if p.grad is not None]
        skip = self.scaler.enabled and has_nonfinite(grads)
        self.scaler.update(skip)
        if self.opts.clip_grad_norm is not None:
            norm = math.nan if skip else math.sqrt(float(squared_norm(grads)))
            self.records.grad_norms.append(norm)
            if not skip:
                coef = clip_coefficient(norm, self.opts.clip_grad_norm)
                for g in grads:
                    g.mul_(coef)
        return skip
