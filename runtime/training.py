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


def optimizer_class(name: str, *, fused: bool = False) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer of ``name`` (``sgd``, ``sgd-momentum`` (0.9), ``adam``, ``adamw``; torch
    defaults otherwise) and its keyword arguments, with the kernels the plan's memory counts
    (``TrainingSetup.fused_optimizer``): fused Adam/AdamW, which allocate nothing in their step,
    or foreach kernels, torch's default on GPUs, whose Adam/AdamW step holds one temporary the size
    of the parameters (``planner.presets.OPTIMIZER_STEP_TEMPORARIES``).  Asked for explicitly,
    so a CPU run (torch's default there: one tensor at a time) holds what the plan says."""
    check_optimizer_supported(name)
    kernels: dict[str, Any] = {"fused": True} if fused and name in ("adam", "adamw") else {"foreach": True}
    if name == "sgd":
        return torch.optim.SGD, kernels
    if name == "sgd-momentum":
        return torch.optim.SGD, {"momentum": 0.9, **kernels}
    if name == "adam":
        return torch.optim.Adam, kernels
    return torch.optim.AdamW, kernels


def make_optimizer(
    name: str, params: Iterable[nn.Parameter], *, lr: float, fused: bool = False
) -> torch.optim.Optimizer:
    """The optimizer :func:`optimizer_class` says, over ``params``: one parameter group per
    device mesh (DTensor parameters of a tensor-parallel or FSDP2 mesh) and one for plain
    tensors, since a foreach or fused kernel runs one group's tensors together and DTensor
    refuses a list that mixes them."""
    cls, extra = optimizer_class(name, fused=fused)
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return cls([{"params": ps} for ps in groups.values()], **{"lr": lr, **extra})


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


def grad_norm(g: Tensor | None) -> float:
    """The L2 norm of a gradient in float64 (None: 0)."""
    return 0.0 if g is None else float(torch.linalg.vector_norm(g.detach().double()))


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


@dataclass(frozen=True)
class Category:
    """One kind of figure ``--check`` compares: how, how many, the largest difference, where."""

    name: str
    #: how a difference is measured, in words
    measure: str
    compared: int
    max_diff: float
    #: the tensor (and step) of the largest difference
    worst: str = ""
    #: the tensors in it, for the categories that are exceptions (near-zero gradients, the
    #: Adam noise allowance); empty for the others
    tensors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Comparison:
    max_loss_rel_diff: float
    max_param_rel_diff: float
    worst_param: str
    params_compared: int
    missing: list[str]
    #: the largest gradient difference (:data:`GRAD_FLOOR`), over every compared step
    max_grad_rel_diff: float = 0.0
    worst_grad: str = ""
    categories: list[Category] = field(default_factory=list)

    def passed(self, tolerance: float, *, grad_tolerance: float | None = None) -> bool:
        """Losses and parameters within ``tolerance``, gradients within ``grad_tolerance``
        (default: ``tolerance``; see :func:`grad_tolerance`)."""
        grad_tol = tolerance if grad_tolerance is None else grad_tolerance
        return self.max_loss_rel_diff <= tolerance and self.max_param_rel_diff <= tolerance and self.max_grad_rel_diff <= grad_tol


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


#: gradients are compared per tensor by ``||a - b|| / max(||b||, GRAD_FLOOR * ||G||)``, ``G``
#: the whole model's gradient that step (the reference's): relative to the tensor's own norm,
#: except for a tensor whose gradient is near zero in the reference (an attention key bias of
#: its own, whose true gradient is zero: what remains is rounding noise of terms that cancel),
#: which is compared absolutely, against ``GRAD_FLOOR`` of the model's gradient norm.  Measured
#: on the zoo's GPT-2 (float32, 2 ranks, Adam): after 10 steps every tensor's gradient differs
#: by at most 6.4e-7 of its own norm, the smallest tensors (4e-5 of the model's norm) included,
#: and a key bias's gradient is ~1e-13 of the model's norm, 1e-8 of the floor
GRAD_FLOOR = 1e-5
#: with Adam or AdamW, a gradient element below NOISE_LEVEL of the model's root-mean-square
#: gradient element (``||G|| / sqrt(N)``) at a compared step counts as rounding noise
#: (:func:`_noise_allowance`).  Measured (float32, 2 ranks, 10 steps of Adam at lr 1e-3): the
#: attention key biases' gradients, zero in exact arithmetic, are ~1e-11 of that root mean
#: square on the zoo's GPT-2 and BERT; Qwen2's key biases (rotary: a real, tiny gradient) have
#: elements at ~1e-6 of it at the first and last steps that moved 3e-7 differently (between those
#: steps, not compared whole, their gradient was noise), hence the margin up to 1e-4
NOISE_LEVEL = 1e-4


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


def _model_grad_norm(norms: Mapping[str, float], groups: Sequence[Sequence[str]]) -> float:
    """The whole model's gradient norm from per-tensor norms (each tensor once)."""
    return math.sqrt(sum(norms.get(g[0], 0.0) ** 2 for g in groups))


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
