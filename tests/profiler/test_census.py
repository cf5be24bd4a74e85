"""The operation census (profiler/census.py): what one forward of a layer runs, as GEMMs,
attention and memory-bound bytes; and the private torch APIs it relies on
(profiler/_torch_dispatch.py).

Every expected shape and byte count below is computed by hand from the module's sizes; the
FLOP totals are checked against torch's own counter (``torch.utils.flop_counter``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import examples.gpt as gpt
from pipeplan.cli import main
from planner.schema import Operation, load_document
from profiler import _torch_dispatch
from profiler.census import Census, census, gemm_flops, operations_of
from profiler.measure import resize_batch
from profiler.split import split_model

aten = torch.ops.aten


def _gemms(ops: list[Operation]) -> list[tuple[int, int, int, int, int]]:
    """(m, n, k, batch, count) of every GEMM, sorted."""
    return sorted((o.m, o.n, o.k, o.batch, o.count) for o in ops if o.kind == "gemm")  # type: ignore[misc]


def _torch_flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------- private API


def test_the_dispatch_mode_is_where_the_census_imports_it() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    assert _torch_dispatch.dispatch_mode() is TorchDispatchMode


def test_every_operator_overload_the_census_maps_exists() -> None:
    names = [
        *_torch_dispatch.GEMM_OPS,
        *_torch_dispatch.CONV_OPS,
        *_torch_dispatch.ATTENTION_OPS,
        *_torch_dispatch.ATTENTION_BSHD_OPS,
    ]
    missing = [f"aten.{op}.{overload}" for op, overload in names if not _torch_dispatch.aten_overloads([(op, overload)])]
    assert not missing, f"torch {torch.__version__} lacks {missing}: update profiler/_torch_dispatch.py"
    assert len(_torch_dispatch.aten_overloads(names)) == len(names)
    assert _torch_dispatch.aten_overloads([("no_such_op", "default"), ("mm", "no_such_overload")]) == frozenset()


def test_the_argument_names_the_census_reads_are_in_the_schemas() -> None:
    from profiler.census import _GEMM_OPERANDS

    def names(op: Any) -> set[str]:
        return {a.name for a in op._schema.arguments}

    for op, overload in _torch_dispatch.GEMM_OPS:
        func = getattr(getattr(aten, op), overload)
        assert set(_GEMM_OPERANDS[op]) <= names(func), func
    for op, overload in _torch_dispatch.CONV_OPS:
        assert {"input", "weight", "transposed", "groups"} <= names(getattr(getattr(aten, op), overload))
    for op, overload in _torch_dispatch.ATTENTION_OPS:
        assert {"query", "key", "is_causal"} <= names(getattr(getattr(aten, op), overload))
    flash, efficient = aten._flash_attention_forward.default, aten._efficient_attention_forward.default
    assert {"query", "key", "is_causal", "cum_seq_q", "cum_seq_k", "max_q", "max_k"} <= names(flash)
    assert {"query", "key", "custom_mask_type", "cu_seqlens_q", "cu_seqlens_k"} <= names(efficient)


def test_schemas_tell_views_from_in_place_writes_and_bind_arguments() -> None:
    assert _torch_dispatch.returns_view(aten.view.default)
    assert _torch_dispatch.returns_view(aten.transpose.int)
    assert _torch_dispatch.returns_view(aten.split.Tensor)  # a list of views
    assert _torch_dispatch.returns_view(aten.detach.default)
    assert not _torch_dispatch.returns_view(aten.add_.Tensor)  # writes its alias
    assert not _torch_dispatch.returns_view(aten.clone.default)
    # the schema does not mark _unsafe_view as a view: the census skips it by name
    assert not _torch_dispatch.returns_view(aten._unsafe_view.default)
    assert _torch_dispatch.operator_name(aten.addmm.default) == "addmm"
    assert _torch_dispatch.is_operator(aten.mm.default) and not _torch_dispatch.is_operator(torch.mm)
    q = torch.ones(1)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    bound = _torch_dispatch.bind_arguments(sdpa, (q, q, q), {})
    assert bound["query"] is q and bound["is_causal"] is False and bound["dropout_p"] == 0.0
    bound = _torch_dispatch.bind_arguments(sdpa, (q, q, q, 0.0, True), {"scale": 0.5})
    assert bound["is_causal"] is True and bound["scale"] == 0.5


def test_the_dispatch_mode_sees_the_product_below_the_linear_layer() -> None:
    seen: list[str] = []
    recorder = Census()
    spy = recorder.record

    def record(func: Any, args: Any, kwargs: Any, out: Any) -> None:
        seen.append(_torch_dispatch.operator_name(func))
        spy(func, args, kwargs, out)

    recorder.record = record  # type: ignore[method-assign]
    with recorder.recording():
        nn.Linear(4, 3)(torch.randn(2, 5, 4))
    assert "addmm" in seen and "linear" not in seen  # decomposed above the mode


# --------------------------------------------------------------------------- GEMM


def test_a_linear_layer_is_one_gemm_of_the_flattened_tokens() -> None:
    """nn.Linear(64, 128) on (4, 10, 64): torch runs view (40, 64), t (the weight), addmm (the
    bias added in the product, beta * bias + x W^T), view (4, 10, 128): one GEMM of m = 4 * 10
    = 40 rows, n = 128 output features, k = 64, and no other operation."""
    torch.manual_seed(0)
    ops = census(nn.Linear(64, 128), (torch.randn(4, 10, 64, requires_grad=True),))
    assert ops == [Operation(kind="gemm", m=40, n=128, k=64, batch=1, count=1, dtype="float32")]
    # without a bias torch runs mm and _unsafe_view: the same GEMM
    ops = census(nn.Linear(64, 128, bias=False).to(torch.bfloat16), (torch.randn(4, 10, 64, dtype=torch.bfloat16),))
    assert ops == [Operation(kind="gemm", m=40, n=128, k=64, batch=1, count=1, dtype="bfloat16")]


def test_identical_operations_merge_into_a_count() -> None:
    stack = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    assert census(stack, (torch.randn(2, 16),)) == [Operation(kind="gemm", m=2, n=16, k=16, count=3, dtype="float32")]


def test_batched_products_keep_their_batch() -> None:
    class Scores(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return q @ k.transpose(-2, -1)  # [2, 3, 5, 8] @ [2, 3, 8, 7]

    ops = census(Scores(), (torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)))
    # k^T is not contiguous: torch copies it (a memory op) before bmm of batch 2 * 3 = 6
    assert _gemms(ops) == [(5, 7, 8, 6, 1)]


def test_convolutions_are_implicit_gemms_per_group() -> None:
    x = torch.randn(2, 8, 10, 10)
    # 3x3, padding 1: output 2 x 16 x 10 x 10; m = 2 * 10 * 10 = 200, n = 16, k = 8 * 3 * 3 = 72
    assert _gemms(census(nn.Conv2d(8, 16, 3, padding=1), (x,))) == [(200, 16, 72, 1, 1)]
    # 2 groups, stride 2, no padding: output 4 x 4; per group n = 16 / 2 = 8, k = 8 / 2 * 3 * 3 = 36
    assert _gemms(census(nn.Conv2d(8, 16, 3, stride=2, groups=2), (x,))) == [(2 * 4 * 4, 8, 36, 2, 1)]
    # depthwise: 8 groups of n = 1, k = 3 * 3
    assert _gemms(census(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), (x,))) == [(200, 1, 9, 8, 1)]
    # transposed 4 -> 6 channels, kernel 2: m = 2 * 10 * 10 input pixels, n = 6 * 2 * 2, k = 8
    assert _gemms(census(nn.ConvTranspose2d(8, 6, 2, stride=2), (x,))) == [(200, 24, 8, 1, 1)]
    # 1-D: input 2 x 8 x 10, kernel 3: output length 8; m = 2 * 8, n = 4, k = 8 * 3
    assert _gemms(census(nn.Conv1d(8, 4, 3), (torch.randn(2, 8, 10),))) == [(16, 4, 24, 1, 1)]


# --------------------------------------------------------------------------- attention


def test_fused_attention_is_one_operation_with_its_causal_flag() -> None:
    class Attention(nn.Module):
        def __init__(self, causal: bool) -> None:
            super().__init__()
            self.causal = causal

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)

    q, kv = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 12, 16)  # 4 query heads share 2 key heads
    (op,) = census(Attention(False), (q, kv, kv))
    assert op == Operation(
        kind="attention", batch=2, heads=4, query_len=8, key_len=12, head_dim=16, causal=False, fused=True, dtype="float32"
    )
    (op,) = census(Attention(True), (q, q, q))
    assert (op.heads, op.query_len, op.key_len, op.causal) == (4, 8, 8, True)


def test_directly_called_attention_kernels_map_their_layout() -> None:
    """The CUDA kernels' argument layouts ([batch, len, heads, dim], packed sequences), read
    without running them (the census reads shapes only)."""
    q, k = torch.empty(3, 8, 4, 16), torch.empty(3, 10, 4, 16)
    flash = aten._flash_attention_forward.default
    keys = operations_of(flash, (q, k, k, None, None, 8, 10, 0.0, True, False), {}, None)
    assert [dict(key) for key in keys] == [
        {"kind": "attention", "batch": 3, "heads": 4, "query_len": 8, "key_len": 10, "head_dim": 16,
         "causal": True, "fused": True, "dtype": "float32"}
    ]  # fmt: skip
    packed = torch.empty(8, 4, 16)  # two sequences of 3 and 5 tokens
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    keys = operations_of(flash, (packed, packed, packed, offsets, offsets, 5, 5, 0.0, False, False), {}, None)
    assert [(dict(x)["batch"], dict(x)["query_len"], dict(x)["key_len"]) for x in keys] == [(1, 3, 3), (1, 5, 5)]
    efficient = aten._efficient_attention_forward.default
    keys = operations_of(efficient, (q, k, k, None, None, None, None, None, 0.0, 1), {}, None)
    assert dict(keys[0])["causal"] is True and dict(keys[0])["key_len"] == 10


# --------------------------------------------------------------------------- memory-bound


def _bytes(ops: list[Operation]) -> list[int]:
    return [o.bytes for o in ops if o.kind == "memory" for _ in range(o.count)]  # type: ignore[misc]


def test_memory_operations_count_bytes_read_and_written() -> None:
    class Mix(nn.Module):
        def forward(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            y = x + b  # reads 4 * 8 + 8 floats (b broadcast, read once), writes 4 * 8
            z = y.t().view(8, 4).transpose(0, 1)  # views: nothing
            return z.contiguous()  # already contiguous again: nothing

    x, b = torch.randn(4, 8), torch.randn(8)
    assert _bytes(census(Mix(), (x, b))) == [(32 + 8 + 32) * 4]

    class Copies(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = x.clone()  # reads and writes 32 floats
            x.add_(y)  # in place: reads x and y, writes x
            out = torch.empty_like(x)  # allocates only: nothing
            out.copy_(x)  # overwrites out without reading it
            return x.t().contiguous().t() + out  # a real copy (32 + 32), then an add (32 + 32 + 32)

    assert sorted(_bytes(census(Copies(), (x, x)))) == sorted(f * 32 * 4 for f in (2, 3, 2, 2, 3))


def test_a_gather_reads_the_rows_it_returns_not_the_table() -> None:
    ids = torch.randint(0, 1000, (2, 5))
    (op,) = census(nn.Embedding(1000, 16), (ids,))
    rows = 2 * 5 * 16 * 4  # the output, and the rows of the table read for it
    assert op.kind == "memory" and op.bytes == rows + 2 * 5 * 8 + rows  # plus the int64 ids
    assert op.bytes < 1000 * 16 * 4  # far less than the table


def test_operators_the_census_cannot_read_record_nothing_and_never_raise() -> None:
    recorder = Census()
    recorder.record(aten.mm.default, ("not", "tensors"), {}, None)
    recorder.record(torch.mm, (), {}, None)  # not an ATen overload
    assert recorder.operations() == [] and recorder.unread == 0


# --------------------------------------------------------------------------- the zoo GPT


@pytest.fixture(scope="module")
def gpt_units() -> tuple[gpt.GPTConfig, Any, tuple[torch.Tensor, ...]]:
    cfg = gpt.GPTConfig()  # examples.gpt:tiny
    model, inputs = gpt.build(cfg)
    return cfg, split_model(model, inputs), inputs


def _block_inputs(split: Any, inputs: tuple[torch.Tensor, ...], b: int) -> tuple[Any, ...]:
    x = split.units[0](*resize_batch(inputs, b))
    return tuple(t.detach() for t in x)


@pytest.mark.parametrize("b", [1, 2])
def test_each_gpt_block_runs_its_projections_and_the_attention_products(gpt_units: Any, b: int) -> None:
    cfg, split, inputs = gpt_units
    assert (cfg.hidden, cfg.heads, cfg.seq, cfg.ffn) == (64, 4, 32, None)  # the numbers below
    tokens, h, heads, d, s = b * 32, 64, 4, 64 // 4, 32
    want = sorted([
        (tokens, 3 * h, h, 1, 1),  # qkv: [b*s, 64] @ [64, 192]
        (tokens, h, h, 1, 1),  # attention output projection
        (tokens, 4 * h, h, 1, 1),  # MLP fc: ffn = 4 * hidden = 256
        (tokens, h, 4 * h, 1, 1),  # MLP out
        (s, s, d, b * heads, 1),  # q @ k^T per (sample, head): materialised attention
        (s, d, s, b * heads, 1),  # softmax(scores) @ v
    ])  # fmt: skip
    x = _block_inputs(split, inputs, b)
    for name, unit in zip(split.names, split.units, strict=True):
        if not name.startswith("blocks."):
            continue
        ops = census(unit, x)
        assert _gemms(ops) == want, name
        assert not [o for o in ops if o.kind == "attention"]  # the zoo GPT materialises it
        assert 10 <= len(ops) <= 20
        x = tuple(t.detach() for t in unit(*x))


def test_census_flops_match_torchs_flop_counter(gpt_units: Any) -> None:
    """2 m n k batch count per GEMM (+ 4 b h q kv d per attention), within 1 % of
    torch.utils.flop_counter's forward FLOPs for the same layer."""
    _, split, inputs = gpt_units
    x: tuple[Any, ...] = resize_batch(inputs, 2)
    counted = []
    for name, unit in zip(split.names, split.units, strict=True):
        ours = gemm_flops(census(unit, x))
        theirs = _torch_flops(lambda unit=unit, x=x: unit(*x))
        assert ours == pytest.approx(theirs, rel=0.01), name  # the embedding: 0 both
        counted += [name] if theirs else []
        x = tuple(t.detach() for t in unit(*x))
    assert counted == [*(f"blocks.{i}" for i in range(4)), "head"]


