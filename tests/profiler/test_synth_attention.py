"""synth's attention kinds: fused (the default, flash-attention-like) and materialized
(Megatron-LM before flash attention, the score matrix's memory-bound passes timed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.cli import main
from profiler.synth import score_pass_bytes, synth_transformer

# the 1.7B row of Megatron-LM's Table 1, on an A100-80GB (2,039 GB/s, 312 TFLOP/s bf16)
H, A, S, L, V = 2304, 24, 2048, 2, 51200
BANDWIDTH, PEAK, MFU = 2039e9, 312e12, 0.6


def _synth(**kw: object) -> object:
    return synth_transformer(
        layers=L, hidden=H, heads=A, seq=S, vocab=V, device_type="a100-80g", dtype="bfloat16", mfu=MFU,
        microbatch_sizes=(1, 2), **kw,  # type: ignore[arg-type]
    )


def _block(profile: object) -> object:
    return profile.layers[1]  # type: ignore[attr-defined]


def test_fused_attention_is_flops_only() -> None:
    block = _block(_synth())
    for i, b in enumerate((1, 2)):
        flops = 2 * b * S * (12 * H * H) + 4 * b * S * S * H
        assert block.forward_ms[i] == pytest.approx(flops / (PEAK * MFU) * 1e3, rel=1e-12)
        assert block.backward_ms[i] == pytest.approx(2 * block.forward_ms[i], rel=1e-12)
    # flash attention keeps no score matrix: nothing for selective recompute to drop
    assert block.selective_recompute_ms is None and block.selective_recompute_bytes is None
    mat = _block(_synth(attention="materialized"))
    for i, b in enumerate((1, 2)):
        assert mat.selective_recompute_ms[i] == pytest.approx(
            4 * b * S * S * H / (PEAK * MFU) * 1e3 + A * S * S * b * 9 / BANDWIDTH * 1e3, rel=1e-12)


def test_materialized_attention_adds_the_score_passes_at_memory_bandwidth() -> None:
    fused, mat = _block(_synth()), _block(_synth(attention="materialized"))
    for i, b in enumerate((1, 2)):
        scores = A * S * S * b  # one score per head, query and key
        # forward: softmax reads and writes 2 bytes each; dropout reads 2, writes 2 and a 1-byte mask
        fwd_extra = scores * (2 + 2 + 2 + 2 + 1) / BANDWIDTH * 1e3
        # backward: dropout reads the mask and the gradient, writes one; softmax reads two, writes one
        bwd_extra = scores * (1 + 2 + 2 + 2 + 2 + 2) / BANDWIDTH * 1e3
        assert mat.forward_ms[i] == pytest.approx(fused.forward_ms[i] + fwd_extra, rel=1e-12)
        assert mat.backward_ms[i] == pytest.approx(fused.backward_ms[i] + bwd_extra, rel=1e-12)
        # the weight gradient has no score pass; the input gradient takes all of it
        assert mat.backward_weight_ms[i] == pytest.approx(fused.backward_weight_ms[i], rel=1e-12)
        assert mat.backward_input_ms[i] + mat.backward_weight_ms[i] == pytest.approx(mat.backward_ms[i], rel=1e-12)
        # materialised attention keeps the probabilities, their dropout mask and output (2p + 1
        # bytes per score); flash attention its float32 log-sum-exp per head and query
        assert mat.activation_bytes[i] - fused.activation_bytes[i] == scores * 5 - 4 * b * A * S
    # only the blocks change: embedding and head are the same
    a, m = _synth(), _synth(attention="materialized")
    for i in (0, L + 1):
        assert a.layers[i].forward_ms == m.layers[i].forward_ms  # type: ignore[attr-defined]
    assert m.metadata["synth"]["attention"] == "materialized"  # type: ignore[attr-defined]


def test_score_pass_bytes_without_dropout_and_in_float32() -> None:
    assert score_pass_bytes(2, dropout=True, attention="materialized") == (9, 11)
    assert score_pass_bytes(2, dropout=False, attention="materialized") == (4, 6)
    assert score_pass_bytes(4, dropout=True, attention="materialized") == (17, 21)
    assert score_pass_bytes(2, dropout=True, attention="fused") == (0, 0)


def test_the_passes_weigh_more_where_sequence_per_hidden_unit_is_larger() -> None:
    """The share of the block's time the passes add falls as h grows (s fixed, head size fixed)."""
    shares = []
    for hidden in (1024, 2304, 8192):
        kw: dict[str, object] = {"layers": 1, "hidden": hidden, "heads": hidden // 128, "seq": S, "vocab": 1000,
                                 "device_type": "a100-80g", "microbatch_sizes": (1,)}
        f = synth_transformer(**kw).layers[1].forward_ms[0]  # type: ignore[arg-type]
        m = synth_transformer(**kw, attention="materialized").layers[1].forward_ms[0]  # type: ignore[arg-type]
        shares.append(m / f - 1)
    assert shares[0] > shares[1] > shares[2] > 0


def test_unknown_attention_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention 'paged'.*fused, materialized"):
        _synth(attention="paged")


def test_synth_cli_attention_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    base = "synth transformer --layers 2 --hidden 64 --heads 4 --seq 128 --vocab 100 --device-type a100-80g".split()
    assert main([*base, "--attention", "materialized", "-q", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["metadata"]["synth"]["attention"] == "materialized"
    fused = tmp_path / "f.json"
    assert main([*base, "-q", "-o", str(fused)]) == 0
    assert json.loads(fused.read_text())["layers"][1]["forward_ms"][0] < doc["layers"][1]["forward_ms"][0]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*base, "--attention", "paged"])
    assert "--attention" in capsys.readouterr().err
