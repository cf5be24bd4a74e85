"""synth's decoders against transformers' own: Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE built
from small configs on CPU, their config.json read by synth without torch (``profiler.hf_spec``).

Parameters must be exact; what each block keeps for backward (saved-tensor hooks, each storage
once, parameters apart, eager attention through SDPA as on a GPU) equal for dense blocks and
within 2 % for mixtures of experts (their routing is the random model's, synth's balanced)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeplan.cli import main  # noqa: E402
from planner.errors import InputError  # noqa: E402
from planner.schema import load_document  # noqa: E402
from profiler.decoder import (  # noqa: E402
    DecoderSpec,
    MoESpec,
    block_activation_bytes_of,
    total_param_count,
)
from profiler.hf_spec import read_config, spec_from_config  # noqa: E402
from profiler.synth import synth_decoder  # noqa: E402

SEQ, BATCH = 64, 2
_COMMON: dict[str, Any] = {
    "num_hidden_layers": 3, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 8,
    "num_key_value_heads": 2, "vocab_size": 500, "max_position_embeddings": SEQ, "use_cache": False,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "tie_word_embeddings": False},
    "qwen2": {**_COMMON, "tie_word_embeddings": True},
    "qwen3": {**_COMMON, "head_dim": 32, "tie_word_embeddings": False},
    "mixtral": {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**_COMMON, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                  "mlp_only_layers": [0], "decoder_sparse_step": 1, "head_dim": 16},
}


def _model(kind: str) -> tuple[Any, Path]:
    cfg = transformers.AutoConfig.for_model(kind, **CONFIGS[kind])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16), cfg


def _kept_per_block(model: Any) -> list[int]:
    """Bytes each decoder block saves for backward (storages once, parameters apart)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    kept = [0 for _ in model.model.layers]
    current = {"block": -1}
    hooks = [block.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__("block", i))
             for i, block in enumerate(model.model.layers)]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda _m, _a: current.__setitem__("block", -1)))

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen and current["block"] >= 0:
            seen.add(st.data_ptr())
            kept[current["block"]] += st.nbytes()
        return t

    ids = torch.randint(0, CONFIGS["llama"]["vocab_size"], (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    return kept


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_synth_matches_transformers(kind: str, tmp_path: Path) -> None:
    model, cfg = _model(kind)
    cfg.to_json_file(str(tmp_path / "config.json"), use_diff=False)
    spec = spec_from_config(read_config(tmp_path), seq=SEQ)  # the torch-free reading
    # parameters: exact (tied tables once)
    assert total_param_count(spec) == sum(p.numel() for p in model.parameters()), kind
    kept = _kept_per_block(model)
    for i, measured in enumerate(kept):
        predicted = block_activation_bytes_of(spec, BATCH, 2, moe=spec.is_moe_block(i))
        if i == 0:  # the first block also saves the rotary cos and sin every block shares
            predicted += 2 * SEQ * spec.d * 2
        if spec.is_moe_block(i):
            assert measured == pytest.approx(predicted, rel=0.02), (kind, i, measured, predicted)
        else:
            assert measured == predicted, (kind, i, measured, predicted)


def test_the_comparison_can_fail() -> None:
    """Reading Llama without grouped-query attention predicts more than it keeps."""
    model, cfg = _model("llama")
    wrong = spec_from_config({**cfg.to_dict(), "num_key_value_heads": 8}, seq=SEQ)
    assert block_activation_bytes_of(wrong, BATCH, 2) != _kept_per_block(model)[1]
    assert total_param_count(wrong) != sum(p.numel() for p in model.parameters())


def _llama_8b_config(path: Path) -> Path:
    """Llama 3 8B's published hyperparameters (Meta, model card of Meta-Llama-3-8B)."""
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "tie_word_embeddings": False,
           "max_position_embeddings": 8192, "rope_theta": 500000.0}
    path.write_text(json.dumps(cfg))
    return path


def test_llama3_8b_parameters_and_the_cli(tmp_path: Path) -> None:
    cfg = _llama_8b_config(tmp_path / "config.json")
    out = tmp_path / "llama.json"
    assert main(["synth", "transformer", "--hf-config", str(tmp_path), "--seq", "8192", "-q", "-o", str(out)]) == 0
    prof = load_document("profile", str(out))
    params = sum(layer.param_bytes for layer in prof.layers) / 2
    assert params == pytest.approx(8.03e9, rel=0.005)  # "8B": 8,030,261,248 parameters
    assert prof.metadata["synth"]["kv_heads"] == 8 and prof.measured_on.pricing.startswith("device model h100-80g")
    # the GPT-3-layout reading (--ffn 14336, MHA, two matrices) undercounts a block by ~15 %
    gpt_style = DecoderSpec(layers=32, hidden=4096, ffn=14336, heads=32, seq=8192, vocab=128256)
    llama = spec_from_config(read_config(cfg), seq=8192)
    from profiler.decoder import block_param_count

    assert block_param_count(gpt_style) / block_param_count(llama) == pytest.approx(0.85, abs=0.02)


def test_moe_profile_marks_its_experts() -> None:
    spec = DecoderSpec(layers=4, hidden=256, heads=8, kv_heads=2, seq=128, vocab=1000, ffn=512, gated_mlp=True,
                       norm="rmsnorm", bias=False, positions="rotary", dropout=False,
                       moe=MoESpec(experts=8, top_k=2, expert_ffn=128, shared_experts=1, dense_layers=1))
    prof = synth_decoder(spec, device_type="a100-80g", microbatch_sizes=(1, 2))
    blocks = prof.layers[1:-1]
    assert blocks[0].moe is None and all(b.moe is not None for b in blocks[1:])
    moe = blocks[1].moe
    assert moe is not None and moe.experts == 8 and moe.top_k == 2 and moe.shared_experts == 1
    assert moe.expert_param_bytes == 8 * 3 * 256 * 128 * 2
    assert moe.dispatch_bytes == [b * 128 * 2 * 256 * 2 for b in (1, 2)]
    experts = [op for op in blocks[1].operations[0] if op.expert]
    # gate and up (8 experts each), the activation, down; 128 tokens x 2 / 8 experts = 32 rows each
    assert [(op.kind, op.m, op.count) for op in experts if op.kind == "gemm"] == [("gemm", 32, 16), ("gemm", 32, 8)]
    assert sum(layer.param_bytes for layer in prof.layers) == total_param_count(spec) * 2
    # a capacity factor pads every expert's share
    padded = synth_decoder(DecoderSpec(**{**spec.__dict__, "moe": MoESpec(
        experts=8, top_k=2, expert_ffn=128, shared_experts=1, dense_layers=1, capacity_factor=4.0)}),
        device_type="a100-80g", microbatch_sizes=(1,))
    assert padded.layers[2].moe.routing == "capacity"  # type: ignore[union-attr]
    assert padded.layers[2].activation_bytes[0] > prof.layers[2].activation_bytes[0]
    assert padded.layers[2].flops[0] > prof.layers[2].flops[0]  # type: ignore[index]
    assert padded.layers[2].forward_ms[0] >= prof.layers[2].forward_ms[0]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"kv_heads": 3}, "--kv-heads 3 must divide --heads 8"),
        ({"hidden": 100}, "--hidden 100 must be a multiple of --heads 8 (or give --head-dim)"),
        ({"moe": MoESpec(experts=4, top_k=2, expert_ffn=8, dense_layers=9)}, "--dense-layers 9 is more than --layers 2"),
    ],
)
def test_bad_specs_are_refused(kw: dict[str, Any], needle: str) -> None:
    base: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 8, "seq": 16, "vocab": 100}
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        DecoderSpec(**{**base, **kw})
    with pytest.raises(ValueError, match="--top-k 5 is more than --experts 4"):
        MoESpec(experts=4, top_k=5, expert_ffn=8)


