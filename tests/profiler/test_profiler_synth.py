"""Analytic profiles: formulas checked against a measured small Transformer, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import examples.gpt as gpt
import profiler
from pipeplan.cli import main
from planner.schema import load_document
from profiler.decoder import DecoderSpec, block_activation_bytes_of
from profiler.synth import block_activation_bytes, synth_transformer

SIZES = (1, 2)


def _measured(dropout: float, device: str = "cpu") -> object:
    cfg = gpt.GPTConfig(vocab=512, seq=64, hidden=64, heads=4, layers=2, dropout=dropout)
    model, inputs = gpt.build(cfg)
    return profiler.profile(
        model,
        inputs,
        microbatch_sizes=SIZES,
        device=device,
        loss_fn=gpt.lm_loss,
        warmup=0,
        repeats=1,
        progress=False,
        num_threads=1,
    )


def _synth(dropout: bool) -> object:
    return synth_transformer(
        layers=2,
        hidden=64,
        heads=4,
        seq=64,
        vocab=512,
        device_type="cpu",
        dtype="float32",
        microbatch_sizes=SIZES,
        tied_embeddings=True,
        dropout=dropout,
        attention="materialized",  # examples.gpt's attention writes its softmax to memory
    )


def _within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_synth_matches_a_measured_transformer_within_10_percent() -> None:
    measured, synth = _measured(0.0), _synth(False)
    assert measured.layer_names() == synth.layer_names()  # type: ignore[attr-defined]
    for m, s in zip(measured.layers, synth.layers, strict=True):  # type: ignore[attr-defined]
        assert _within(m.param_bytes, s.param_bytes, 0.10), (m.name, m.param_bytes, s.param_bytes)
        for i in range(len(SIZES)):
            assert _within(m.activation_bytes[i], s.activation_bytes[i], 0.10), (
                m.name,
                SIZES[i],
                m.activation_bytes[i],
                s.activation_bytes[i],
            )
        for i in range(len(SIZES)):
            assert _within(m.output_bytes[i], s.output_bytes[i], 0.10) or m.name == "head"
    assert measured.sha256() == synth.sha256()  # type: ignore[attr-defined]  # same names, same parameters


def test_the_comparison_can_fail() -> None:
    """A model 3x wider is not within 10 % of the formulas for the small one."""
    cfg = gpt.GPTConfig(vocab=512, seq=64, hidden=96, heads=4, layers=2)
    model, inputs = gpt.build(cfg)
    measured = profiler.profile(model, inputs, microbatch_sizes=SIZES, loss_fn=gpt.lm_loss, warmup=0, repeats=1, progress=False)
    block_m, block_s = measured.layers[1], _synth(False).layers[1]  # type: ignore[attr-defined]
    assert not _within(block_m.activation_bytes[0], block_s.activation_bytes[0], 0.10)


def test_korthikanti_formula_for_16_bit_with_dropout() -> None:
    s, b, h, a = 2048, 4, 4096, 32
    assert block_activation_bytes(b, s, h, a, 2) == s * b * h * 34 + 5 * a * s * s * b
    assert block_activation_bytes(b, s, h, a, 2, dropout=False) == s * b * h * 32 + 2 * a * s * s * b


@pytest.mark.cuda
def test_synth_with_dropout_matches_cuda_measurement() -> None:
    """CUDA dropout keeps 1-byte masks, as the formula assumes (CPU keeps dtype-sized ones)."""
    measured, synth = _measured(0.1, device="cuda"), _synth(True)
    for m, s in zip(measured.layers, synth.layers, strict=True):  # type: ignore[attr-defined]
        for i in range(len(SIZES)):
            assert _within(m.activation_bytes[i], s.activation_bytes[i], 0.10), (m.name, m.activation_bytes, s.activation_bytes)


def test_gpipe_6b_transformer_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpipe.json"
    argv = "synth transformer --layers 128 --hidden 2048 --ffn 8192 --heads 16 --seq 1024 --vocab 32000"
    rc = main([*argv.split(), "--device-type", "h100-80g", "-o", str(out), "-q"])
    assert rc == 0
    p = load_document("profile", str(out))
    assert p.num_layers == 130 and p.layers[0].name == "embed" and p.layers[-1].name == "head"
    params = sum(layer.param_bytes for layer in p.layers) / 2  # bf16
    assert 6.0e9 < params < 7.0e9  # "6 billion parameters" (GPipe, table 5) plus embeddings
    assert p.measured_on.device == "synthetic:h100-80g" and p.measured_on.dtype == "bfloat16"
    assert "130 layers" in capsys.readouterr().out


def test_synth_cli_prints_json_without_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main("synth transformer --layers 2 --hidden 64 --heads 4 --seq 16 --vocab 100 --no-dropout --microbatch-sizes 1,2".split())
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["microbatch_sizes"] == [1, 2]
    fused = DecoderSpec(layers=2, hidden=64, heads=4, seq=16, vocab=100, dropout=False)
    assert data["layers"][1]["activation_bytes"][0] == block_activation_bytes_of(fused, 1, 2)
    # flash attention keeps its float32 log-sum-exp instead of the a·s² probabilities
    materialized = block_activation_bytes(1, 16, 64, 4, 2, dropout=False)
    assert materialized - block_activation_bytes_of(fused, 1, 2) == 4 * 16 * 16 * 2 - 4 * 4 * 16


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ("--layers 0", "--layers must be >= 1, got 0"),
        ("--layers 2 --heads 5", "multiple of --heads 5"),
        ("--layers 2 --device-type tpu", "'tpu'"),
        ("--layers 2 --mfu 2", "--mfu"),
        ("--layers 2 --dtype int4", "int4"),
        ("--layers 2 --microbatch-sizes 1,x", "1,x"),
        ("--layers 2 --ffn 0", "--ffn"),
    ],
)
def test_synth_cli_bad_flags(flags: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = "synth transformer --hidden 64 --heads 4 --seq 16 --vocab 100".split()
    rc = main([*base, *flags.split()])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and needle in err and "Traceback" not in err


def test_measure_module_is_lazily_exposed() -> None:
    assert profiler.profile.__module__ == "profiler.measure"
    assert torch.__version__  # torch is there for the measured side
