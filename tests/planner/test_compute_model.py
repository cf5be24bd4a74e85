"""The device model (planner/cost/compute.py): hand-computed cases, published figures and
monotonicity properties.

Expected values are computed here from the device facts (presets) and the formulas of the
module docstring, or bounded by published measurements; the properties are drawn by hypothesis.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.cost.compute import (
    DeviceConstants,
    OpTimes,
    attention_ms,
    default_constants,
    gemm_efficiency,
    gemm_ms,
    layer_times,
    memory_ms,
    operation_ms,
    resize_operation,
    shard_operation,
)
from planner.presets import DEVICES
from planner.schema import Operation

GPUS = ("a100-40g", "a100-80g", "h100-80g", "h200-141g", "h800-80g")
BF16 = "bfloat16"
REL = 1e-9  # float round-off between two ways of computing the same product


def achieved(m: int, n: int, k: int, batch: int, device: str) -> float:
    """FLOP/s the model predicts for a bf16 GEMM."""
    return 2 * m * n * k * batch / (gemm_ms(m, n, k, batch=batch, dtype=BF16, device_type=device) * 1e-3)


def at_least(a: float, b: float) -> bool:
    """a >= b up to round-off."""
    return a >= b * (1 - REL)


dims = st.integers(1, 20_000)
small = st.integers(1, 64)
devices = st.sampled_from((*GPUS, "cpu"))


# --------------------------------------------------------------------------- GEMM: published figures


@pytest.mark.parametrize(
    ("device", "low", "high"),
    [
        # large bf16 cuBLAS GEMMs on A100 SXM: 80-88% of 312 TFLOP/s (best shape 86.9%: Bekman,
        # "Machine Learning Engineering Open Book", Maximum Achievable Matmul FLOPS)
        ("a100-80g", 0.80, 0.88),
        # H100 SXM: 65-75% sustained, 80.3% at the best shape of the same table
        ("h100-80g", 0.65, 0.803),
    ],
)
def test_large_square_gemm_lands_in_the_published_range(device: str, low: float, high: float) -> None:
    rate = achieved(8192, 8192, 8192, 1, device) / DEVICES[device].peak_flops[BF16]
    assert low <= rate <= high
    # and within a few percent of the device's large-GEMM constant (8192 is many tiles, long k)
    assert rate == pytest.approx(default_constants(device).gemm_efficiency, rel=0.06)


@pytest.mark.parametrize("device", GPUS)
def test_tiny_gemm_costs_the_launch_floor(device: str) -> None:
    # 2 x 8^3 = 1024 FLOPs take picoseconds at any peak; the kernel launch is what it costs
    assert gemm_ms(8, 8, 8, dtype=BF16, device_type=device) == DEVICES[device].launch_floor_s * 1e3


def test_perfectly_quantised_gemm_reaches_the_constant_times_the_k_overhead() -> None:
    # A100: 128x128 tiles, 108 SMs, k overhead 192.  m = 27 x 128 rows and n = 8 x 128 columns
    # are 216 tiles: exactly two waves.  Intensity 2mnk / ((mk + kn + mn) x 2 bytes) = 1 / (1/1024
    # + 1/3456 + 1/8192) = 720 FLOP/byte, far above the ridge (312e12 x 0.88 / (2039e9 x 0.85) =
    # 158): compute bound.
    c = default_constants("a100-80g")
    eff = gemm_efficiency(3456, 1024, 8192, dtype=BF16, device_type="a100-80g")
    assert eff == pytest.approx(c.gemm_efficiency * 8192 / (8192 + 192), rel=REL)


def test_one_tile_row_more_starts_an_almost_empty_wave() -> None:
    # 28 x 128 rows: 224 tiles on 108 SMs take 3 waves (324 slots): 224 / 324 of the rate of the
    # full two waves above.  Wave quantisation (NVIDIA, Matrix Multiplication Background, 3.2).
    full = gemm_efficiency(3456, 1024, 8192, dtype=BF16, device_type="a100-80g")
    more = gemm_efficiency(3456 + 128, 1024, 8192, dtype=BF16, device_type="a100-80g")
    assert more / full == pytest.approx(224 / 324, rel=REL)


def test_padding_a_tile_costs_a_whole_tile() -> None:
    # n = 129 pads to two 128-wide tiles: tile quantisation 129 / 256, and 2 x 27 = 54 tiles fill
    # 54 of the 108 SMs.  Intensity 1 / (1/3456 + 1/129 + 1/8192) = 123 FLOP/byte puts the roof at
    # 123 x 2039e9 x 0.85 / 312e12 = 0.68 of peak, above the tiles' 0.22: compute bound.
    c = default_constants("a100-80g")
    eff = gemm_efficiency(3456, 129, 8192, dtype=BF16, device_type="a100-80g")
    assert eff == pytest.approx(c.gemm_efficiency * (129 / 256) * (54 / 108) * 8192 / (8192 + 192), rel=REL)
    # so it takes as long as the product that fills both tiles
    assert gemm_ms(3456, 129, 8192, dtype=BF16, device_type="a100-80g") == pytest.approx(
        gemm_ms(3456, 256, 8192, dtype=BF16, device_type="a100-80g"), rel=REL)


def test_few_rows_against_a_wide_weight_are_memory_bound() -> None:
    # H100: m = 256 tokens, n = 66 x 256 = 16896, k = 8192: 2 x 66 = 132 tiles, one full wave, so
    # the tiles would run at 0.78 x 8192 / 8448 = 0.756 of peak; the intensity 256 x 16896 x 8192 /
    # (256 x 8192 + 8192 x 16896 + 256 x 16896) = 245 FLOP/byte caps it at 245 x 3350e9 x 0.85 /
    # 989.5e12 = 0.70: the time is the bytes at HBM bandwidth x memory efficiency
    c = default_constants("h100-80g")
    m, n, k = 256, 16896, 8192
    nbytes = (m * k + k * n + m * n) * 2
    expected = nbytes / (3350e9 * c.memory_efficiency) * 1e3
    assert gemm_ms(m, n, k, dtype=BF16, device_type="h100-80g") == pytest.approx(expected, rel=REL)


# --------------------------------------------------------------------------- GEMM: properties


@given(dims, dims, dims, small, devices)
def test_efficiency_is_a_fraction(m: int, n: int, k: int, batch: int, device: str) -> None:
    eff = gemm_efficiency(m, n, k, batch=batch, dtype=BF16, device_type=device)
    assert 0 < eff <= default_constants(device).gemm_efficiency


@given(dims, dims, dims, small, devices, st.sampled_from("mnkb"), st.integers(1, 5_000))
def test_time_is_non_decreasing_in_every_dimension(
    m: int, n: int, k: int, batch: int, device: str, which: str, grow: int
) -> None:
    before = {"m": m, "n": n, "k": k, "b": batch}
    after = dict(before, **{which: before[which] + grow})

    def ms(d: dict[str, int]) -> float:
        return gemm_ms(d["m"], d["n"], d["k"], batch=d["b"], dtype=BF16, device_type=device)

    assert at_least(ms(after), ms(before))


@given(dims, dims, dims, small, devices, st.sampled_from("mnkb"), st.integers(1, 8))
def test_flops_per_second_never_drop_when_a_dimension_is_multiplied(
    m: int, n: int, k: int, batch: int, device: str, which: str, j: int
) -> None:
    """ceil(j x) <= j ceil(x): multiplying a dimension by a whole number cannot worsen tile or
    wave quantisation, and raises the arithmetic intensity and FLOPs per launch."""
    before = {"m": m, "n": n, "k": k, "b": batch}
    after = dict(before, **{which: before[which] * j})
    assert at_least(achieved(after["m"], after["n"], after["k"], after["b"], device),
                    achieved(m, n, k, batch, device))


@given(dims, dims, dims, small, devices, st.sampled_from("mn"), st.integers(1, 3))
def test_flops_per_second_never_drop_when_m_or_n_grows_by_whole_waves(
    m: int, n: int, k: int, batch: int, device: str, which: str, waves: int
) -> None:
    """Growing m by Tm x SMs rows (n by Tn x SMs columns) adds whole waves of tiles: the partial
    last wave and the padded last tile keep their size while the useful work grows."""
    tm, tn = DEVICES[device].gemm_tile
    step = (tm if which == "m" else tn) * DEVICES[device].sm_count * waves
    grown = (m + step, n, k) if which == "m" else (m, n + step, k)
    assert at_least(achieved(*grown, batch, device), achieved(m, n, k, batch, device))


# --------------------------------------------------------------------------- GEMM backward


@pytest.mark.parametrize("device", GPUS)
def test_square_gemm_backward_parts_equal_the_forward(device: str) -> None:
    # (m, n, k), (m, k, n) and (k, n, m) are the same product when m = n = k
    t = operation_ms(Operation(kind="gemm", m=4096, n=4096, k=4096), device_type=device)
    assert t.backward_input == t.forward and t.backward_weight == t.forward


def test_gemm_backward_parts_are_the_transposed_products() -> None:
    # A100, m = 3456 (27 tiles), n = 1024 (8 tiles), k = 8192 (64 tiles), all 720 FLOP/byte:
    # compute bound.  dA = dC B^T is (m, k, n): 27 x 64 = 1728 tiles = 16 full waves, inner 1024;
    # dB = A^T dC is (k, n, m): 64 x 8 = 512 tiles in 5 waves (540 slots), inner 3456.
    g = default_constants("a100-80g").gemm_efficiency
    flops = 2 * 3456 * 1024 * 8192
    t = operation_ms(Operation(kind="gemm", m=3456, n=1024, k=8192), device_type="a100-80g")
    assert t.forward == pytest.approx(flops / (312e12 * g * 8192 / (8192 + 192)) * 1e3, rel=REL)
    assert t.backward_input == pytest.approx(flops / (312e12 * g * 1024 / (1024 + 192)) * 1e3, rel=REL)
    expected_w = flops / (312e12 * g * (512 / 540) * 3456 / (3456 + 192)) * 1e3
    assert t.backward_weight == pytest.approx(expected_w, rel=REL)


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize(("m", "n", "k"), [(16384, 4096, 4096), (8192, 12288, 4096), (4096, 2048, 8192)])
def test_large_gemm_backward_is_about_twice_the_forward(device: str, m: int, n: int, k: int) -> None:
    # the backward's two products do 2x the forward's FLOPs (Narayanan et al. SC'21 count forward
    # plus backward as 3x the forward); well-shaped products run at about the same rate
    t = operation_ms(Operation(kind="gemm", m=m, n=n, k=k), device_type=device)
    assert t.backward / t.forward == pytest.approx(2.0, rel=0.1)


@given(st.integers(1, 5), devices)
def test_count_multiplies_every_part(count: int, device: str) -> None:
    one = operation_ms(Operation(kind="gemm", m=2048, n=1024, k=512), device_type=device)
    many = operation_ms(Operation(kind="gemm", m=2048, n=1024, k=512, count=count), device_type=device)
    assert many.forward == pytest.approx(count * one.forward, rel=REL)
    assert many.backward_input == pytest.approx(count * one.backward_input, rel=REL)
    assert many.backward_weight == pytest.approx(count * one.backward_weight, rel=REL)


# --------------------------------------------------------------------------- memory-bound


@pytest.mark.parametrize("device", (*GPUS, "cpu"))
def test_memory_kernel_moves_bytes_at_bandwidth_times_efficiency(device: str) -> None:
    c = default_constants(device)
    bandwidth = DEVICES[device].memory_bandwidth_bytes_per_s
    assert memory_ms(2**30, device_type=device) == pytest.approx(2**30 / (bandwidth * c.memory_efficiency) * 1e3, rel=REL)
    assert memory_ms(64, device_type=device) == DEVICES[device].launch_floor_s * 1e3  # tiny: the floor
    assert memory_ms(0, device_type=device) == 0.0


def test_memory_backward_moves_twice_the_bytes() -> None:
    t = operation_ms(Operation(kind="memory", bytes=2**28), device_type="a100-80g")
    assert t.backward_input == pytest.approx(2 * t.forward, rel=REL)
    assert t.backward_weight == 0.0


@given(st.integers(0, 10**11), st.integers(0, 10**10), devices)
def test_memory_time_is_non_decreasing_in_bytes(nbytes: int, more: int, device: str) -> None:
    assert at_least(memory_ms(nbytes + more, device_type=device), memory_ms(nbytes, device_type=device))


# --------------------------------------------------------------------------- attention


def _attn(**kw: object) -> Operation:
    base: dict[str, object] = {"kind": "attention", "batch": 4, "heads": 16, "query_len": 2048,
                               "key_len": 2048, "head_dim": 128}
    base.update(kw)
    return Operation.model_validate(base)


@pytest.mark.parametrize("device", GPUS)
def test_causal_flash_attention_does_half_the_work(device: str) -> None:
    # the kernel skips the blocks above the diagonal: half the FLOPs, same shape effects
    full = attention_ms(_attn(causal=False), device_type=device)
    causal = attention_ms(_attn(causal=True), device_type=device)
    assert causal[0] == pytest.approx(full[0] / 2, rel=REL)
    assert causal[1] == pytest.approx(full[1] / 2, rel=REL)


@pytest.mark.parametrize("device", GPUS)
def test_flash_backward_is_its_flops_at_the_backward_fraction(device: str) -> None:
    # q = kv: forward and backward block the same way; the backward does 2.5x the FLOPs at
    # backward fraction / forward fraction of the rate
    fwd_fraction, bwd_fraction = DEVICES[device].attention_fraction
    fwd, bwd = attention_ms(_attn(), device_type=device)
    assert bwd / fwd == pytest.approx(2.5 * fwd_fraction / bwd_fraction, rel=REL)


def test_flash_forward_blocks_over_queries_and_backward_over_keys() -> None:
    # A100, 108 heads of 128 queries x 4096 keys, d = 128.  Forward: 108 blocks of 128 queries,
    # one full wave, inner loop over 4096 keys: 0.75 x 0.88 x 4096 / (4096 + 192).  Backward:
    # 108 x 32 = 3456 blocks of 128 keys, 32 full waves, inner loop over 128 queries:
    # 0.6 x 0.88 x 128 / (128 + 192), for 2.5x the FLOPs.
    op = _attn(batch=1, heads=108, query_len=128, key_len=4096, head_dim=128)
    g = default_constants("a100-80g").gemm_efficiency
    flops = 4 * 108 * 128 * 4096 * 128
    fwd, bwd = attention_ms(op, device_type="a100-80g")
    assert fwd == pytest.approx(flops / (312e12 * 0.75 * g * 4096 / 4288) * 1e3, rel=REL)
    assert bwd == pytest.approx(2.5 * flops / (312e12 * 0.6 * g * 128 / 320) * 1e3, rel=REL)


def test_flash_attention_forward_lands_in_flashattention2s_range_on_a100() -> None:
    # FlashAttention-2 (Dao 2023): 50-73% of A100 peak forward at head_dim 128, long sequences
    op = _attn(batch=8, heads=16, query_len=4096, key_len=4096)
    fwd, _ = attention_ms(op, device_type="a100-80g")
    rate = 4 * 8 * 16 * 4096 * 4096 * 128 / (fwd * 1e-3) / 312e12
    assert 0.50 <= rate <= 0.73


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("seq", [1024, 2048, 4096])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_beats_materialised_attention(device: str, seq: int, head_dim: int) -> None:
    # FlashAttention (Dao et al. 2022) and FlashAttention-2 are faster than standard attention at
    # these lengths, forward and backward together
    op = _attn(heads=2048 // head_dim, head_dim=head_dim, query_len=seq, key_len=seq)
    fused = attention_ms(op, device_type=device)
    materialised = attention_ms(op.model_copy(update={"fused": False}), device_type=device)
    assert sum(fused) < sum(materialised)


def test_materialised_attention_is_its_gemms_plus_the_softmax_passes() -> None:
    # b h = 64 (sequence, head) pairs of 1024 queries x 2048 keys, d = 64: bf16 scores of
    # 64 x 1024 x 2048 x 2 bytes = 256 MiB per pass over them
    op = _attn(batch=4, heads=16, query_len=1024, key_len=2048, head_dim=64, fused=False)
    d = "h100-80g"
    q, kv, hd, scores = 1024, 2048, 64, 64 * 1024 * 2048 * 2

    def g(m: int, n: int, k: int) -> float:
        return gemm_ms(m, n, k, batch=64, dtype=BF16, device_type=d)

    fwd, bwd = attention_ms(op, device_type=d)
    # S = Q K^T (q, kv, d); softmax reads S, writes P; O = P V (q, d, kv)
    assert fwd == pytest.approx(g(q, kv, hd) + memory_ms(2 * scores, device_type=d) + g(q, hd, kv), rel=REL)
    # dV = P^T dO (kv, d, q); dP = dO V^T (q, kv, d); dS reads P, dP, writes dS; dQ = dS K
    # (q, d, kv); dK = dS^T Q (kv, d, q)
    expected = (g(kv, hd, q) + g(q, kv, hd) + memory_ms(3 * scores, device_type=d) + g(q, hd, kv)
                + g(kv, hd, q))
    assert bwd == pytest.approx(expected, rel=REL)


attention_dims = st.fixed_dictionaries({
    "batch": st.integers(1, 8), "heads": st.integers(1, 64), "query_len": st.integers(1, 8192),
    "key_len": st.integers(1, 8192), "head_dim": st.sampled_from([32, 64, 80, 128, 256]),
})


@given(attention_dims, st.sampled_from(["batch", "heads", "query_len", "key_len", "head_dim"]),
       st.integers(1, 4096), st.booleans(), st.booleans(), st.sampled_from(GPUS))
def test_attention_time_is_non_decreasing_in_every_dimension(
    shape: dict[str, int], which: str, grow: int, fused: bool, causal: bool, device: str
) -> None:
    before = _attn(**shape, fused=fused, causal=causal)
    after = before.model_copy(update={which: shape[which] + grow})
    for a, b in zip(attention_ms(after, device_type=device), attention_ms(before, device_type=device), strict=True):
        assert at_least(a, b)


# --------------------------------------------------------------------------- sharding and resizing


def test_shard_divides_the_named_dimension_rounding_up() -> None:
    assert shard_operation(Operation(kind="gemm", m=8, n=4096, k=64, tp_shard="n"), 8).n == 512
    assert shard_operation(Operation(kind="gemm", m=8, n=10, k=64, tp_shard="n"), 4).n == 3
    assert shard_operation(Operation(kind="gemm", m=8, n=10, k=64, tp_shard="k"), 4).k == 16
    assert shard_operation(_attn(heads=96, tp_shard="heads"), 8).heads == 12
    assert shard_operation(Operation(kind="memory", bytes=1001, tp_shard="bytes"), 8).bytes == 126


def test_replicated_operations_divide_only_memory_kernels_under_sequence_parallelism() -> None:
    norm = Operation(kind="memory", bytes=1000)
    gemm = Operation(kind="gemm", m=64, n=64, k=64)
    assert shard_operation(norm, 8) == norm
    assert shard_operation(norm, 8, sequence_parallel=True).bytes == 125
    assert shard_operation(gemm, 8, sequence_parallel=True) == gemm
    # a sharded memory kernel is divided once, not twice, under sequence parallelism
    act = Operation(kind="memory", bytes=1000, tp_shard="bytes")
    assert shard_operation(act, 8, sequence_parallel=True).bytes == 125


def test_shard_rejects_a_dimension_the_kind_has_not() -> None:
    with pytest.raises(ValueError, match=r"memory operation cannot shard 'n'.*'bytes'"):
        shard_operation(Operation(kind="memory", bytes=10, tp_shard="n"), 2)
    with pytest.raises(ValueError, match=r"t=0.*positive integer"):
        shard_operation(Operation(kind="memory", bytes=10), 0)


def test_resize_scales_the_micro_batch_dimension() -> None:
    assert resize_operation(Operation(kind="gemm", m=2048, n=7, k=9), 2).m == 4096
    assert resize_operation(Operation(kind="gemm", m=10, n=7, k=9), 0.01).m == 1  # at least 1
    assert resize_operation(_attn(batch=4), 0.5).batch == 2
    assert resize_operation(Operation(kind="memory", bytes=1000), 1.5).bytes == 1500
    assert resize_operation(Operation(kind="memory", bytes=0), 3).bytes == 0
    op = Operation(kind="gemm", m=2048, n=7, k=9)
    assert resize_operation(op, 1) == op
    with pytest.raises(ValueError, match=r"ratio=0.*> 0"):
        resize_operation(op, 0)


# --------------------------------------------------------------------------- a whole layer


def gpt3_block(s: int = 2048, b: int = 1, h: int = 12288, heads: int = 96) -> list[Operation]:
    """A Megatron GPT-3 block's forward, written by hand (bf16, 2 bytes; masks 1 byte): the four
    linear layers, unfused attention (Megatron 2021) and the memory-bound kernels."""
    tokens, e = b * s, 2
    return [
        Operation(kind="memory", bytes=2 * tokens * h * e),  # layer norm: read, write
        Operation(kind="gemm", m=tokens, n=3 * h, k=h, tp_shard="n"),  # QKV
        Operation(kind="attention", batch=b, heads=heads, query_len=s, key_len=s, head_dim=h // heads,
                  causal=True, fused=False, tp_shard="heads"),
        Operation(kind="memory", bytes=b * heads * s * s * (2 * e + 1), tp_shard="bytes"),  # attention dropout
        Operation(kind="gemm", m=tokens, n=h, k=h, tp_shard="k"),  # output projection
        Operation(kind="memory", bytes=tokens * h * (3 * e + 1)),  # dropout + residual add
        Operation(kind="memory", bytes=2 * tokens * h * e),  # layer norm
        Operation(kind="gemm", m=tokens, n=4 * h, k=h, tp_shard="n"),  # MLP up
        Operation(kind="memory", bytes=2 * tokens * 4 * h * e, tp_shard="bytes"),  # GeLU
        Operation(kind="gemm", m=tokens, n=h, k=4 * h, tp_shard="k"),  # MLP down
        Operation(kind="memory", bytes=tokens * h * (3 * e + 1)),  # dropout + residual add
    ]


def test_gpt3_block_on_a100_runs_between_megatrons_end_to_end_rate_and_the_gemm_rate() -> None:
    """Narayanan et al. (SC'21, Table 1) trained GPT models of 1.7B-1T parameters at 44-52% of
    A100 peak per GPU end to end: communication, pipeline bubbles and the optimizer included, so
    the block's computation alone runs faster than 44%.  No block runs faster than its GEMMs."""
    s, b, h, t = 2048, 1, 12288, 8
    flops_forward = 24 * b * s * h * h * (1 + s / (6 * h)) / t  # their formula, one block, per GPU
    times = layer_times(gpt3_block(s, b, h), device_type="a100-80g", tensor_parallel=t)
    peak = 312e12
    rate = 3 * flops_forward / ((times.forward + times.backward) * 1e-3) / peak
    assert 0.44 < rate < default_constants("a100-80g").gemm_efficiency
    assert 0.44 < flops_forward / (times.forward * 1e-3) / peak


@given(st.sampled_from([1, 2, 4, 8, 16]), st.booleans(), st.sampled_from(GPUS), st.sampled_from([256, 1024, 4096]))
def test_tensor_parallelism_never_slows_a_layer_nor_speeds_it_more_than_t(
    t: int, sp: bool, device: str, s: int
) -> None:
    ops = gpt3_block(s=s, h=4096, heads=32)
    whole = layer_times(ops, device_type=device)
    part = layer_times(ops, device_type=device, tensor_parallel=t, sequence_parallel=sp)
    for one, sharded in ((whole.forward, part.forward), (whole.backward, part.backward)):
        assert sharded <= one * (1 + REL)
        assert at_least(t * sharded, one)


def test_sequence_parallelism_shortens_the_replicated_kernels() -> None:
    ops = gpt3_block(h=4096, heads=32)
    plain = layer_times(ops, device_type="h100-80g", tensor_parallel=8)
    sp = layer_times(ops, device_type="h100-80g", tensor_parallel=8, sequence_parallel=True)
    assert sp.forward < plain.forward and sp.backward < plain.backward
    assert sp.backward_weight == plain.backward_weight  # only memory-bound kernels changed


def test_layer_times_add_up_their_operations() -> None:
    ops = gpt3_block(s=512, h=1024, heads=16)
    total = OpTimes()
    for op in ops:
        total = total + operation_ms(op, device_type="a100-40g")
    assert layer_times(ops, device_type="a100-40g") == total


@given(st.floats(1.0, 8.0), st.sampled_from(GPUS))
def test_a_bigger_micro_batch_is_never_faster(ratio: float, device: str) -> None:
    ops = gpt3_block(s=1024, h=2048, heads=16)
    base = layer_times(ops, device_type=device)
    bigger = layer_times([resize_operation(op, ratio) for op in ops], device_type=device)
    assert at_least(bigger.forward, base.forward) and at_least(bigger.backward, base.backward)


# --------------------------------------------------------------------------- errors and constants


def test_unknown_device_type_names_it_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown device type 'tpu-v9'.*a100-40g.*h100-80g"):
        gemm_ms(8, 8, 8, dtype=BF16, device_type="tpu-v9")
    with pytest.raises(ValueError, match=r"'tpu-v9'.*choose one of"):
        default_constants("tpu-v9")


def test_bad_dtype_names_it_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"dtype 'int4'.*'a100-80g'.*bfloat16, float16, float32, tfloat32"):
        gemm_ms(8, 8, 8, dtype="int4", device_type="a100-80g")
    with pytest.raises(ValueError, match=r"dtype 'float8'"):
        attention_ms(_attn(dtype="float8"), device_type="h100-80g")


