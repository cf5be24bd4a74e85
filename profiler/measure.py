"""Measure a PyTorch model per layer: time, activation memory, cut bytes (needs torch).

What is measured, per unit of :func:`profiler.split.split_model` and per micro-batch size:

* **time** of forward and backward: ``warmup`` training steps excluded, then timed steps
  run unit by unit (forward in order, backward in reverse, each unit timed apart); per unit
  the median is recorded, and the interquartile range as the spread.  How many timed steps:
  ``repeats`` when given, else adaptively (:mod:`profiler.sampling`): at least 5, then more
  until every unit's median is known within ``target_error`` or ``time_budget_s`` is spent;
  units that missed the target, and units faster than the timer's useful resolution, are
  listed in ``metadata.profiler`` (and flagged in the summary table).
  ``time.perf_counter`` on CPU (or the thread's CPU time, ``clock="cpu"``), CUDA events
  with synchronization on CUDA.  Each unit's backward is fed the *real* upstream gradient
  of that step (what the next unit's backward produced from the loss), so sparse or
  masked gradients cost what they cost in training.  The last unit's times include the loss.
* **activation bytes** kept for backward, through ``torch.autograd.graph.saved_tensors_hooks``:
  the saved tensors' storages, each counted once (on the first unit that saves it), without
  parameters and buffers; and **kept inputs**: a stage that starts at unit ``a`` receives its
  inputs as fresh tensors, and keeps those that its units save although an earlier unit
  saved them first (a ``ReLU`` saves its output, the next ``Linear`` saves it again as its
  input).  Per unit, the bytes of such inputs and the first unit from ``a`` on that saves
  each one (``LayerProfile.kept_inputs``), so that any stage ``[a, b)`` is predicted to keep
  exactly what it keeps when run as one module (the cost model adds them up).
* **output and cut bytes**: the tensors a unit sends to the next one (its own outputs,
  and also the skip connections passing through, for ``cut_bytes``).
* **parameter bytes**, tied weights counted once.
* on CUDA also the per-unit peak of ``torch.cuda.max_memory_allocated`` above the memory in
  use before the unit (reset before each), to cross-check the hook figure.
* the backward **split into its input-gradient part** (``I``, ``backward_input_ms``: what the
  previous stage waits for) **and its weight-gradient part** (``W``, ``backward_weight_ms``),
  timed on separate steps run with torch's own split (``stage_backward_input`` /
  ``stage_backward_weight``, what the pipeline runtime runs for a zero-bubble schedule's
  ``I`` and ``W``; :mod:`profiler._torch_private`), and the bytes still held between the two
  (``weight_grad_bytes``): the saved tensors the unit's graph still holds after its ``I`` (a
  storage several units hold counted once, on the last of them) plus the output gradients
  ``W`` starts from.  A unit whose inputs need no gradient (the first) has
  ``I = 0``: its whole backward is ``W``, as the runtime runs it.
* forward FLOPs from ``torch.utils.flop_counter`` (informational).
* the **operation census** (``LayerProfile.operations``): per unit and size, the GEMMs,
  attention and memory-bound bytes of one extra forward, untimed, run after the size's timed
  steps (:mod:`profiler.census`; the last unit's includes the loss, as its forward time does).
  A unit whose census forward fails at some size gets none (``metadata.profiler.census_failed``).
* for units that keep attention's score matrix (eager attention), Megatron's **selective
  recompute**: the bytes of the score tensors kept (softmax output, dropout mask and output)
  and the time to recompute them, :mod:`profiler.selective`; absent on other units.

The user's model is never touched: everything runs on a deep copy (parameters, buffers such
as BatchNorm statistics and ``.training`` flags stay as they were), and the global RNG state
and the torch thread count are restored afterwards.  The copy runs in training mode.
"""

from __future__ import annotations

import copy
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from planner.errors import InputError
from planner.schema import LayerProfile, MeasuredOn, Operation, Profile
from profiler import _hf_attention, _torch_private
from profiler._torch_fake import storage_key
from profiler.census import ShardedWeights, census
from profiler.loading import call_model, check_example_inputs, default_loss, model_inputs
from profiler.sampling import (
    TARGET_ERROR,
    TIME_BUDGET_S,
    Sampling,
    sample_steps,
    timer_floor,
    useful_resolution,
)
from profiler.selective import ScoreTrace, recompute_share, trace_scores
from profiler.sharding import own_modules, tensor_parallel_fields, units_sharded_weights
from profiler.split import SplitModel, frozen_state, split_model, tensor_bytes
from profiler.summary import print_summary

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InputError(f"dtype {dtype} is not supported: use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}: choose one of float32, bfloat16, float16")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resize_batch(inputs: Sequence[Tensor], size: int) -> tuple[Tensor, ...]:
    """Slice (or repeat, cycling through the samples) every input to ``size`` samples."""
    out = []
    for t in inputs:
        index = torch.arange(size, device=t.device) % t.shape[0]
        out.append(t.index_select(0, index))  # always a fresh, compact tensor
    return tuple(out)


