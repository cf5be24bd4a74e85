"""The profiler's selective-recompute fields (profiler/selective.py): attention's score tensors
a block keeps, and the time to recompute them, on tiny models built in code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import examples.gpt as gpt
from pipeplan.cli import main
from planner.schema import Profile, load_document
from profiler.measure import profile
from profiler.selective import trace_scores
from profiler.synth import synth_transformer

#: head size 16 == sequence 16: queries, keys and values are [b, a, s, s] too (must not count)
CFG = gpt.GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=2, batch=2)
SIZES = (1, 2)
P = 4  # float32


def score_bytes(cfg: gpt.GPTConfig, b: int) -> int:
    """What a zoo GPT block saves of its a·s²·b scores on CPU in float32: the softmax output
    (which the context product saves too, one storage); with dropout also the dropout's keep
    mask, a float tensor on CPU (torch multiplies by it: the 1-byte mask of ``native_dropout`` is
    the CUDA kernel's), and its output."""
    scores = cfg.heads * cfg.seq * cfg.seq * b
    return scores * P * (3 if cfg.dropout else 1)


@pytest.fixture(scope="module", params=[0.0, 0.1], ids=["no-dropout", "dropout"])
def measured(request: pytest.FixtureRequest) -> tuple[gpt.GPTConfig, Profile]:
    cfg = gpt.GPTConfig(**{**CFG.__dict__, "dropout": request.param})
    model, inputs = gpt.build(cfg)
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        prof = profile(model, inputs, microbatch_sizes=SIZES, loss_fn=gpt.lm_loss, warmup=1, repeats=3,
                       num_threads=1, progress=False)  # fmt: skip
    return cfg, prof


def test_blocks_keep_the_hand_computed_score_bytes(measured: tuple[gpt.GPTConfig, Profile]) -> None:
    cfg, prof = measured
    blocks = [layer for layer in prof.layers if layer.name.startswith("blocks.")]
    assert len(blocks) == cfg.layers
    for layer in blocks:
        assert layer.selective_recompute_bytes == [score_bytes(cfg, b) for b in SIZES]
        assert all(s < a for s, a in zip(layer.selective_recompute_bytes, layer.activation_bytes, strict=True))
    for layer in prof.layers:
        if not layer.name.startswith("blocks."):  # the embedding and the head: no attention
            assert layer.selective_recompute_bytes is None and layer.selective_recompute_ms is None


def test_recompute_time_is_a_part_of_the_block_forward(measured: tuple[gpt.GPTConfig, Profile]) -> None:
    _, prof = measured
    for layer in prof.layers:
        if layer.selective_recompute_ms is not None:
            for t, f in zip(layer.selective_recompute_ms, layer.forward_ms, strict=True):
                assert 0 < t < f


def test_agrees_with_synth_formula(measured: tuple[gpt.GPTConfig, Profile]) -> None:
    """Without dropout, synth's a·s²·b·p is exactly what is kept (the softmax output).  With
    dropout, synth counts a 1-byte mask (the CUDA kernel's) where CPU torch keeps a float one:
    the measured bytes are synth's plus a·s²·b·(p - 1), exactly."""
    cfg, prof = measured
    syn = synth_transformer(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, seq=cfg.seq, vocab=cfg.vocab,
                            dtype="float32", microbatch_sizes=SIZES, dropout=cfg.dropout > 0, attention="materialized")  # fmt: skip
    for got, want in zip(prof.layers[1:-1], syn.layers[1:-1], strict=True):
        assert got.selective_recompute_bytes is not None and want.selective_recompute_bytes is not None
        for b, g, w in zip(SIZES, got.selective_recompute_bytes, want.selective_recompute_bytes, strict=True):
            mask_extra = cfg.heads * cfg.seq**2 * b * (P - 1) if cfg.dropout else 0
            assert g == w + mask_extra


def test_profile_round_trips_through_the_schema(measured: tuple[gpt.GPTConfig, Profile]) -> None:
    _, prof = measured
    again = Profile.model_validate_json(prof.model_dump_json())
    assert again == prof
    assert again.layers[1].selective_recompute_ms == prof.layers[1].selective_recompute_ms


class _Attention(nn.Module):
    """One attention layer: eager (scores in memory) or fused (scaled_dot_product_attention);
    cross-attention when called with a memory of another length."""

    def __init__(self, hidden: int, heads: int, *, fused: bool = False) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(hidden, hidden), nn.Linear(hidden, 2 * hidden), nn.Linear(hidden, hidden)
        self.heads, self.fused = heads, fused

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, memory.shape[1], self.heads, -1).transpose(1, 2) for t in self.kv(memory).split(h, -1))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(h // self.heads), dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, h))  # type: ignore[no-any-return]


@pytest.mark.parametrize(("s_q", "s_k", "hidden", "heads"), [(8, 8, 16, 2), (8, 12, 16, 2), (16, 16, 16, 1), (8, 8, 32, 1)])
def test_scores_found_by_provenance_not_by_shape(s_q: int, s_k: int, hidden: int, heads: int) -> None:
    """Self- and cross-attention, with head size = sequence (q, k, v and the context are then
    score-shaped too, and must not count) and hidden = sequence: exactly the softmax output."""
    torch.manual_seed(0)
    layer = _Attention(hidden, heads)
    x = torch.randn(3, s_q, hidden, requires_grad=True)
    memory = torch.randn(3, s_k, hidden, requires_grad=True)
    found = trace_scores(layer, (x, memory), exclude=set())
    assert found.saved_bytes == 3 * heads * s_q * s_k * P
    assert found.calls  # the attention core, recorded for the replay


def test_fused_attention_keeps_no_scores() -> None:
    """scaled_dot_product_attention without dropout runs a fused kernel on CPU: nothing to drop."""
    layer = _Attention(16, 2, fused=True)
    x = torch.randn(2, 8, 16, requires_grad=True)
    found = trace_scores(layer, (x, x), exclude=set())
    assert found.saved_bytes == 0 and found.calls == []


def test_plan_takes_selective_recompute_on_a_measured_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof_path, plan_path = tmp_path / "p.json", tmp_path / "plan.json"
    argv = ["profile", "--model", "examples.gpt:tiny", "--microbatch-sizes", "1,2", "--warmup", "1", "--repeats", "2"]
    assert main([*argv, "--threads", "1", "-q", "-o", str(prof_path)]) == 0
    data = json.loads(prof_path.read_text())
    assert [x["name"] for x in data["layers"] if x.get("selective_recompute_bytes")] == [f"blocks.{i}" for i in range(4)]
    capsys.readouterr()
    argv = ["plan", str(prof_path), "--devices", "2", "--memory", "1GiB", "--device-type", "cpu", "--batch-size", "8"]
    assert main([*argv, "--selective-recompute", "-o", str(plan_path)]) == 0
    plan = load_document("plan", str(plan_path))
    assert plan.selective_recompute and not any(stage.recompute for stage in plan.stages)


@pytest.mark.cuda
def test_cuda_dropout_keeps_a_byte_mask_as_synth_says() -> None:
    """On CUDA the dropout is torch's fused kernel with a 1-byte mask: exactly synth's
    a·s²·b·(2p + 1)."""
    cfg = gpt.GPTConfig(**{**CFG.__dict__, "dropout": 0.1})
    model, inputs = gpt.build(cfg)
    prof = profile(model, inputs, microbatch_sizes=SIZES, device="cuda", loss_fn=gpt.lm_loss, warmup=1, repeats=3,
                   progress=False)  # fmt: skip
    for layer in prof.layers[1:-1]:
        assert layer.selective_recompute_bytes == [cfg.heads * cfg.seq**2 * b * (2 * P + 1) for b in SIZES]
        assert layer.selective_recompute_ms is not None
        assert all(0 < t < f for t, f in zip(layer.selective_recompute_ms, layer.forward_ms, strict=True))


def test_a_unit_the_tracer_cannot_run_gets_no_fields_and_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import profiler.measure as measure

    def broken(*args: object, **kwargs: object) -> None:
        raise NotImplementedError("an operator without a dispatch rule")

    monkeypatch.setattr(measure, "trace_scores", broken)
    model, inputs = gpt.build(CFG)
    prof = profile(model, inputs, microbatch_sizes=(1,), loss_fn=gpt.lm_loss, warmup=0, repeats=1, progress=False)
    assert all(layer.selective_recompute_bytes is None for layer in prof.layers)
    assert prof.metadata["profiler"]["selective_unmeasured"] == sorted(prof.layer_names())
