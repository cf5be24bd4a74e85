"""Hugging Face decoders profiled with attention as it runs on a GPU (profiler/_hf_attention.py).

A fake ``--hf-config`` profile of a grouped-query decoder keeps what synth's formulas (checked
exactly against transformers' eager Llama, tests/profiler/test_synth_decoders.py) say: no
``b·s²`` causal mask kept or sent across a cut, no K/V repeated to every query head.  The
attention itself computes what transformers' own does; the transformers registries it relies
on are checked at the end, so an upgrade that changes them fails here by name.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from planner.errors import InputError  # noqa: E402
from planner.schema import Profile  # noqa: E402
from profiler import _hf_attention  # noqa: E402
from profiler.fake import fake_profile  # noqa: E402
from profiler.hf_config import hf_entrypoint  # noqa: E402
from profiler.hf_spec import read_config as read_spec_config  # noqa: E402
from profiler.hf_spec import spec_from_config  # noqa: E402
from profiler.synth import synth_decoder  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
SIZES = (1, 2)
BYTE_FIELDS = ("param_bytes", "activation_bytes", "output_bytes", "cut_bytes", "kept_inputs", "operations")


def _config(tmp_path: Any, name: str, **changes: Any) -> str:
    """The shipped config ``name`` with ``changes``, written to its own folder."""
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    folder = os.path.join(str(tmp_path), name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def _fake(path: str, seq: int, sizes: tuple[int, ...] = SIZES) -> Profile:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fake_profile(lambda: hf_entrypoint(path, seq=seq), device_type="h100-80g", microbatch_sizes=sizes)


# --------------------------------------------------------------------------- synth against fake


@pytest.mark.parametrize(
    ("name", "seq", "changes"),
    [
        # Llama 3 8B at its real widths, two blocks
        ("llama3-8b", 512, {"num_hidden_layers": 2}),
        # Mixtral 8x7B: real attention (32 heads over 8 KV heads), narrower experts and vocabulary
        ("mixtral-8x7b", 256, {"num_hidden_layers": 2, "intermediate_size": 1024, "vocab_size": 4096}),
    ],
)
def test_fake_blocks_keep_and_send_what_synth_says(tmp_path: Any, name: str, seq: int, changes: dict[str, Any]) -> None:
    path = _config(tmp_path, name, **changes)
    fake = _fake(path, seq)
    spec = spec_from_config(read_spec_config(path), seq=seq)
    synth = synth_decoder(spec, device_type="h100-80g", microbatch_sizes=SIZES)
    assert fake.metadata["profiler"]["attention"].startswith(_hf_attention.NAME)
    # parameters: exact
    assert sum(x.param_bytes for x in fake.layers) == sum(x.param_bytes for x in synth.layers)
    fake_blocks = [x for x in fake.layers if x.name.startswith("model.layers.")]
    synth_blocks = [x for x in synth.layers if x.name.startswith("blocks.")]
    assert len(fake_blocks) == len(synth_blocks) == spec.layers
    h, d, p = spec.hidden, spec.d, 2
    rotary = 2 * seq * d * p  # cos and sin of every position, shared by the blocks (batch 1)
    for i, (f, s) in enumerate(zip(fake_blocks, synth_blocks, strict=True)):
        assert f.param_bytes == s.param_bytes, (name, i)
        for j, b in enumerate(SIZES):
            # the first block also keeps the rotary cos and sin the blocks share (synth has no such layer)
            kept = f.activation_bytes[j] - (rotary if i == 0 else 0)
            if spec.moe is None:  # dense: exact
                assert kept == s.activation_bytes[j], (name, i, b)
            else:
                # synth counts each routed slot's input and output rows, the expert's inner
                # tensors and routing weight; the stand-in's combine (a sum over each token's
                # slots, as transformers' own) keeps nothing; what differs is the router's top-k
                # indices and weight sums (a few KB)
                assert kept == pytest.approx(s.activation_bytes[j], rel=0.02), (name, i, b)
            # the hidden states (and, but for the last block, the cos and sin): no b·s² mask
            assert f.cut_bytes is not None
            assert f.cut_bytes[j] == b * seq * h * p + (rotary if i < len(fake_blocks) - 1 else 0), (name, i, b)
    # the rotary layer's own output is its cos and sin; the embedding sends the hidden states alone
    assert fake.layers[0].cut_bytes == [b * seq * h * p for b in SIZES]


def test_transformers_own_attention_keeps_the_mask_and_the_repeated_kv(tmp_path: Any) -> None:
    """The comparison can fail: transformers' sdpa under tracing (the path before this module)
    keeps more than synth says and sends the b·s² mask across every cut."""
    path = _config(tmp_path, "llama3-8b", num_hidden_layers=2, hidden_size=512, intermediate_size=1024,
                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)  # fmt: skip
    seq = 256
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        def theirs() -> Any:
            entry = hf_entrypoint(path, seq=seq)
            entry.model.set_attn_implementation("sdpa")
            return entry

        old = fake_profile(theirs, device_type="h100-80g", microbatch_sizes=(1,))
    new = _fake(path, seq, sizes=(1,))
    assert old.metadata["profiler"]["attention"] == "transformers sdpa"
    b, kv, heads, d, p = 1, 2, 8, 64, 2
    extra = 2 * b * seq * (heads - kv) * d * p  # K and V repeated to every query head
    assert old.layers[3].activation_bytes[0] - new.layers[3].activation_bytes[0] >= extra
    assert old.layers[3].cut_bytes is not None and new.layers[3].cut_bytes is not None
    assert old.layers[2].cut_bytes[0] - new.layers[2].cut_bytes[0] >= b * seq * seq  # the mask, one byte per pair


# --------------------------------------------------------------------------- the attention itself


def _tiny_llama(attn: str) -> Any:
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, use_cache=False, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("theirs", ["eager", "sdpa"])
def test_output_and_gradients_equal_transformers_attention(theirs: str) -> None:
    ref = _tiny_llama(theirs)
    _hf_attention.register()
    mine = _tiny_llama(_hf_attention.NAME)
    mine.load_state_dict(ref.state_dict())
    assert mine.config._attn_implementation == _hf_attention.NAME
    ids = torch.randint(0, 100, (3, 40))
    outs = []
    for model in (ref, mine):
        model.train()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append((out.logits.detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}))
    (ref_logits, ref_grads), (logits, grads) = outs
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert set(grads) == set(ref_grads) and len(grads) == len(list(ref.parameters()))
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)
    # a wrong attention (no causal mask) differs: the comparison can fail
    q = k = v = torch.randn(1, 2, 6, 4)
    causal = _hf_attention.causal_sdpa(mine.model.layers[0].self_attn, q, k, v, None)[0]
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert causal.shape == (1, 6, 2, 4) and not torch.allclose(causal, full)


_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
              vocab_size=100, max_position_embeddings=64, use_cache=False)  # fmt: skip
_TYPES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "mixtral": {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "deepseek_v3": {"num_key_value_heads": 8, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1},
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(_TYPES))
def test_every_model_type_that_takes_it_computes_what_transformers_sdpa_does(model_type: str) -> None:
    assert set(_TYPES) == _hf_attention.MODEL_TYPES
    models = []
    for attn in ("sdpa", _hf_attention.NAME):
        cfg = transformers.AutoConfig.for_model(model_type, **{**_SMALL, **_TYPES[model_type]})
        assert _hf_attention.applies(cfg) is None, _hf_attention.applies(cfg)
        if attn == _hf_attention.NAME:
            assert _hf_attention.gpu_attention(cfg)
        else:
            cfg._attn_implementation = attn
        torch.manual_seed(0)
        models.append(transformers.AutoModelForCausalLM.from_config(cfg).float().eval())
    ref, mine = models
    mine.load_state_dict(ref.state_dict())
    assert mine.config._attn_implementation == _hf_attention.NAME
    ids = torch.randint(0, 100, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(mine(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_real_cpu_profile_of_a_config_equals_the_fake_one(tmp_path: Any) -> None:
    """``pipeplan profile --hf-config`` without ``--fake`` runs the same attention, traced on
    real tensors: the same bytes and census as the fake profile."""
    from profiler.measure import profile

    path = _config(tmp_path, "llama3-8b", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    seq = 32
    fake = _fake(path, seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entry = hf_entrypoint(path, seq=seq)
        real = profile(entry.model, entry.example_inputs, microbatch_sizes=list(SIZES), dtype="bfloat16",
                       loss_fn=entry.output_loss(), keywords=entry.keywords, warmup=0, repeats=1, progress=False)  # fmt: skip
    assert real.metadata["profiler"]["attention"] == fake.metadata["profiler"]["attention"]
    assert fake.metadata["profiler"]["attention"].startswith(_hf_attention.NAME)
    assert [x.name for x in fake.layers] == [x.name for x in real.layers]
    for f, r in zip(fake.layers, real.layers, strict=True):
        for field in BYTE_FIELDS:
            assert getattr(f, field) == getattr(r, field), (f.name, field)


# --------------------------------------------------------------------------- which models take it


@pytest.mark.parametrize(
    ("name", "changes", "reason"),
    [
        ("llama3-8b", {}, None),
        ("mixtral-8x7b", {}, None),
        ("qwen3-30b-a3b", {}, None),  # sliding_window null, use_sliding_window false
        ("deepseek-v3", {}, None),
        ("mixtral-8x7b", {"sliding_window": 4096}, "sliding_window 4096"),
        ("gemma2-9b", {}, "model_type 'gemma2'"),  # alternating sliding-window layers, soft-capping
        ("bert-base-uncased", {}, "model_type 'bert'"),
        ("t5-small", {}, "model_type 't5'"),
    ],
)
def test_only_causal_decoders_over_the_whole_sequence_take_it(name: str, changes: dict[str, Any], reason: str | None) -> None:
    from profiler.hf_config import read_config

    config = read_config(os.path.join(CONFIGS, name), **changes)
    why = _hf_attention.applies(config)
    assert (why is None) if reason is None else (why is not None and why.startswith(reason)), why
    before = config._attn_implementation
    assert _hf_attention.gpu_attention(config) is (reason is None)
    assert config._attn_implementation == (_hf_attention.NAME if reason is None else before)


def test_qwen2_without_its_sliding_window_takes_it_and_mistral_v01_keeps_the_mask() -> None:
    qwen2 = transformers.Qwen2Config(use_sliding_window=False, sliding_window=4096)
    assert _hf_attention.applies(qwen2) is None
    windowed = transformers.Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=0)
    assert _hf_attention.applies(windowed) is not None
    assert _hf_attention.applies(transformers.MistralConfig(sliding_window=4096)) == "sliding_window 4096"


def test_gemma2_keeps_transformers_attention_in_a_fake_profile(tmp_path: Any) -> None:
    path = _config(tmp_path, "gemma2-9b", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                   vocab_size=256, sliding_window=8)  # fmt: skip
    prof = _fake(path, 32, sizes=(1,))
    assert not prof.metadata["profiler"]["attention"].startswith(_hf_attention.NAME)


def test_a_mask_or_a_window_passed_to_it_is_refused() -> None:
    module = torch.nn.Linear(1, 1)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(InputError, match=r"Linear passed an attention mask .*attn_implementation='sdpa'"):
        _hf_attention.causal_sdpa(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(InputError, match="passed a sliding window"):
        _hf_attention.causal_sdpa(module, q, q, q, None, sliding_window=2)
    with pytest.raises(InputError, match="use_cache=False"):
        _hf_attention.causal_sdpa(module, q[:, :, :1], q, q, None)


# --------------------------------------------------------------------------- transformers internals


def test_transformers_registries_are_what_the_gpu_attention_relies_on() -> None:
    """profiler/_hf_attention.py: the transformers names and behaviour it uses.  A failure here
    means transformers changed its attention or mask registries: update _hf_attention.py."""
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
        create_causal_mask,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert callable(getattr(AttentionInterface, "register", None)), "AttentionInterface.register"
    _hf_attention.register()
    _hf_attention.register()  # idempotent
    assert ALL_ATTENTION_FUNCTIONS.get_interface(_hf_attention.NAME, None) is _hf_attention.causal_sdpa
    # no mask function under the name: transformers' mask builders then build none
    assert _hf_attention.NAME not in AttentionMaskInterface._global_mapping
    assert _hf_attention.NAME not in ALL_MASK_ATTENTION_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    cfg._attn_implementation = _hf_attention.NAME
    embeds = torch.zeros(2, 8, 16)
    positions = torch.arange(8).unsqueeze(0)
    with torch.no_grad():
        assert create_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=None, cache=None,
                                  position_ids=positions) is None, "create_causal_mask built a mask for NAME"  # fmt: skip
    # the attention call of a decoder layer: (module, q, k, v, mask, dropout=, scaling=, ...)
    import inspect

    from transformers.models.llama import modeling_llama

    source = inspect.getsource(modeling_llama.LlamaAttention.forward)
    assert "ALL_ATTENTION_FUNCTIONS.get_interface" in source and "scaling=self.scaling" in source
    assert "dropout=" in source


def test_latent_attention_pads_the_values_to_the_query_width_and_computes_the_same() -> None:
    """DeepSeek-V3's query/key heads are wider than its value heads: V is zero-padded for the
    fused kernel and the output cut back (else CPU SDPA's math path: fp32 and s^2 scores)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 24, requires_grad=True), torch.randn(2, 4, 16, 24, requires_grad=True)
    v = torch.randn(2, 4, 16, 16, requires_grad=True)
    out, _ = _hf_attention.causal_sdpa(torch.nn.Module(), q, k, v, None, scaling=0.2)
    scores = (q @ k.transpose(-1, -2) * 0.2).masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(1, 2)
    assert out.shape == (2, 16, 4, 16)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert v.grad is not None and v.grad.shape == v.shape