@contextmanager
def preserved_global_state(device: torch.device) -> Iterator[None]:
    """Restore the RNG states and the thread count on exit."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


CLOCKS = ("wall", "cpu")


class _Timer:
    """CUDA events (synchronized) on CUDA; on CPU ``time.perf_counter`` (``clock="wall"``)
    or the calling thread's CPU time (``clock="cpu"``, one thread only)."""

    def __init__(self, device: torch.device, clock: str = "wall") -> None:
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if clock == "cpu" and not self.cuda else time.perf_counter

    def floor(self) -> tuple[float, float]:
        """(what this timer measures for an empty call, its clock's tick), ms."""
        if self.cuda:
            return timer_floor(time.perf_counter, lambda: self.time(lambda: None)[0], samples=50)
        return timer_floor(self.now, lambda: self.time(lambda: None)[0])

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end)), out
        t0 = self.now()
        out = fn()
        return (self.now() - t0) * 1e3, out


def _grad_inputs(values: Sequence[Any]) -> tuple[Any, ...]:
    """Fresh leaves for a unit's inputs (same storage); those that required grad still do."""
    out = []
    for v in values:
        if isinstance(v, Tensor):
            v = v.detach().requires_grad_(v.requires_grad)
        out.append(v)
    return tuple(out)


def _backward(outputs: Any, grads: Sequence[Tensor | None] | None) -> None:
    """Backward from a scalar loss (``grads is None``) or from outputs with upstream grads."""
    if grads is None:
        outputs.backward()
        return
    pairs = [
        (o, g)
        for o, g in zip(outputs, grads, strict=True)
        if isinstance(o, Tensor) and o.requires_grad and g is not None
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _quartile_spread(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return max(0.0, q[2] - q[0])


class SavedBytes:
    """Saved-tensor hook: storages saved for backward, once each, parameters excluded.

    ``savers[key]`` lists the units (``unit`` at the time of saving) that saved storage ``key``.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = set(exclude)
        self.bytes = 0
        self.unit = 0
        self.size: dict[int, int] = {}
        self.savers: dict[int, list[int]] = {}
        # every storage counted stays referenced until the pass ends: a storage saved by a branch
        # the forward then drops (a router's scores where the experts ignore them) is freed, and
        # a later tensor could take its address -- the key -- and go uncounted (seen on fake
        # DeepSeek-V3 blocks: identical blocks a few hundred bytes apart, run to run)
        self.alive: list[Any] = []

    def pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = storage_key(t)
        if key in self.exclude or storage.nbytes() == 0:
            return t
        if key not in self.size:
            self.size[key] = storage.nbytes()
            self.bytes += storage.nbytes()
            self.alive.append(storage)
        units = self.savers.setdefault(key, [])
        if not units or units[-1] != self.unit:
            units.append(self.unit)
        return t

    @staticmethod
    def unpack(t: Tensor) -> Tensor:
        return t


def state_storages(split: SplitModel) -> set[int]:
    """Storages of the model's parameters, buffers and every other tensor the units read."""
    tensors = [*split.model.parameters(), *split.model.buffers()]
    for unit in split.units:
        tensors += [*unit.parameters(), *unit.buffers()]
        graph = getattr(unit, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op == "get_attr":
                value = _fetch(unit, str(node.target))
                if isinstance(value, Tensor):
                    tensors.append(value)
    return {storage_key(t) for t in tensors}


def _fetch(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def kept_inputs(saved: SavedBytes, unit_inputs: Sequence[Sequence[Any]]) -> list[dict[int, int]]:
    """Per unit ``a``: ``{offset: bytes}`` a stage starting at ``a`` keeps of its own inputs
    beyond the first-saver counts, once it reaches unit ``a + offset`` (see the module doc).

    An input whose storage an earlier unit saved first is received as a fresh tensor and
    counts its full (contiguous) size at the first unit from ``a`` on that saves it; one
    first saved at or after ``a`` is already in that unit's count, by its storage size, so
    only the difference (a slice of a larger tensor) is added.
    """
    out: list[dict[int, int]] = [{} for _ in unit_inputs]
    for a in range(1, len(unit_inputs)):
        sizes: dict[int, int] = {}
        for t in unit_inputs[a]:
            if isinstance(t, Tensor) and t.numel():
                key = storage_key(t)
                sizes[key] = max(sizes.get(key, 0), t.numel() * t.element_size())
        for key, nbytes in sizes.items():
            savers = saved.savers.get(key)
            if not savers:
                continue
            later = [u for u in savers if u >= a]
            if not later:
                continue
            delta = nbytes - (saved.size[key] if savers[0] >= a else 0)
            if delta:
                offset = later[0] - a
                out[a][offset] = out[a].get(offset, 0) + delta
    return out


def _forward_flops(unit: nn.Module, inputs: Sequence[Any]) -> float | None:
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter, torch.no_grad():
            unit(*inputs)
        return float(counter.get_total_flops())
    except Exception:
        return None


def _forward_census(
    unit: nn.Module,
    inputs: Sequence[Any],
    then: Callable[[Any], Any] | None = None,
    *,
    sharded: ShardedWeights | None = None,
) -> list[Operation] | None:
    """The unit's operation census (:mod:`profiler.census`, with tensor-parallel roles where
    ``sharded``), ``None`` when its forward fails under the census's dispatch mode."""
    try:
        return census(unit, _grad_inputs(inputs), then=then, sharded=sharded)
    except Exception:
        return None


def profile(
    model: nn.Module,
    example_inputs: Any,
    *,
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    split_points: Sequence[str] | None = None,
    loss_fn: Callable[[Any], Tensor] | None = None,
    warmup: int = 2,
    repeats: int | None = None,
    num_threads: int | None = None,
    progress: bool = True,
    name: str | None = None,
    clock: str = "wall",
    keywords: Sequence[str] | None = None,
    time_budget_s: float = TIME_BUDGET_S,
    target_error: float = TARGET_ERROR,
) -> Profile:
    """Measure ``model`` per layer at each micro-batch size and return a :class:`Profile`.

    ``example_inputs``: a tensor, a tuple of tensors or a dict of keyword-argument tensors,
    each with a leading batch dimension (or flat tensors whose last ``len(keywords)`` are
    keyword arguments); they are re-sliced or repeated to every size in ``microbatch_sizes``.  ``loss_fn(output)``
    defaults to ``output.float().mean()``.  ``num_threads`` fixes torch's intra-op threads
    (default: the current setting); it is recorded in ``measured_on.num_threads``.
    ``split_points``: module names to cut before (default: every block).  ``repeats``: timed
    steps per size; ``None`` (default) repeats adaptively until every layer's median is known
    within ``target_error`` (relative) or ``time_budget_s`` seconds (over all sizes) are spent.

    ``clock`` (CPU only): ``"wall"`` times with ``time.perf_counter``; ``"cpu"`` counts the
    CPU time of the measuring thread (``time.thread_time``), which other processes on a
    busy machine do not inflate.  ``"cpu"`` needs ``num_threads=1``: with one intra-op
    thread all forward and backward work runs on the calling thread, so its CPU time is
    the wall time of an idle machine.  Recorded in ``metadata.profiler.clock``.
    """
    if keywords is None:
        inputs, kw = model_inputs(example_inputs, model)
    else:
        inputs, kw = check_example_inputs(example_inputs), tuple(keywords)
    sizes = sorted({int(b) for b in microbatch_sizes})
    if not sizes or sizes[0] < 1:
        raise InputError(f"microbatch sizes must be positive integers, got {list(microbatch_sizes)}")
    if warmup < 0 or (repeats is not None and repeats < 1):
        raise InputError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup} repeats={repeats}")
    if not (math.isfinite(time_budget_s) and time_budget_s > 0):
        raise InputError(f"time budget {time_budget_s!r} s: give a positive number of seconds, e.g. 30")
    if not (math.isfinite(target_error) and 0 < target_error < 1):
        raise InputError(f"target error {target_error!r}: give a fraction between 0 and 1, e.g. 0.02 for 2 %")
    dev = _parse_device(device)
    torch_dtype = parse_dtype(dtype)
    if num_threads is not None and num_threads < 1:
        raise InputError(f"num_threads must be >= 1, got {num_threads}")
    if clock not in CLOCKS:
        raise InputError(f"unknown clock {clock!r}: use wall or cpu")
    if clock == "cpu" and dev.type == "cpu" and num_threads != 1:
        raise InputError(
            f"clock 'cpu' needs one thread (num_threads=1 / --threads 1), got {num_threads}: the CPU "
            "time of one thread is the step time only when it does all the work"
        )
    with preserved_global_state(dev):
        threads = num_threads or torch.get_num_threads()
        torch.set_num_threads(threads)
        work = copy.deepcopy(model).to(device=dev, dtype=torch_dtype)
        work.train()
        dev_inputs = tuple(
            (t.to(device=dev, dtype=torch_dtype) if t.is_floating_point() else t.to(device=dev)) for t in inputs
        )
        split = split_model(work, dev_inputs, split_points=split_points, keywords=kw)
        result = measure_split(
            split,
            dev_inputs,
            microbatch_sizes=sizes,
            loss_fn=loss_fn,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
            clock=clock,
            name=name or type(model).__name__,
            time_budget_s=time_budget_s,
            target_error=target_error,
        )
    if progress:
        print_summary(result)
    return result


def measure_split(
    split: SplitModel,
    inputs: Sequence[Tensor],
    *,
    microbatch_sizes: Sequence[int],
    loss_fn: Callable[[Any], Tensor] | None = None,
    warmup: int = 2,
    repeats: int | None = None,
    progress: bool = False,
    clock: str = "wall",
    name: str | None = None,
    time_budget_s: float = TIME_BUDGET_S,
    target_error: float = TARGET_ERROR,
) -> Profile:
    """The profile of the units of ``split`` (already on its device and dtype), measured at
    each micro-batch size on ``inputs`` (flat, as ``split`` takes them) with the current
    thread count.  :func:`profile` is this on a copy of the model, with the checks."""
    sizes = sorted({int(b) for b in microbatch_sizes})
    inputs = tuple(inputs)
    dev = inputs[0].device
    loss = loss_fn or default_loss
    timing: dict[str, Any] = {}
    layers = _measure(
        split,
        inputs,
        sizes,
        loss=loss,
        device=dev,
        warmup=warmup,
        repeats=repeats,
        progress=progress,
        clock=clock,
        time_budget_s=time_budget_s,
        target_error=target_error,
        record=timing,
    )
    input_bytes = [tensor_bytes(resize_batch(inputs, b)) for b in sizes]
    param_bytes = split.param_bytes()
    add_tensor_parallel_fields(split, layers, input_bytes)
    layer_profiles = [
        LayerProfile(name=split.names[i], param_bytes=param_bytes[i], kind=split.kinds[i], **layers[i])
        for i in range(len(split))
    ]
    dtype = next((t.dtype for t in split.model.parameters() if t.is_floating_point()), torch.float32)
    return Profile(
        model=name or type(split.model).__name__,
        measured_on=MeasuredOn(
            device=dev.type,
            device_name=_device_name(dev),
            dtype=dtype_name(dtype),
            num_threads=torch.get_num_threads(),
            torch_version=torch.__version__,
        ),
        microbatch_sizes=sizes,
        input_bytes=input_bytes,
        layers=layer_profiles,
        split_points=list(split.split_points),
        metadata={
            "profiler": {
                "warmup": warmup,
                **timing,
                "clock": "cuda-events" if dev.type == "cuda" else clock,
                "loss": "custom" if loss_fn is not None else "output.float().mean()",
                "capture": split.method,
                **_hf_attention.attention_metadata(split.model),
                "anchors": split.anchors,
                "merged": split.warnings,
                "shared_parameters": [[list(x) for x in g] for g in split.shared_parameters()],
            }
        },
    )


def add_tensor_parallel_fields(split: SplitModel, layers: list[dict[str, Any]], input_bytes: list[int]) -> None:
    """How each unit shards under tensor parallelism (profiler/sharding.py), from the unit's own
    module (its captured graph keeps parameters, not module types), written into ``layers``; a
    unit that is more than that module (merged by split points) or shares weights stays
    replicated."""
    for i, original in enumerate(own_modules(split)):
        received = input_bytes if i == 0 else layers[i - 1].get("cut_bytes") or layers[i - 1]["output_bytes"]
        if original is not None:
            layers[i].update(tensor_parallel_fields(original, layers[i], received))


def _parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}: use cpu or cuda (cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device {device!r} is not supported: use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r} asked for, but CUDA is not available here: use --device cpu")
    return dev


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return str(torch.cuda.get_device_name(dev))
    return platform.processor() or platform.machine()


def _measure(
    split: SplitModel,
    inputs: tuple[Tensor, ...],
    sizes: Sequence[int],
    *,
    loss: Callable[[Any], Tensor],
    device: torch.device,
    warmup: int,
    repeats: int | None,
    progress: bool,
    clock: str = "wall",
    time_budget_s: float = TIME_BUDGET_S,
    target_error: float = TARGET_ERROR,
    record: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Per unit, its profile fields.  ``record`` receives how the timing went (repeats per size,
    why it stopped, unstable and below-resolution units, the timer's resolution)."""
    n = len(split)
    cuda = device.type == "cuda"
    fields = ["forward_ms", "backward_ms", "activation_bytes", "output_bytes", "cut_bytes"]
    fields += ["forward_ms_spread", "backward_ms_spread", "flops"] + (["peak_memory_bytes"] if cuda else [])
    fields += ["backward_input_ms", "backward_weight_ms", "weight_grad_bytes"]
    fields += ["selective_recompute_bytes", "selective_recompute_ms", "operations"]
    out: list[dict[str, Any]] = [{f: [] for f in fields} for _ in range(n)]
    timer = _Timer(device, clock)
    floor_ms, tick_ms = timer.floor()
    useful_ms = useful_resolution(floor_ms, tick_ms)
    model_storages = state_storages(split)
    bar = _progress(progress, len(sizes))
    samplings: dict[int, Sampling] = {}
    unmeasured: set[str] = set()  # units whose attention scores could not be traced (profiler/selective.py)
    no_census: set[str] = set()  # units whose census forward failed (profiler/census.py)
    sharded = units_sharded_weights(split)  # the census's tensor-parallel roles (profiler/sharding.py)
    try:
        for k, b in enumerate(sizes):
            batch = resize_batch(inputs, b)
            try:
                with frozen_state(split.model, train=True):  # the model itself, as users train it
                    call_model(split.model, batch, split.keywords)
                ref = reference_pass(split, batch, loss, exclude=model_storages)
            except (RuntimeError, ValueError, TypeError, IndexError) as err:
                if isinstance(err, InputError):
                    raise
                raise InputError(
                    f"a training step of the model at micro-batch size {b} failed: "
                    f"{type(err).__name__}: {str(err).strip().splitlines()[0]} -- drop that size from the "
                    "micro-batch sizes or fix the model/loss for it"
                ) from err
            unit_inputs, unit_outputs, upstream, act = ref.inputs, ref.outputs, ref.upstream, ref.activation_bytes
            for i in range(n):
                out[i].setdefault("kept", []).append(ref.kept_inputs[i])
                res = unit_outputs[i]
                if i < n - 1:
                    mask = split.cut_produced_by_previous[i]
                    own = [t for t, m in zip(res, mask, strict=True) if m]
                    out[i]["output_bytes"].append(tensor_bytes(own))
                    out[i]["cut_bytes"].append(tensor_bytes(res))
                else:
                    out[i]["output_bytes"].append(tensor_bytes(res[0]))
                    out[i]["cut_bytes"].append(tensor_bytes(res[0]))
                out[i]["activation_bytes"].append(act[i])
            frozen_inputs = [
                tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t for t in ins)
                for ins in unit_inputs
            ]
            del unit_outputs, unit_inputs, ref  # free the reference pass's activations
            # --- timing: whole training steps, each unit's forward and backward timed apart
            def on_step(fraction: float, k: int = k) -> None:
                if bar is not None:  # the bar counts sizes
                    bar[0].update(bar[1], completed=k + fraction)

            def one_step(first: tuple[Any, ...] = frozen_inputs[0]) -> tuple[list[float], list[float]]:
                return _timed_step(split, first, loss, timer)

            sampling = sample_steps(
                one_step,
                n,
                warmup=warmup,
                repeats=repeats,
                budget_s=time_budget_s / len(sizes),
                target=target_error,
                useful_ms=useful_ms,
                on_step=on_step,
            )
            samplings[b] = sampling
            fwd, bwd = sampling.forward, sampling.backward
            held = split_backward_bytes(split, frozen_inputs[0], loss, exclude=model_storages)
            t_in, t_w = [[] for _ in range(n)], [[] for _ in range(n)]  # type: ignore[var-annotated]
            for rep in range(SPLIT_WARMUP + min(sampling.repeats, SPLIT_REPEATS)):
                ins_ms, w_ms = _timed_split_step(split, frozen_inputs[0], loss, timer)
                if rep >= SPLIT_WARMUP:
                    for i in range(n):
                        t_in[i].append(ins_ms[i])
                        t_w[i].append(w_ms[i])
            for i, unit in enumerate(split.units):  # attention's scores (profiler/selective.py)
                try:
                    scores = trace_scores(unit, _grad_inputs(frozen_inputs[i]), exclude=model_storages)
                    share = recompute_share(unit, frozen_inputs[i], scores.calls, timer.time) if scores.saved_bytes else 0.0
                except Exception:  # an operator the dispatch mode cannot replay: no selective fields
                    scores, share = ScoreTrace(0, []), 0.0
                    unmeasured.add(split.names[i])
                out[i]["selective_recompute_bytes"].append(min(scores.saved_bytes, out[i]["activation_bytes"][k]))
                out[i]["selective_recompute_ms"].append(share * statistics.median(fwd[i]))
                del scores
            for i, unit in enumerate(split.units):
                out[i]["forward_ms"].append(statistics.median(fwd[i]))
                out[i]["backward_ms"].append(statistics.median(bwd[i]))
                out[i]["forward_ms_spread"].append(_quartile_spread(fwd[i]))
                out[i]["backward_ms_spread"].append(_quartile_spread(bwd[i]))
                out[i]["backward_input_ms"].append(statistics.median(t_in[i]))
                out[i]["backward_weight_ms"].append(statistics.median(t_w[i]))
                out[i]["weight_grad_bytes"].append(held[i])
                flops = _forward_flops(unit, frozen_inputs[i])
                out[i]["flops"].append(flops if flops is not None else 0.0)
                ops = _forward_census(
                    unit,
                    frozen_inputs[i],
                    (lambda r: loss(split.rebuild_output(r))) if i == n - 1 else None,
                    sharded=sharded[i],
                )
                if ops is None:
                    no_census.add(split.names[i])
                out[i]["operations"].append(ops or [])
                if cuda:
                    out[i]["peak_memory_bytes"].append(
                        _cuda_peak(unit, frozen_inputs[i], upstream[i], lambda r: loss(split.rebuild_output(r)), i == n - 1)
                    )
            split.model.zero_grad(set_to_none=True)
    finally:
        if bar is not None:
            bar[0].stop()
    if record is not None:
        names = split.names
        record.update(
            repeats=[samplings[b].repeats for b in sizes],
            adaptive=None
            if repeats is not None
            else {"target_error": target_error, "time_budget_s": time_budget_s,
                  "stopped": [samplings[b].stopped for b in sizes]},
            timer={"floor_ms": floor_ms, "tick_ms": tick_ms, "useful_ms": useful_ms},
            unstable={str(b): [names[i] for i in samplings[b].unstable] for b in sizes if samplings[b].unstable},
            below_resolution={
                str(b): [names[i] for i in samplings[b].below_resolution] for b in sizes if samplings[b].below_resolution
            },
            selective_unmeasured=sorted(unmeasured),
            census_failed=sorted(no_census),
            median_error={str(b): [round(e, 6) if math.isfinite(e) else None for e in samplings[b].error] for b in sizes},
        )
    if not any(out[i]["flops"] and any(out[i]["flops"]) for i in range(n)):
        for d in out:
            d["flops"] = None
    for name, d in zip(split.names, out, strict=True):  # no scores kept, or not traced at every size: absent
        if not any(d["selective_recompute_bytes"]) or name in unmeasured:
            d["selective_recompute_bytes"] = d["selective_recompute_ms"] = None
    for name, d in zip(split.names, out, strict=True):  # a census missing at some size: none
        if name in no_census:
            d["operations"] = None
    for d in out:  # {offset: bytes} per size -> [{offset, bytes per size}]
        per_size: list[dict[int, int]] = d.pop("kept")
        offsets = sorted({k for m in per_size for k in m})
        d["kept_inputs"] = [{"offset": k, "bytes": [m.get(k, 0) for m in per_size]} for k in offsets] or None
    return out


@dataclass
class ReferencePass:
    """One forward and backward through all units, unit by unit."""

    #: each unit's inputs (floating tensors are fresh leaves holding their gradient)
    inputs: list[tuple[Any, ...]]
    #: each unit's outputs; the last entry is ``(model output, loss)``
    outputs: list[Any]
    #: the real gradient arriving at each unit's outputs (``None`` for the last unit)
    upstream: list[list[Tensor | None] | None]
    #: bytes saved for backward by each unit (storages counted once, on the first saver)
    activation_bytes: list[int]
    #: per unit, ``{offset: bytes}`` of its inputs a stage starting there keeps (:func:`kept_inputs`)
    kept_inputs: list[dict[int, int]]


def reference_pass(
    split: SplitModel,
    batch: tuple[Tensor, ...],
    loss: Callable[[Any], Tensor],
    *,
    exclude: set[int] | None = None,
    backward: bool = True,
) -> ReferencePass:
    """Forward unit by unit with saved-tensor hooks, then backward from the loss, unit by
    unit, collecting the upstream gradient each unit receives (``backward=False``: no
    backward, every upstream gradient ``None``; the bytes are the same)."""
    n = len(split)
    saved = SavedBytes(exclude if exclude is not None else state_storages(split))
    unit_inputs: list[tuple[Any, ...]] = []
    unit_outputs: list[Any] = []
    act: list[int] = []
    current: tuple[Any, ...] = batch
    for i, unit in enumerate(split.units):
        ins = batch if i == 0 else _grad_inputs(current)
        before = saved.bytes
        saved.unit = i
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            res = unit(*ins)
            if i == n - 1:
                res = (res, loss(split.rebuild_output(res)))
        act.append(saved.bytes - before)
        unit_inputs.append(ins)
        unit_outputs.append(res)
        current = res if i < n - 1 else ()
    upstream: list[list[Tensor | None] | None] = [None] * n
    if not backward:
        return ReferencePass(unit_inputs, unit_outputs, upstream, act, kept_inputs(saved, unit_inputs))
    unit_outputs[-1][1].backward()
    for i in range(n - 2, -1, -1):
        grads: list[Tensor | None] = [t.grad if isinstance(t, Tensor) else None for t in unit_inputs[i + 1]]
        upstream[i] = grads
        _backward(unit_outputs[i], grads)
    return ReferencePass(unit_inputs, unit_outputs, upstream, act, kept_inputs(saved, unit_inputs))


def _timed_step(
    split: SplitModel,
    batch: tuple[Any, ...],
    loss: Callable[[Any], Tensor],
    timer: _Timer,
) -> tuple[list[float], list[float]]:
    """One training step through the units in order, then back in reverse, timing each
    unit's forward and backward.  Each backward gets the gradient the next unit's backward
    just produced: the real upstream gradient of this step.  The caches hold what they
    hold in a real step (no unit is repeated back to back)."""
    n = len(split)
    unit_inputs: list[tuple[Any, ...]] = []
    unit_outputs: list[Any] = []
    t_f: list[float] = []
    current: tuple[Any, ...] = batch
    for i, unit in enumerate(split.units):
        ins = batch if i == 0 else _grad_inputs(current)

        def forward(unit: nn.Module = unit, ins: tuple[Any, ...] = ins, last: bool = i == n - 1) -> Any:
            res = unit(*ins)
            return loss(split.rebuild_output(res)) if last else res

        ms, res = timer.time(forward)
        t_f.append(ms)
        unit_inputs.append(ins)
        unit_outputs.append(res)
        current = res if i < n - 1 else ()
    t_b = [0.0] * n
    t_b[n - 1], _ = timer.time(lambda: _backward(unit_outputs[n - 1], None))
    for i in range(n - 2, -1, -1):
        grads: list[Tensor | None] = [t.grad if isinstance(t, Tensor) else None for t in unit_inputs[i + 1]]

        def backward(res: Any = unit_outputs[i], g: list[Tensor | None] = grads) -> None:
            _backward(res, g)

        t_b[i], _ = timer.time(backward)
        unit_outputs[i + 1] = None  # free as a real step does
    return t_f, t_b


#: timed steps of the split backward per micro-batch size (at most; as many as the main timing
#: took when fewer), after one warm-up step
SPLIT_REPEATS = 10
SPLIT_WARMUP = 1


def _split_backward(
    res: Any, grads: Sequence[Tensor | None] | None, ins: Sequence[Any], weights: list[Any]
) -> tuple[Callable[[], None], list[dict[str, Any]] | None]:
    """Run the input-gradient half of one unit's backward; return the weight-gradient half
    (to run later) and the state it keeps (torch's ``param_groups``; ``None`` when no input
    needs a gradient: the weight half then runs the whole backward, as the pipeline runtime
    does on its first stage)."""
    inputs = [t for t in ins if isinstance(t, Tensor) and t.requires_grad]
    if grads is None:
        outputs, out_grads = [res], None
    else:
        pairs = [
            (o, g)
            for o, g in zip(res, grads, strict=True)
            if isinstance(o, Tensor) and o.requires_grad and g is not None
        ]
        outputs, out_grads = [o for o, _ in pairs], [g for _, g in pairs]
    if not outputs:
        return (lambda: None), None
    if not inputs:
        return (lambda: _backward(res, grads)), None
    state = _torch_private.backward_input(outputs, out_grads, inputs, weights)
    return (lambda: _torch_private.backward_weight(weights, state)), state


def _timed_split_step(
    split: SplitModel,
    batch: tuple[Any, ...],
    loss: Callable[[Any], Tensor],
    timer: _Timer,
) -> tuple[list[float], list[float]]:
    """One training step, the units' backwards split: per unit, its input gradient (timed)
    then its weight gradient (timed), in reverse order, each fed the real upstream gradient."""
    n = len(split)
    unit_inputs: list[tuple[Any, ...]] = []
    unit_outputs: list[Any] = []
    current: tuple[Any, ...] = batch
    for i, unit in enumerate(split.units):
        ins = batch if i == 0 else _grad_inputs(current)
        res = unit(*ins)
        if i == n - 1:
            res = loss(split.rebuild_output(res))
        unit_inputs.append(ins)
        unit_outputs.append(res)
        current = res if i < n - 1 else ()
    t_i, t_w = [0.0] * n, [0.0] * n
    for i in range(n - 1, -1, -1):
        grads = (
            None
            if i == n - 1
            else [t.grad if isinstance(t, Tensor) else None for t in unit_inputs[i + 1]]
        )
        weights = [p for p in split.units[i].parameters() if p.requires_grad]
        t_i[i], (weight, _) = timer.time(
            lambda i=i, g=grads, w=weights: _split_backward(unit_outputs[i], g, unit_inputs[i], w)  # type: ignore[misc]
        )
        t_w[i], _ = timer.time(weight)
        unit_outputs[i] = None
    split.model.zero_grad(set_to_none=True)
    return t_i, t_w


def split_backward_bytes(
    split: SplitModel,
    batch: tuple[Any, ...],
    loss: Callable[[Any], Tensor],
    *,
    exclude: set[int],
) -> list[int]:
    """Per unit, the bytes held between its input-gradient and its weight-gradient half: the
    storages its graph still holds after the ``I`` (parameters and model state excluded; a
    storage several units hold is counted once, on the last of them: a ``Linear`` after a
    ``Tanh`` counts the input both saved) plus the output gradients ``W`` starts from."""
    import weakref

    class _Held:
        __slots__ = ("__weakref__", "t")

        def __init__(self, t: Tensor) -> None:
            self.t = t

    n = len(split)
    packed: list[list[tuple[Any, int, int]]] = [[] for _ in range(n)]  # (weakref, storage key, bytes)
    unit = [0]

    def pack(t: Tensor) -> Any:
        storage = t.untyped_storage()
        held = _Held(t)
        if storage_key(t) not in exclude and storage.nbytes() > 0:
            packed[unit[0]].append((weakref.ref(held), storage_key(t), storage.nbytes()))
        return held

    def unpack(held: Any) -> Tensor:
        return held.t  # type: ignore[no-any-return]

    unit_inputs: list[tuple[Any, ...]] = []
    unit_outputs: list[Any] = []
    current: tuple[Any, ...] = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        for i, u in enumerate(split.units):
            unit[0] = i
            ins = batch if i == 0 else _grad_inputs(current)
            res = u(*ins)
            if i == n - 1:
                res = loss(split.rebuild_output(res))
            unit_inputs.append(ins)
            unit_outputs.append(res)
            current = res if i < n - 1 else ()
    del current
    out = [0] * n
    counted: set[int] = set()  # a storage several units hold counts on the last (the first to run W)
    for i in range(n - 1, -1, -1):
        grads = None if i == n - 1 else [t.grad if isinstance(t, Tensor) else None for t in unit_inputs[i + 1]]
        weights = [p for p in split.units[i].parameters() if p.requires_grad]
        weight, state = _split_backward(unit_outputs[i], grads, unit_inputs[i], weights)
        unit_outputs[i] = None  # as the runtime: the outputs are dropped after the I
        if state is not None:
            alive = {key: nb for ref, key, nb in packed[i] if ref() is not None and key not in counted}
            stashed = tensor_bytes([g for group in state for gs in group.get("grads") or () for g in gs or ()])
        else:  # nothing runs between: W is the whole backward, which holds what the forward saved
            alive = {key: nb for _, key, nb in packed[i] if key not in counted}
            stashed = 0
        counted.update(alive)
        out[i] = sum(alive.values()) + stashed
        weight()
    split.model.zero_grad(set_to_none=True)
    return out


def _cuda_peak(
    unit: nn.Module,
    inputs: tuple[Any, ...],
    grads: Sequence[Tensor | None] | None,
    loss: Callable[[Any], Tensor],
    last: bool,
) -> int:
    """Peak CUDA memory above the baseline during one forward (the backward frees it)."""
    ins = _grad_inputs(inputs)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = unit(*ins)
    if last:
        res = loss(res)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    _backward(res, None if last else grads)
    del res
    return max(0, int(peak))


def _progress(enabled: bool, total: int) -> tuple[Any, Any] | None:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("profiling micro-batch sizes"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task("profile", total=total)
    bar.start()
    return bar, task


def stage_saved_bytes(
    split: SplitModel,
    batch: Sequence[Tensor],
    ranges: Sequence[tuple[int, int]],
    loss: Callable[[Any], Tensor] | None = None,
) -> dict[tuple[int, int], int]:
    """Bytes each stage ``[start, stop)`` keeps for backward when it runs as one module.

    The truth the profile's memory must predict: the stage gets its inputs as fresh,
    contiguous tensors (as a pipeline stage receives them; those that required grad still
    do), runs forward under saved-tensor hooks, and every saved storage counts once,
    parameters and buffers excluded; the last stage computes the loss too (``loss``, default
    :func:`default_loss`), as in training.  ``batch``: the model inputs at one micro-batch size.
    """
    exclude = state_storages(split)
    loss_fn = loss or default_loss
    with _restored(split.model):
        ref = reference_pass(split, tuple(batch), loss_fn, exclude=exclude)
        cuts = [tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t for t in ins) for ins in ref.inputs]
        del ref
        out: dict[tuple[int, int], int] = {}
        for a, b in ranges:
            ins = tuple(
                t.detach().clone().contiguous().requires_grad_(t.requires_grad) if isinstance(t, Tensor) and a > 0 else t
                for t in cuts[a]
            )
            saved = SavedBytes(exclude)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                res = split.stage_module(a, b, pipeline=True)(*ins)
                if b == len(split):
                    res = loss_fn(split.rebuild_output(res))
            out[(a, b)] = saved.bytes
            del res
    split.model.zero_grad(set_to_none=True)
    return out


@contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """The model's state (BatchNorm statistics) and the RNG as they were before."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(state[k])
