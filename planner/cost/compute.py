"""The device model: what the operation census of a layer costs on a device, in ms.

A profile measures layer times on one device at a few micro-batch sizes.  The census
(:class:`planner.schema.Operation`, one forward's GEMMs, attention and memory-bound kernels)
lets the planner price the same layer on another device, at another micro-batch size or
sharded over a tensor-parallel group.  Each kernel costs at least the launch floor ``L``
(``DevicePreset.launch_floor_s``); peaks and bandwidths are the datasheet figures of
:data:`planner.presets.DEVICES`.

**GEMM** C[m, n] = A[m, k] B[k, n], ``batch`` of them (NVIDIA, "Matrix Multiplication
Background User's Guide", DU-09799-001, 2023, chapter 3, for the two quantisations)::

    tiles   = ceil(m / Tm) ceil(n / Tn)                       (Tm x Tn: DevicePreset.gemm_tile)
    tile_q  = m n / (ceil(m / Tm) Tm ceil(n / Tn) Tn)         tile quantisation
    wave_q  = tiles batch / (ceil(tiles batch / S) S)         wave quantisation, S SMs
    k_q     = k / (k + k0)                                    pipeline fill + epilogue, k0 =
                                                              DevicePreset.gemm_k_overhead
    compute = gemm_efficiency x tile_q x wave_q x k_q
    roof    = (2 m n k / ((m k + k n + m n) bytes)) x B x memory_efficiency / P
    efficiency = min(compute, roof)
    gemm_ms = max(L, 2 m n k batch / (P x efficiency))

``roof`` is the memory roof (Williams, Waterman & Patterson, "Roofline", CACM 2009): a product
that reads A and B and writes C once cannot run faster than its bytes at HBM bandwidth ``B``.  It
binds for few rows (small m) against a large weight once the tiles fill the SMs; below one tile
of rows the tile quantisation binds first.

What is monotone (``tests/planner/test_compute_model.py`` proves each with hypothesis):

* time is non-decreasing in each of m, n, k and batch: ``compute`` time is
  ``waves x Tm Tn S (k + k0) x 2 / (P x gemm_efficiency)``, the roof's time is bytes / bandwidth,
  and both grow with every dimension;
* achieved FLOP/s (FLOPs / ``gemm_ms``) is non-decreasing when any one of m, n, k, batch is
  multiplied by a whole number (ceil(j x) <= j ceil(x): neither quantisation can get worse), and
  when m grows by whole waves of tiles (Tm x S rows; likewise n by Tn x S).  It is *not*
  monotone under growth by one tile: one tile more than S tiles starts a second, almost empty
  wave and nearly halves the rate.  That is real (the guide's wave-quantisation figure) and the
  model keeps it.

Not modelled: the kernel choice.  cuBLAS picks smaller tiles for products of fewer rows than a
tile and split-K / stream-K kernels for products of fewer tiles than SMs with a long k; here
such shapes pay a whole tile and a whole wave, so they come out slower than on the device
(decode-sized m, the weight gradient of a narrow layer).  Training shapes (m = tokens of a
micro-batch, in the thousands) are not affected.  Nor is L2-cache reuse.

**Attention**, forward FLOPs ``4 b h q kv d`` (two GEMMs), halved when causal.  Fused (flash):
one kernel whose thread blocks each own ``Bq`` query rows (``DevicePreset.attention_block``),
at ``fraction x gemm_efficiency`` (``DevicePreset.attention_fraction``) with the GEMM's tile and
wave quantisation over ``b h ceil(q / Bq)`` blocks and ``kv / (kv + k0)`` for the inner loop;
its backward recomputes the scores: 2.5x the forward FLOPs (five GEMMs for two, as the
flash-attention repository's benchmarks/benchmark_flash_attention.py counts them), blocks over the
keys.  Materialised (scores in memory): the forward
is the two batched GEMMs Q K^T and P V priced by :func:`gemm_ms` plus the softmax pass (the
scores read and the probabilities written: 2 x scores bytes); the backward is four batched
GEMMs (dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q: 2x the forward FLOPs) plus the softmax
backward (P and dP read, dS written: 3 x scores bytes).

**Memory-bound** kernels: ``max(L, bytes / (B x memory_efficiency))``.  Their backward moves
:data:`MEMORY_BACKWARD_FACTOR` = 2x the forward bytes: an elementwise op's forward reads x and
writes y, its backward reads x (or y) and dy and writes dx (1.5x); a norm's backward also
re-reads its saved statistics and reduces the weight gradients, and dropout reads its mask:
2x is the round figure for the mix.

The census lists one forward; :func:`operation_ms` derives the backward: a GEMM's input
gradient dA = dC B^T is the product (m, k, n) and its weight gradient dB = A^T dC is (k, n, m)
(the census's convention: B is the weight); attention and memory-bound kernels have no weights,
all their backward is input gradient.

Only :class:`DeviceConstants` may be fitted to measurements (two per device type); everything
else is a device fact of :data:`planner.presets.DEVICES`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from planner.presets import DEVICES, DevicePreset, unknown_preset
from planner.schema import Operation, Profile

#: bytes per element of the dtypes a profile or a plan may name
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}

#: backward bytes of a memory-bound kernel / its forward bytes (module docstring)
MEMORY_BACKWARD_FACTOR = 2.0
#: fused attention's backward FLOPs / forward FLOPs: it recomputes the scores, five GEMMs
#: against the forward's two (FlashAttention-2, Dao 2023; the flash-attention repository's
#: benchmarks/benchmark_flash_attention.py counts the backward as 2.5x the forward)
FLASH_BACKWARD_FLOPS = 2.5
#: bytes a materialised softmax moves per score element / element bytes: forward reads the
#: scores and writes the probabilities; backward reads P and dP and writes dS
SOFTMAX_FORWARD_PASSES = 2
SOFTMAX_BACKWARD_PASSES = 3


@dataclass(frozen=True)
class DeviceConstants:
    """The two constants of a device type that calibration may fit.

    ``gemm_efficiency``: the fraction of dense peak a large, well-shaped GEMM reaches (the
    model's asymptote: no tile or wave quantisation, k much larger than the kernel's overhead).
    ``memory_efficiency``: the fraction of HBM bandwidth memory-bound kernels reach."""

    gemm_efficiency: float
    memory_efficiency: float

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 1):
                raise ValueError(
                    f"{name}={value!r} is not a fraction of peak: give a number in (0, 1]"
                )


_DEFAULT_CONSTANTS: Mapping[str, DeviceConstants] = MappingProxyType({
    # measured on the 2-core CI host (torch 2.13 CPU): a 2048^3 float32 matmul on 2 threads ran at
    # ~120 GFLOP/s, above the preset's nominal 1e11, and a 256 MiB copy moved ~18 GB/s of the
    # nominal 20 GB/s; the nominal figures are the limit, 0.9 of them
    "cpu": DeviceConstants(gemm_efficiency=0.9, memory_efficiency=0.9),
    # GEMM: S. Bekman, "Machine Learning Engineering Open Book", compute/accelerator, Maximum
    # Achievable Matmul FLOPS table: the best bf16 shape reaches 271.2 of 312 TFLOP/s on A100 SXM
    # (86.9%; torch 2.6, cu126), large cuBLAS GEMMs commonly 80-88%; 0.88 is the asymptote, an
    # 8192^3 product comes out at 0.88 x 0.977 (k) x 0.998 (waves) = 86%.
    # Memory: STREAM-style copy / triad kernels (BabelStream: Deakin et al., "Evaluating attainable
    # memory bandwidth of parallel programming models via BabelStream", 2018) typically reach
    # about 85-92% of the datasheet HBM bandwidth on A100- and H100-class GPUs (published runs,
    # approximate; not measured here); framework kernels (norms, elementwise) sit at the low
    # end: 0.85.
    "a100-40g": DeviceConstants(gemm_efficiency=0.88, memory_efficiency=0.85),
    "a100-80g": DeviceConstants(gemm_efficiency=0.88, memory_efficiency=0.85),
    # GEMM: the same table: 794.5 of 989 TFLOP/s on H100 SXM (80.3%, the best of a shape search;
    # torch 2.7, cu126); sustained large bf16 GEMMs land at 65-75% (power and clock limits at
    # 700 W).  0.78 as the asymptote puts 8192^3 at 0.78 x 0.970 (k) x 0.970 (waves) = 73%.
    # H200 SXM: the same GH100 chip at the same 700 W (NVIDIA H200 datasheet, 2024), so the same.
    # Memory: BabelStream as above.
    "h100-80g": DeviceConstants(gemm_efficiency=0.78, memory_efficiency=0.85),
    "h200-141g": DeviceConstants(gemm_efficiency=0.78, memory_efficiency=0.85),
    # H800 SXM: the GH100 chip with NVLink cut (NVIDIA H800 datasheet, 2023): the H100's figures
    "h800-80g": DeviceConstants(gemm_efficiency=0.78, memory_efficiency=0.85),
})


def default_constants(device_type: str) -> DeviceConstants:
    """The published (unfitted) constants of a device preset (sources in the table above)."""
    _device(device_type)
    return _DEFAULT_CONSTANTS[device_type]


@dataclass(frozen=True)
class OpTimes:
    """Times of one or more operations, ms: the forward and the backward's two parts."""

    forward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0

    @property
    def backward(self) -> float:
        """The whole backward: input gradient plus weight gradient."""
        return self.backward_input + self.backward_weight

    def __add__(self, other: OpTimes) -> OpTimes:
        return OpTimes(
            self.forward + other.forward,
            self.backward_input + other.backward_input,
            self.backward_weight + other.backward_weight,
        )

    def scaled(self, factor: float) -> OpTimes:
        """Every part times ``factor`` (``count`` identical operations)."""
        return OpTimes(self.forward * factor, self.backward_input * factor, self.backward_weight * factor)