def test_unknown_model_types_name_the_fake_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 7168}))
    with pytest.raises(InputError, match="model_type 'deepseek_v3'.*pipeplan profile --fake --hf-config"):
        spec_from_config(read_config(tmp_path), seq=128)
    assert main(["synth", "transformer", "--hf-config", str(tmp_path), "--seq", "128"]) != 0
    assert "deepseek_v3" in capsys.readouterr().err
    assert main(["synth", "transformer", "--hf-config", str(tmp_path / "missing"), "--seq", "8"]) != 0
    assert "no such file" in capsys.readouterr().err
    assert main(["synth", "transformer", "--hf-config", str(tmp_path), "--seq", "8", "--layers", "2"]) != 0
    assert "drop --layers" in capsys.readouterr().err


def test_moe_flags_from_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    argv = ("synth transformer --layers 4 --hidden 256 --heads 8 --kv-heads 2 --ffn 512 --seq 128 --vocab 1000 "
            "--gated-mlp --norm rmsnorm --no-bias --positions rotary --no-dropout --top-k 2 "
            "--expert-ffn 128 --dense-layers 1 --microbatch-sizes 1,2 -q").split()
    assert main([*argv, "--experts", "8", "-o", str(out)]) == 0
    prof = load_document("profile", str(out))
    assert [layer.moe is not None for layer in prof.layers] == [False, False, True, True, True, False]
    assert prof.metadata["synth"]["moe"]["experts"] == 8
    assert main([*argv, "--experts", "0", "-o", str(out)]) != 0  # --experts must be >= 1
    assert main([*argv, "-o", str(out)]) != 0  # --expert-ffn without --experts
