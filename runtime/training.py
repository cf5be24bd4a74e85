"""What the pipelined run and the single-process reference share: data, optimizer, learning
rate, mixed precision, gradient clipping, comparison.

Both sides must see the same batches, build the same optimizer, schedule the learning rate,
scale and clip gradients and reduce losses the same way, or ``--check`` would compare
different things.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from runtime.plan_check import check_optimizer_supported


def synthetic_batch(example_inputs: Sequence[Tensor], batch_size: int, *, seed: int, step: int) -> tuple[Tensor, ...]:
    """One global batch shaped like ``example_inputs`` (batch dimension ``batch_size``).

    Floating inputs are standard normal; integer inputs (token ids, labels) are uniform over
    the range the example spans; booleans are fair coins.  The same ``(seed, step)`` gives
    the same batch on every rank and in the reference.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out = []
    for t in example_inputs:
        shape = (batch_size, *t.shape[1:])
        if t.dtype == torch.bool:
            x = torch.randint(0, 2, shape, generator=gen).bool()
        elif t.is_floating_point() or t.is_complex():
            x = torch.randn(shape, generator=gen, dtype=torch.float32).to(t.dtype)
        else:
            lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 1)
            x = torch.randint(lo, max(hi, lo) + 1, shape, generator=gen, dtype=t.dtype)
        out.append(x)
    return tuple(out)


def global_batch(
    example_inputs: Sequence[Tensor],
    batch_size: int,
    *,
    seed: int,
    step: int,
    data_fn: Callable[[int, int], Any] | None = None,
    spec: str = "the entry point",
    keywords: Sequence[str] = (),
) -> tuple[Tensor, ...]:
    """The global batch of ``step``: ``data_fn(step, batch_size)`` when given, else synthetic.

    The data function's batch is checked against ``example_inputs`` (shapes, dtypes) and an
    :class:`~planner.errors.InputError` says what came back instead.  ``seed`` only shapes
    the synthetic data: a data function depends on ``(step, batch_size)`` alone.
    """
    if data_fn is None:
        return synthetic_batch(example_inputs, batch_size, seed=seed, step=step)
    from profiler.loading import call_data_fn

    return call_data_fn(data_fn, example_inputs, step=step, batch_size=batch_size, spec=spec, keywords=keywords)


def batch_fingerprint(batch: Sequence[Tensor]) -> int:
    """A 63-bit hash of a batch's shapes, dtypes and bytes (to check that ranks agree)."""
    h = hashlib.blake2b(digest_size=8)
    for t in batch:
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def replica_shard(batch: Sequence[Tensor], replica: int, replicas: int) -> tuple[Tensor, ...]:
    """Rows of data-parallel replica ``replica`` (contiguous, equal shares)."""
    n = batch[0].shape[0] // replicas
    return tuple(t[replica * n : (replica + 1) * n] for t in batch)


def make_optimizer(name: str, params: Iterable[nn.Parameter], *, lr: float) -> torch.optim.Optimizer:
    """``sgd``, ``sgd-momentum`` (0.9), ``adam``, ``adamw`` (torch defaults otherwise)."""
    check_optimizer_supported(name)
    plist = list(params)
    if name == "sgd":
        return torch.optim.SGD(plist, lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(plist, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(plist, lr=lr)
    return torch.optim.AdamW(plist, lr=lr)


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


def squared_norm(grads: Iterable[Tensor]) -> Tensor:
    """Sum of squared L2 norms of ``grads`` in float64 (a part of the global norm; parts add)."""
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        total = total + torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double().cpu() ** 2
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies gradients by: min(1, max / (norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def has_nonfinite(grads: Iterable[Tensor]) -> bool:
    return any(not bool(torch.isfinite(g).all()) for g in grads)


def unique_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters of ``modules``, each tensor once (tied weights are one parameter)."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


@dataclass(frozen=True)
class ReferenceResult:
    losses: list[float]
    params: dict[str, Tensor]
    #: names of one tensor (tied weights: several names), every tensor once
    groups: list[list[str]] = field(default_factory=list)
    #: per step: the global gradient norm before clipping (when clipping), else empty
    grad_norms: list[float] = field(default_factory=list)


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
    stream of (seed, step, replica, micro-batch, layer), as the pipelined stages do.
    """
    from profiler.loading import Batch, call_model
    from profiler.split import RngStreams

    opts = options or TrainOptions(optimizer=optimizer, lr=lr, steps=steps)
    device = device or torch.device("cpu")
    model.to(device).train()
    streams = RngStreams(seed=seed)
    handles = seed_hooks(model, streams) if seed_hooks is not None else []
    params = unique_parameters([model])
    opt = make_optimizer(opts.optimizer, params, lr=opts.lr)
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
    return ReferenceResult(losses=losses, params=final, groups=list(by_tensor.values()), grad_norms=norms)


@dataclass(frozen=True)
class Comparison:
    max_loss_rel_diff: float
    max_param_rel_diff: float
    worst_param: str
    params_compared: int
    missing: list[str]


def relative_difference(a: Tensor, b: Tensor, *, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)`` (per tensor, so near-zero entries do not blow it up)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    scale = max(float(b64.abs().max()) if b64.numel() else 0.0, floor)
    diff = float((a64 - b64).abs().max()) if b64.numel() else 0.0
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
) -> Comparison:
    """Max relative differences between a pipelined run and the reference.

    Losses: ``|a - b| / max(|b|, LOSS_FLOOR)``.  Parameters: per tensor ``max|a - b| /
    max(max|b|, PARAM_FLOOR)``.  Tied weights are matched by storage: every tensor of the reference (under
    any of its names) must have a pipelined value under one of those names, so a shared
    weight whose owner module is never called (T5's ``shared``) is still compared once.
    """
    loss_diff = 0.0
    if len(losses) != len(reference.losses):
        loss_diff = math.inf
    for a, b in zip(losses, reference.losses, strict=False):
        loss_diff = max(loss_diff, abs(a - b) / max(abs(b), LOSS_FLOOR))
    worst, worst_name = 0.0, ""
    groups = reference.groups or [[name] for name in reference.params]
    missing = [g[0] for g in groups if not any(name in params for name in g)]
    for name, value in params.items():
        ref = reference.params.get(name)
        if ref is None or ref.shape != value.shape:
            missing.append(name)
            continue
        d = relative_difference(value, ref, floor=PARAM_FLOOR)
        if d > worst or not worst_name:
            worst, worst_name = d, name
    if missing:
        worst = math.inf
        worst_name = f"{len(missing)} parameter(s) not matched, e.g. {missing[0]}"
    return Comparison(
        max_loss_rel_diff=loss_diff,
        max_param_rel_diff=worst,
        worst_param=worst_name,
        params_compared=len(params),
        missing=missing,
    )