# --------------------------------------------------------------------------- device facts


def _device(device_type: str) -> DevicePreset:
    if device_type not in DEVICES:
        raise unknown_preset("device type", device_type, DEVICES)
    return DEVICES[device_type]


def _constants(device_type: str, constants: DeviceConstants | None) -> DeviceConstants:
    return default_constants(device_type) if constants is None else constants


def _peak(device_type: str, dtype: str) -> float:
    peaks = _device(device_type).peak_flops
    if dtype not in peaks:
        raise ValueError(
            f"dtype {dtype!r} has no peak throughput on {device_type!r}: choose one of "
            f"{', '.join(sorted(peaks))}"
        )
    return peaks[dtype]


def _element_bytes(dtype: str) -> int:
    storage = "float32" if dtype == "tfloat32" else dtype  # TF32 is a math mode on float32 tensors
    if storage not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} has no element size: choose one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[storage]


def _floor_ms(device_type: str) -> float:
    return _device(device_type).launch_floor_s * 1e3


def _positive(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is not a size: give a positive integer")


# --------------------------------------------------------------------------- quantisation


def tile_quantization(size: int, tile: int) -> float:
    """The useful share of ``ceil(size / tile)`` tiles of ``tile`` rows: size / padded size."""
    return size / (math.ceil(size / tile) * tile)


def wave_quantization(blocks: int, sms: int) -> float:
    """The busy share of the waves that ``blocks`` thread blocks take on ``sms`` SMs."""
    return blocks / (math.ceil(blocks / sms) * sms)


# --------------------------------------------------------------------------- GEMM


def gemm_efficiency(
    m: int,
    n: int,
    k: int,
    *,
    batch: int = 1,
    dtype: str,
    device_type: str,
    constants: DeviceConstants | None = None,
) -> float:
    """The fraction of ``dtype`` peak a ``batch`` x (m, n, k) GEMM reaches, in (0, 1]
    (the launch floor aside; formulas in the module docstring)."""
    _positive(m=m, n=n, k=k, batch=batch)
    device = _device(device_type)
    c = _constants(device_type, constants)
    peak = _peak(device_type, dtype)
    tm, tn = device.gemm_tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
    compute = (
        c.gemm_efficiency
        * tile_quantization(m, tm)
        * tile_quantization(n, tn)
        * wave_quantization(tiles, device.sm_count)
        * (k / (k + device.gemm_k_overhead))  # (a factor: k / k is exactly 1, (x k) / k may not be)
    )
    intensity = 2 * m * n * k / ((m * k + k * n + m * n) * _element_bytes(dtype))
    roof = intensity * device.memory_bandwidth_bytes_per_s * c.memory_efficiency / peak
    return min(compute, roof)


def gemm_ms(
    m: int,
    n: int,
    k: int,
    *,
    batch: int = 1,
    dtype: str,
    device_type: str,
    constants: DeviceConstants | None = None,
) -> float:
    """Time of ``batch`` GEMMs C[m, n] = A[m, k] B[k, n]: max(launch floor, FLOPs / (peak x
    :func:`gemm_efficiency`)), in ms."""
    eff = gemm_efficiency(m, n, k, batch=batch, dtype=dtype, device_type=device_type, constants=constants)
    seconds = 2 * m * n * k * batch / (_peak(device_type, dtype) * eff)
    return max(_floor_ms(device_type), seconds * 1e3)


# --------------------------------------------------------------------------- memory-bound


def memory_ms(nbytes: float, *, device_type: str, constants: DeviceConstants | None = None) -> float:
    """Time of a memory-bound kernel moving ``nbytes`` (read + written): max(launch floor, bytes /
    (HBM bandwidth x memory_efficiency)), in ms; 0 when it moves nothing."""
    if not nbytes >= 0 or math.isinf(nbytes):
        raise ValueError(f"nbytes={nbytes!r} is not a byte count: give a finite number >= 0")
    device = _device(device_type)
    c = _constants(device_type, constants)
    if nbytes == 0:
        return 0.0
    seconds = nbytes / (device.memory_bandwidth_bytes_per_s * c.memory_efficiency)
    return max(_floor_ms(device_type), seconds * 1e3)


# --------------------------------------------------------------------------- attention


def _require(op: Operation, kind: str) -> None:
    if op.kind != kind:
        raise ValueError(f"a {op.kind!r} operation was given where a {kind!r} one is priced: pass a {kind} operation")


def _flash_pass_ms(
    op: Operation, flops: float, rows: int, cols: int, fraction: float, device_type: str, c: DeviceConstants
) -> float:
    """One fused-attention kernel: a thread block per ``attention_block`` rows of each (sequence,
    head), an inner loop over ``cols``, at ``fraction`` of the GEMM efficiency."""
    device = _device(device_type)
    block = device.attention_block
    blocks = op.batch * _dim(op.heads) * math.ceil(rows / block)
    eff = (
        fraction
        * c.gemm_efficiency
        * tile_quantization(rows, block)
        * wave_quantization(blocks, device.sm_count)
        * cols / (cols + device.gemm_k_overhead)
    )
    return max(_floor_ms(device_type), flops / (_peak(device_type, op.dtype) * eff) * 1e3)


def _flash_ms(op: Operation, device_type: str, c: DeviceConstants) -> tuple[float, float]:
    q, kv, d = _attention_dims(op)
    flops = 4 * op.batch * _dim(op.heads) * q * kv * d * (0.5 if op.causal else 1.0)
    fwd_fraction, bwd_fraction = _device(device_type).attention_fraction
    forward = _flash_pass_ms(op, flops, q, kv, fwd_fraction, device_type, c)  # blocks over queries
    backward = _flash_pass_ms(op, FLASH_BACKWARD_FLOPS * flops, kv, q, bwd_fraction, device_type, c)  # over keys
    return forward, backward


def _materialised_ms(op: Operation, device_type: str, c: DeviceConstants) -> tuple[float, float]:
    q, kv, d = _attention_dims(op)
    heads = op.batch * _dim(op.heads)
    scores_bytes = heads * q * kv * _element_bytes(op.dtype)

    def gemm(m: int, n: int, k: int) -> float:
        return gemm_ms(m, n, k, batch=heads, dtype=op.dtype, device_type=device_type, constants=c)

    def softmax(passes: int) -> float:
        return memory_ms(passes * scores_bytes, device_type=device_type, constants=c)

    forward = gemm(q, kv, d) + softmax(SOFTMAX_FORWARD_PASSES) + gemm(q, d, kv)  # S = Q K^T; O = P V
    backward = (
        gemm(kv, d, q)  # dV = P^T dO
        + gemm(q, kv, d)  # dP = dO V^T
        + softmax(SOFTMAX_BACKWARD_PASSES)  # dS from P and dP
        + gemm(q, d, kv)  # dQ = dS K
        + gemm(kv, d, q)  # dK = dS^T Q
    )
    return forward, backward


def _dim(value: int | None) -> int:
    assert value is not None  # the schema requires the field for the operation's kind
    return value


def _attention_dims(op: Operation) -> tuple[int, int, int]:
    return _dim(op.query_len), _dim(op.key_len), _dim(op.head_dim)


def attention_ms(
    op: Operation, *, device_type: str, constants: DeviceConstants | None = None
) -> tuple[float, float]:
    """(forward, backward) ms of one attention operation (``op.count`` not applied): fused
    (flash) or materialised, as the module docstring prices them."""
    _require(op, "attention")
    _peak(device_type, op.dtype)
    c = _constants(device_type, constants)
    return _flash_ms(op, device_type, c) if op.fused else _materialised_ms(op, device_type, c)


# --------------------------------------------------------------------------- operations


def operation_ms(
    op: Operation, *, device_type: str, constants: DeviceConstants | None = None
) -> OpTimes:
    """Forward, input-gradient and weight-gradient ms of ``op`` (times ``op.count``).

    The experts' GEMMs of a mixture-of-experts layer (``op.expert``: ``count`` products of one
    shape, one per expert a device holds) run as one grouped GEMM, their tiles sharing the
    device's waves, as Megatron-LM's ``--moe-grouped-gemm`` and DeepSeek-V3's kernels run them
    (DeepSeek-V3 Technical Report, arXiv:2412.19437, sec. 3.3); priced one by one, 256 experts'
    128-token products would each fill a few of the SMs."""
    c = _constants(device_type, constants)
    grouped = op.kind == "gemm" and op.expert
    if op.kind == "gemm":
        m, n, k = _dim(op.m), _dim(op.n), _dim(op.k)
        batch = op.batch * op.count if grouped else op.batch

        def gemm(rows: int, cols: int, inner: int) -> float:
            return gemm_ms(rows, cols, inner, batch=batch, dtype=op.dtype, device_type=device_type, constants=c)

        times = OpTimes(gemm(m, n, k), gemm(m, k, n), gemm(k, n, m))  # C = A B; dA = dC B^T; dB = A^T dC
    elif op.kind == "attention":
        forward, backward = attention_ms(op, device_type=device_type, constants=c)
        times = OpTimes(forward, backward, 0.0)
    else:
        nbytes = _dim(op.bytes)
        times = OpTimes(
            memory_ms(nbytes, device_type=device_type, constants=c),
            memory_ms(MEMORY_BACKWARD_FACTOR * nbytes, device_type=device_type, constants=c),
            0.0,
        )
    return times if grouped else times.scaled(op.count)


#: the field each ``tp_shard`` divides, by the operation's kind (a GEMM's ``heads``: the batched
#: products of materialised attention, ``q k^T`` and ``@ v``, one per sequence and head: the
#: group divides the heads, so the batch)
_SHARD_FIELDS: Mapping[tuple[str, str], str] = MappingProxyType({
    ("n", "gemm"): "n", ("k", "gemm"): "k", ("heads", "gemm"): "batch",
    ("heads", "attention"): "heads", ("bytes", "memory"): "bytes",
})


def shard_operation(op: Operation, t: int, *, sequence_parallel: bool = False) -> Operation:
    """What one device of a tensor-parallel group of ``t`` runs of ``op``.

    ``op.tp_shard`` names the divided field (gemm: ``n`` column-parallel, ``k`` row-parallel,
    ``heads`` the batch of a batched product per head -- materialised attention's ``q k^T`` and
    ``@ v``, whose batch is sequences x heads; attention: ``heads``; memory: ``bytes``, a kernel
    inside the tensor-parallel region such as the MLP's activation); it becomes ceil(value / t).
    An operation without ``tp_shard`` is
    replicated: every device runs all of it, except that under ``sequence_parallel`` a replicated
    memory-bound kernel (norm, dropout, residual add: the sequence-parallel region of Korthikanti
    et al. 2022) runs on 1/t of the tokens, ceil(bytes / t).  Replicated GEMMs and attention stay
    whole either way."""
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"tensor-parallel degree t={t!r} is not a group size: give a positive integer")
    if t == 1:
        return op
    if op.tp_shard is None:
        if sequence_parallel and op.kind == "memory":
            return op.model_copy(update={"bytes": math.ceil(_dim(op.bytes) / t)})
        return op
    field = _SHARD_FIELDS.get((op.tp_shard, op.kind))
    if field is None:
        allowed = sorted(s for s, k in _SHARD_FIELDS if k == op.kind)
        raise ValueError(
            f"a {op.kind} operation cannot shard {op.tp_shard!r}: give tp_shard one of "
            f"{', '.join(map(repr, allowed))} or leave it out (replicated)"
        )
    return op.model_copy(update={field: math.ceil(getattr(op, field) / t)})


