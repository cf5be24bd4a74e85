"""``--check``'s unsplit reference: the model trained in one process exactly as GPipe's maths
says (:func:`train_reference`), on the same batches, optimizer, schedule, loss scale and clipping
as the pipelined run, and what it keeps for the comparison (:class:`ReferenceResult`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from runtime.batches import global_batch
from runtime.check_noise import NOISE_LEVEL, NoiseBound, noise_bound
from runtime.grad_math import (
    clip_coefficient,
    grad_norm,
    has_nonfinite,
    squared_norm,
    unique_parameters,
)
from runtime.optimizers import make_optimizer
from runtime.train_options import LossScaler, TrainOptions, autocast


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


def train_reference(
    model: nn.Module,
    example_inputs: Sequence[Tensor],
    loss: Any,
    *,
    steps: int,
    global_batch_size: int,
    microbatch_size: int,
    replicas: int = 1,
    optimizer: str,
    lr: float,
    seed: int,
    device: torch.device | None = None,
    data_fn: Callable[[int, int], Any] | None = None,
    keywords: Sequence[str] = (),
    seed_hooks: Callable[[nn.Module, Any], list[Any]] | None = None,
    source: Any = None,
    options: TrainOptions | None = None,
    grad_steps: Sequence[int] = (),
    first_step: int = 0,
) -> ReferenceResult:
    """Train the unsplit ``model`` in this process exactly as GPipe's maths says.

    Each step runs the global batch as ``global_batch_size / microbatch_size`` micro-batches,
    replica by replica as the pipelined run shards it, averages the gradients in the same
    order the schedule and the data-parallel all-reduce do (mean over a replica's
    micro-batches, then mean over replicas), unscales them (float16), clips them to the
    global norm, sets the step's learning rate and takes one optimizer step, every
    micro-batch's forward and loss under the same autocast as the stages.  The batches come
    from ``source`` (a :class:`runtime.data.DataSource`: one reading of the global batches, or
    one per replica for per-replica data) or else from :func:`global_batch` (``data_fn``
    when given, else synthetic with ``seed``), as on every rank; ``loss(output)``, or
    ``loss(output, targets)`` for batches with targets.  ``options`` default to the plain
    float32 run of ``optimizer`` and ``lr``.  Returns per-step mean losses and the final
    parameters by qualified name (tied weights under every name).  ``keywords``: the names
    of the trailing inputs passed by keyword.  ``seed_hooks(model, streams)``
    (:meth:`profiler.split.SplitModel.seed_hooks`) makes every layer draw from the random
    stream of (seed, step, replica, micro-batch, layer), as the pipelined stages do.  Every
    step records each tensor's gradient norm as the optimizer sees it, and the steps in
    ``grad_steps`` the gradients themselves, for :func:`compare`.

    ``first_step``: the step a resumed run (``--resume``) started at.  The reference still
    trains from step 0 (the seed's weights), so the check covers the save, the resharding and
    the load as well as the steps after them; with Adam or AdamW it also records, per element,
    where its gradient was rounding noise at a step before ``first_step``
    (:attr:`ReferenceResult.noise_before`), since the parameters' difference accumulated there too.
    """
    from profiler.loading import Batch, call_model
    from profiler.split import RngStreams

    opts = options or TrainOptions(optimizer=optimizer, lr=lr, steps=steps)
    device = device or torch.device("cpu")
    model.to(device).train()
    streams = RngStreams(seed=seed)
    handles = seed_hooks(model, streams) if seed_hooks is not None else []
    params = unique_parameters([model])
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    opt = make_optimizer(opts.optimizer, params, lr=opts.lr, fused=opts.fused_optimizer)
    noise = noise_bound(opt)
    # Adam after --resume: per tensor, where its gradient was noise before the checkpoint
    before: dict[int, Tensor] = {}
    numel = sum(p.numel() for p in params)
    keep = set(grad_steps)
    grads_at: dict[int, dict[str, Tensor]] = {}
    tensor_norms: list[dict[str, float]] = []
    lrs: list[float] = []
    scaler = LossScaler(opts.dtype == "float16")
    per_replica = global_batch_size // replicas // microbatch_size
    readers: list[Any] = []
    if source is not None:
        per = source.kind == "per-replica"
        readers = [source.open(d, replicas) for d in range(replicas)] if per else [source.open(0, 1)]
    losses = []
    norms: list[float] = []
    for step in range(steps):
        if source is not None:
            if source.kind == "per-replica":
                shards = [r.next(step)[0] for r in readers]
            else:
                whole = readers[0].next(step)[0]
                n = global_batch_size // replicas
                shards = [whole.rows(d * n, (d + 1) * n) for d in range(replicas)]
        else:
            whole = Batch(global_batch(example_inputs, global_batch_size, seed=seed, step=step, data_fn=data_fn, keywords=keywords))
            n = global_batch_size // replicas
            shards = [whole.rows(d * n, (d + 1) * n) for d in range(replicas)]
        streams.step = step
        total = 0.0
        summed: list[Tensor | None] = [None] * len(params)
        for d in range(replicas):
            shard = shards[d]
            streams.replica = d
            for i in range(per_replica):
                streams.microbatch = i
                mb = shard.rows(i * microbatch_size, (i + 1) * microbatch_size)
                inputs = [t.to(device) for t in mb.inputs]
                with autocast(device, opts.dtype):
                    out = call_model(model, inputs, keywords)
                    value = loss(out) if mb.targets is None else loss(out, mb.targets.to(device))
                (value * scaler.scale if scaler.enabled else value).backward()
                total += float(value.detach())
            # as the schedule does: the replica's gradient is the mean over its micro-batches,
            # then the data-parallel all-reduce sums the replicas and divides by their number
            for j, p in enumerate(params):
                if p.grad is not None:
                    g = p.grad / per_replica
                    prev = summed[j]
                    summed[j] = g if prev is None else prev + g
                    p.grad = None
        for p, total_grad in zip(params, summed, strict=True):
            if total_grad is not None and replicas > 1:
                total_grad = total_grad / replicas
            if total_grad is not None and scaler.enabled:
                total_grad = total_grad / scaler.scale
            p.grad = total_grad
        grads = [p.grad for p in params if p.grad is not None]
        skip = scaler.enabled and has_nonfinite(grads)
        scaler.update(skip)
        if opts.clip_grad_norm is not None:
            norm = math.nan if skip else math.sqrt(float(squared_norm(grads)))
            norms.append(norm)
            if not skip:
                coef = clip_coefficient(norm, opts.clip_grad_norm)
                for g in grads:
                    g.mul_(coef)
        for group in opt.param_groups:
            group["lr"] = opts.lr_at(step)
        # what the optimizer steps on, for the gradient comparison
        norms_now: dict[str, float] = {}
        if not skip:
            for p in params:
                size = grad_norm(p.grad)
                for name in names_of.get(id(p), []):
                    norms_now[name] = size
            if noise is not None and step < first_step:
                _mark_noise(before, params, math.sqrt(sum(v * v for v in map(grad_norm, grads))), numel)
            if step in keep:
                kept: dict[str, Tensor] = {}
                for p in params:
                    g = p.grad.detach().cpu().clone() if p.grad is not None else torch.zeros_like(p, device="cpu")
                    kept.update((name, g) for name in names_of.get(id(p), []))
                grads_at[step] = kept
        tensor_norms.append(norms_now)
        lrs.append(0.0 if skip else opts.lr_at(step))
        if not skip:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / (per_replica * replicas))
    for h in handles:
        h.remove()
    final = {name: p.detach().cpu().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return ReferenceResult(
        losses=losses,
        params=final,
        groups=list(by_tensor.values()),
        grad_norms=norms,
        grads=grads_at,
        tensor_grad_norms=tensor_norms,
        lrs=lrs,
        noise=noise,
        first_step=first_step,
        noise_before={name: before[id(p)] for p in params if id(p) in before for name in names_of.get(id(p), [])},
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