def test_bad_sizes_and_constants_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"k=0.*positive integer"):
        gemm_efficiency(8, 8, 0, dtype=BF16, device_type="a100-80g")
    with pytest.raises(ValueError, match=r"gemm_efficiency=1.2.*\(0, 1\]"):
        DeviceConstants(gemm_efficiency=1.2, memory_efficiency=0.8)
    with pytest.raises(ValueError, match=r"memory_efficiency=nan"):
        DeviceConstants(gemm_efficiency=0.5, memory_efficiency=math.nan)
    with pytest.raises(ValueError, match=r"nbytes=-1"):
        memory_ms(-1, device_type="cpu")
    with pytest.raises(ValueError, match=r"'memory' operation.*'attention'"):
        attention_ms(Operation(kind="memory", bytes=1), device_type="cpu")


def test_every_device_preset_has_default_constants() -> None:
    for device in DEVICES:
        c = default_constants(device)
        assert 0 < c.gemm_efficiency <= 1 and 0 < c.memory_efficiency <= 1


def test_fitted_constants_scale_a_compute_bound_gemm() -> None:
    # halving the GEMM constant doubles the time of a compute-bound product
    full = gemm_ms(8192, 8192, 8192, dtype=BF16, device_type="h100-80g")
    c = default_constants("h100-80g")
    half = gemm_ms(8192, 8192, 8192, dtype=BF16, device_type="h100-80g",
                   constants=DeviceConstants(c.gemm_efficiency / 2, c.memory_efficiency))
    assert half == pytest.approx(2 * full, rel=REL)