def resize_operation(op: Operation, ratio: float) -> Operation:
    """``op`` at ``ratio`` x its micro-batch: the token dimension m of a GEMM, the sequences
    (``batch``) of attention, the bytes of a memory-bound kernel scale; rounded, at least 1 (a
    memory-bound kernel of 0 bytes stays at 0)."""
    if not (isinstance(ratio, int | float) and 0 < ratio < math.inf):
        raise ValueError(f"ratio={ratio!r} is not a micro-batch ratio: give a finite number > 0")
    if op.kind == "gemm":
        return op.model_copy(update={"m": max(1, round(_dim(op.m) * ratio))})
    if op.kind == "attention":
        return op.model_copy(update={"batch": max(1, round(op.batch * ratio))})
    nbytes = _dim(op.bytes)
    return op.model_copy(update={"bytes": max(1, round(nbytes * ratio)) if nbytes else 0})


def layer_times(
    ops: Iterable[Operation],
    *,
    device_type: str,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    constants: DeviceConstants | None = None,
) -> OpTimes:
    """A layer's times from its census (one forward's operations at one micro-batch size), on
    one device of a tensor-parallel group of ``tensor_parallel`` (collectives not included)."""
    total = OpTimes()
    for op in ops:
        local = shard_operation(op, tensor_parallel, sequence_parallel=sequence_parallel)
        total = total + operation_ms(local, device_type=device_type, constants=constants)
    return total


