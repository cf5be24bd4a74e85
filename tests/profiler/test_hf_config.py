"""``pipeplan profile --fake --hf-config``: models built from config.json (profiler/hf_config.py),
mixture-of-experts layers under balanced routing (profiler/_moe_balanced.py).

The shipped configs (examples/configs) are profiled shrunk (same architecture and options,
tiny widths) so that each test takes seconds; the full-size Llama 3 configs are built on fake
tensors to check their parameter counts against the published ones.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from planner.errors import InputError
from planner.schema import Profile
from profiler import _moe_balanced, _torch_fake
from profiler.fake import fake_profile
from profiler.hf_config import hf_entrypoint

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
SEQ = 32

#: each shipped config's widths shrunk (everything else as published)
SMALL: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256),
    "mixtral-8x7b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, num_local_experts=4),
    "qwen3-30b-a3b": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=8,
                          num_experts_per_tok=2),
    "deepseek-v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
    "gemma2-9b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=256, sliding_window=8),
    "bert-base-uncased": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              vocab_size=256),
    "t5-small": dict(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=256),
}  # fmt: skip


def _shrunk(tmp_path: Any, name: str, **more: Any) -> str:
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(SMALL[name], **more)
    folder = os.path.join(str(tmp_path), name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def _profile(path: str, *, sizes: tuple[int, ...] = (1, 2), **kw: Any) -> Profile:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fake_profile(lambda: hf_entrypoint(path, seq=SEQ), device_type="h100-80g", microbatch_sizes=sizes, **kw)


def test_every_shipped_config_is_read_by_transformers() -> None:
    from profiler.hf_config import model_class, read_config

    names = sorted(os.listdir(CONFIGS))
    assert set(SMALL) <= set(names) and "llama3.1-405b" in names
    classes = {}
    for name in names:
        if os.path.isdir(os.path.join(CONFIGS, name)):
            classes[name] = model_class(read_config(os.path.join(CONFIGS, name))).__name__
    assert classes["bert-base-uncased"] == "BertForMaskedLM"
    assert classes["t5-small"] == "T5ForConditionalGeneration"
    assert classes["deepseek-v3"] == "DeepseekV3ForCausalLM"
    assert classes["llama3-70b"] == "LlamaForCausalLM"


def test_llama_from_its_config_through_the_cli(tmp_path: Any) -> None:
    from pipeplan.cli import main

    out = os.path.join(str(tmp_path), "llama.json")
    rc = main(["profile", "--fake", "--device-type", "h100-80g", "--hf-config", _shrunk(tmp_path, "llama3-8b"),
               "--seq", str(SEQ), "--microbatch-sizes", "1,2", "-q", "-o", out])  # fmt: skip
    assert rc == 0
    with open(out) as f:
        prof = Profile.model_validate_json(f.read())
    assert prof.model == "llama3-8b"
    assert prof.measured_on.device == "fake:h100-80g" and prof.measured_on.dtype == "bfloat16"
    assert [x.name for x in prof.layers] == [
        "model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head",
    ]  # fmt: skip
    assert prof.input_bytes == [SEQ * 8, 2 * SEQ * 8]  # input_ids only: the labels go to the loss
    assert prof.layers[0].param_bytes == 256 * 64 * 2
    assert all(x.moe is None for x in prof.layers)
    assert all(x.forward_ms[1] > 0 for x in prof.layers if x.param_bytes)
    # the causal LM loss is in the last layer's census (its log-softmax over the vocabulary)
    assert prof.layers[-1].activation_bytes[0] > SEQ * 256 * 2


@pytest.mark.parametrize(
    ("name", "experts", "top_k", "shared", "moe_layers"),
    [
        ("mixtral-8x7b", 4, 2, 0, [0, 1]),
        ("qwen3-30b-a3b", 8, 2, 0, [0, 1]),
        ("deepseek-v3", 8, 2, 1, [1, 2]),  # the first layer stays dense (first_k_dense_replace)
    ],
)
def test_moe_layers_carry_their_experts_under_balanced_routing(
    tmp_path: Any, name: str, experts: int, top_k: int, shared: int, moe_layers: list[int]
) -> None:
    prof = _profile(_shrunk(tmp_path, name))
    hidden = 64
    blocks = [x for x in prof.layers if x.name.startswith("model.layers.")]
    assert [i for i, x in enumerate(blocks) if x.moe is not None] == moe_layers
    for layer in blocks:
        if layer.moe is None:
            assert not any(op.expert for ops in layer.operations or [] for op in ops)
            continue
        moe = layer.moe
        assert (moe.experts, moe.top_k, moe.shared_experts, moe.routing) == (experts, top_k, shared, "balanced")
        assert 0 < moe.expert_param_bytes < layer.param_bytes
        assert layer.operations is not None
        for b, ops in zip(prof.microbatch_sizes, layer.operations, strict=True):
            tokens = b * SEQ
            expert_gemms = [op for op in ops if op.expert]
            assert len(expert_gemms) == 2  # gate-and-up, down
            for op in expert_gemms:
                assert op.kind == "gemm" and op.count == experts and op.batch == 1
                assert op.m == tokens * top_k // experts
            # the router's GEMM sees every token, and is no expert's
            assert any(op.kind == "gemm" and op.m == tokens and op.n == experts and not op.expert for op in ops)
        assert moe.dispatch_bytes == [b * SEQ * top_k * hidden * 2 for b in prof.microbatch_sizes]
    assert prof.metadata["profiler"]["moe"]["routing"] == "balanced"


def test_capacity_factor_gives_each_expert_that_many_more_tokens(tmp_path: Any) -> None:
    prof = _profile(_shrunk(tmp_path, "mixtral-8x7b"), sizes=(1,), capacity_factor=1.25)
    layer = prof.layers[2]
    assert layer.moe is not None and layer.moe.routing == "capacity" and layer.moe.capacity_factor == 1.25
    per_expert = math.ceil(1.25 * SEQ * 2 / 4)
    assert {op.m for op in layer.operations[0] if op.expert} == {per_expert}
    assert layer.moe.dispatch_bytes == [per_expert * 4 * 64 * 2]
    balanced = _profile(_shrunk(tmp_path, "mixtral-8x7b"), sizes=(1,)).layers[2]
    def expert_flops(x: Any) -> int:
        return sum(2 * op.m * op.n * op.k * op.count for op in x.operations[0] if op.expert)

    assert expert_flops(layer) * 16 == expert_flops(balanced) * 20  # 20 tokens per expert instead of 16
    assert layer.activation_bytes[0] > balanced.activation_bytes[0]


@pytest.mark.parametrize("name", ["gemma2-9b", "bert-base-uncased", "t5-small"])
def test_other_architectures_profile_from_their_configs(tmp_path: Any, name: str) -> None:
    prof = _profile(_shrunk(tmp_path, name), sizes=(1,))
    names = [x.name for x in prof.layers]
    blocks = {
        "gemma2-9b": ["model.layers.0", "model.layers.1"],
        "bert-base-uncased": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
        "t5-small": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    }[name]
    assert all(b in names for b in blocks)
    if name == "t5-small":  # encoder and decoder inputs
        assert prof.input_bytes == [2 * SEQ * 8]
    assert all(x.operations and x.operations[0] for x in prof.layers if x.param_bytes)


@pytest.mark.parametrize(("name", "published"), [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9)])
def test_shipped_llama3_configs_have_the_published_parameter_count_without_allocating(name: str, published: float) -> None:
    from profiler.fake import _cast

    before = _rss()
    with _torch_fake.fake_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entry = hf_entrypoint(os.path.join(CONFIGS, name), seq=8192)
        model = _cast(entry.model, torch.bfloat16)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert all(_torch_fake.is_fake(p) for p in model.parameters())
    assert param_bytes == pytest.approx(published * 2, rel=0.005)
    assert _rss() - before < 1 << 30  # 141 GB of bf16 weights, none of them allocated


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_unknown_model_type_names_it_and_suggests_a_builder(tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "config.json")
    with open(path, "w") as f:
        json.dump({"model_type": "my-own-llm", "hidden_size": 64}, f)
    with pytest.raises(InputError) as info:
        _profile(path)
    text = str(info.value)
    assert "model_type 'my-own-llm'" in text and "--model path/to/file.py:FUNC" in text
    with open(path, "w") as f:
        json.dump({"hidden_size": 64}, f)
    with pytest.raises(InputError, match="has no model_type"):
        _profile(str(tmp_path))
    with pytest.raises(InputError, match="no such file"):
        _profile(os.path.join(str(tmp_path), "missing"))


def test_seq_longer_than_the_config_allows_is_refused(tmp_path: Any) -> None:
    with pytest.raises(InputError, match=r"--seq 32 is longer than the config's max_position_embeddings 16"):
        _profile(_shrunk(tmp_path, "llama3-8b", max_position_embeddings=16))


# --------------------------------------------------------------------------- transformers internals


def test_transformers_experts_modules_are_what_the_balanced_stand_in_relies_on() -> None:
    """profiler/_moe_balanced.py: the transformers names and attributes it uses.  A failure here
    means transformers changed its experts modules: update _moe_balanced.py."""
    from transformers.integrations import moe as hf_moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Experts,
        DeepseekV3MoE,
    )
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeExperts,
        Qwen3MoeSparseMoeBlock,
    )

    assert hasattr(hf_moe, "use_experts_implementation"), _moe_balanced.EXPERTS_DECORATOR
    for cls in (MixtralExperts, Qwen3MoeExperts, DeepseekV3Experts):
        assert hasattr(cls.forward, "__wrapped__"), f"{cls.__name__}.forward is no longer use_experts_implementation's"
        assert list(__import__("inspect").signature(cls.forward.__wrapped__).parameters)[1:] == [
            "hidden_states", "top_k_index", "top_k_weights",
        ], cls.__name__  # fmt: skip
        assert hasattr(cls, "_apply_gate"), cls.__name__
    assert hasattr(DeepseekV3MoE, "__init__") and hasattr(MixtralSparseMoeBlock, "__init__") and Qwen3MoeSparseMoeBlock
    from transformers import MixtralConfig

    cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    experts = MixtralExperts(cfg)
    assert _moe_balanced.is_experts_module(experts)
    assert experts.gate_up_proj.shape == (4, 48, 16) and experts.down_proj.shape == (4, 16, 24)
    assert experts.num_experts == 4 and experts.is_transposed is False and experts.config is cfg
    assert not _moe_balanced.is_experts_module(torch.nn.Linear(4, 4))


def test_balanced_stand_in_sends_every_expert_its_share_on_real_tensors() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(cfg)
    torch.nn.init.normal_(block.experts.gate_up_proj)
    torch.nn.init.normal_(block.experts.down_proj)
    installed = _moe_balanced.install(block)
    assert [(x.name, x.experts, x.top_k, x.hidden) for x in installed] == [("experts", 4, 2, 16)]
    assert installed[0].gemm_dims == {(48, 16), (16, 24)}
    x = torch.randn(2, 6, 16)
    y = block(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.sum().backward()
    grad = block.experts.gate_up_proj.grad
    assert grad is not None and all(grad[e].abs().sum() > 0 for e in range(4))  # every expert got tokens