def test_census_flops_match_torch_for_convolutions_and_fused_attention() -> None:
    torch.manual_seed(0)
    convs = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8, padding=1),
        nn.Conv2d(8, 12, 1, groups=2), nn.ConvTranspose2d(12, 4, 2, stride=2),
    )  # fmt: skip
    image = torch.randn(2, 3, 8, 8)
    assert gemm_flops(census(convs, (image,))) == pytest.approx(_torch_flops(lambda: convs(image)), rel=0.01)

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, k, is_causal=True)

    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    ours = gemm_flops(census(Attention(), (q, k)))  # the fused CPU kernel, one operation
    with sdpa_kernel(SDPBackend.MATH):  # torch does not count the CPU kernel: count the math one
        theirs = _torch_flops(lambda: Attention()(q, k))
    assert theirs == 4 * 2 * 4 * 8 * 8 * 16 and ours == pytest.approx(theirs, rel=0.01)


# --------------------------------------------------------------------------- pipeplan profile


def test_pipeplan_profile_writes_a_census_for_every_layer_and_size(tmp_path: Path) -> None:
    out = tmp_path / "gpt.json"
    argv = "profile --model examples.gpt:tiny --microbatch-sizes 1,2 --warmup 0 --repeats 1 --threads 1 -q -o"
    assert main([*argv.split(), str(out)]) == 0
    profile = load_document("profile", str(out))  # validates against planner.schema
    assert profile.microbatch_sizes == [1, 2]
    assert profile.metadata["profiler"]["census_failed"] == []
    for layer in profile.layers:
        assert layer.operations is not None and len(layer.operations) == 2, layer.name
        assert all(layer.operations), layer.name
    blocks = [layer for layer in profile.layers if layer.name.startswith("blocks.")]
    for layer in blocks:  # the token dimension doubles with the micro-batch, nothing else changes
        one, two = ([(o.m, o.n, o.k) for o in ops if o.kind == "gemm" and o.batch == 1] for ops in layer.operations)
        assert len(one) == 4 and two == [(2 * m, n, k) for m, n, k in one]
    head = profile.layers[-1]  # its census includes the loss (cross-entropy: memory-bound)
    assert [o.kind for o in head.operations[0]].count("gemm") == 1 and len(head.operations[0]) > 2
    raw = json.loads(out.read_text())
    assert raw["layers"][1]["operations"][0]  # written to the file, not only in memory


def test_a_unit_whose_census_fails_gets_none_and_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import profiler.measure as measure

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(4, 8)
    split = split_model(model, (x,))
    broken = split.units[1]

    def census_failing_on_one_unit(unit: nn.Module, inputs: Any, **kw: Any) -> list[Operation]:
        if unit is broken:
            raise RuntimeError("an operator the dispatch mode cannot run")
        return census(unit, inputs, **kw)

    monkeypatch.setattr(measure, "census", census_failing_on_one_unit)
    profile = measure.measure_split(split, (x,), microbatch_sizes=(1, 2), warmup=0, repeats=1)
    names = [layer.name for layer in profile.layers]
    assert profile.metadata["profiler"]["census_failed"] == [names[1]]
    assert profile.layers[1].operations is None
    first = profile.layers[0].operations
    assert first is not None and [_gemms(ops) for ops in first] == [[(1, 8, 8, 1, 1)], [(2, 8, 8, 1, 1)]]