# --------------------------------------------------------------------------- measured times at other sizes


def census_device(profile: Profile) -> str | None:
    """The device preset whose device model prices ``profile``'s operation census: a synthesized
    profile's preset, ``cpu`` for a CPU profile, a CUDA profile's GPU by its name; None when
    unknown (the flat ``tensor_parallel_efficiency`` then scales its layers, and measured times
    are read linearly at unmeasured micro-batch sizes)."""
    where = profile.measured_on
    if where.device.startswith(("synthetic:", "fake:")):
        name = where.device.partition(":")[2]
        return name if name in DEVICES else None
    if where.device == "cpu":
        return "cpu"
    label = where.device_name.upper()
    for key, preset in (("H200", "h200-141g"), ("H100", "h100-80g"), ("H800", "h800-80g"), ("A100-SXM4-40GB", "a100-40g"),
                        ("A100", "a100-80g")):
        if key in label:
            return preset
    return None


@dataclass(frozen=True)
class SizeRatios:
    """A layer's device-model price at a micro-batch size ``b`` over its price at the measured
    size ``b0`` the census was recorded at: forward, whole backward, input and weight gradient."""

    b0: int
    forward: float
    backward: float
    backward_input: float
    backward_weight: float


def census_ratios(profile: Profile, b: int) -> list[SizeRatios | None] | None:
    """Per layer, how the device model scales its measured times from the nearest measured
    micro-batch size ``b0`` to ``b`` (:class:`SizeRatios`), for ``b`` outside the measured sizes:
    the layer's census at ``b0`` (:func:`resize_operation` by ``b / b0``) priced at both sizes on
    the profile's device (:func:`census_device`).  None for every layer when ``b`` lies inside the
    measured sizes (read between measured points) or the profile's device has no device model;
    None for a layer without a census at ``b0`` (its times scale linearly)."""
    sizes = list(profile.microbatch_sizes)
    if min(sizes) <= b <= max(sizes):
        return None
    device = census_device(profile)
    if device is None:
        return None
    b0 = max(sizes) if b > max(sizes) else min(sizes)
    at = sizes.index(b0)
    memo: dict[tuple[Operation, ...], SizeRatios] = {}  # equal censuses priced once
    # synth's blocks (and a mesh problem's copies of them) share one census list: found by its
    # identity first, without hashing its operations (a 1,022-block profile hashed 12,000
    # operations per call, 650 calls a search); the profile keeps the lists alive meanwhile
    by_id: dict[int, SizeRatios] = {}
    out: list[SizeRatios | None] = []
    for layer in profile.layers:
        ops = layer.operations[at] if layer.operations and at < len(layer.operations) else None
        if not ops:
            out.append(None)
            continue
        seen = by_id.get(id(ops))
        if seen is not None:
            out.append(seen)
            continue
        key = tuple(ops)
        if key not in memo:
            base = layer_times(ops, device_type=device)
            there = layer_times([resize_operation(o, b / b0) for o in ops], device_type=device)

            def ratio(x: float, y: float) -> float:
                return x / y if y > 0 else b / b0

            memo[key] = SizeRatios(
                b0, ratio(there.forward, base.forward), ratio(there.backward, base.backward),
                ratio(there.backward_input, base.backward_input), ratio(there.backward_weight, base.backward_weight),
            )
        by_id[id(ops)] = memo[key]
        out.append(memo[key])
    return out


def scale_measured(value: float, ratio: float, b: int, b0: int) -> float:
    """A time measured (fitted) as ``value`` at size ``b0``, read at ``b`` through the device
    model's ``ratio``, kept where the measured series' physics holds (:mod:`planner.scaling`): a
    larger micro-batch never costs less, nor more per sample; a smaller one the reverse."""
    lo, hi = (value, value * b / b0) if b >= b0 else (value * b / b0, value)
    return min(hi, max(lo, value * ratio))
