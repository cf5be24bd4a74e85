"""A Hugging Face ``config.json`` read as a :class:`~profiler.decoder.DecoderSpec`, without torch.

``pipeplan synth transformer --hf-config PATH`` uses it on machines without torch or
transformers: the decoders whose blocks the formulas of :mod:`profiler.decoder` describe exactly
(parameters exact, activations as transformers' implementation keeps them under flash or SDPA
attention).  Other architectures (multi-head latent attention, sandwich norms, sliding windows)
are refused with the command that profiles them from the same config on fake tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.errors import InputError
from profiler.decoder import DecoderSpec, MoESpec

#: model_type -> the family of formulas; the others go through ``pipeplan profile --fake``
SUPPORTED = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
_MAX_CONFIG_BYTES = 1 << 20


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON of ``path`` (a ``config.json`` or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise InputError(f"--hf-config {str(path)!r}: no such file (give a config.json or a folder holding one)")
    if p.stat().st_size > _MAX_CONFIG_BYTES:
        raise InputError(f"--hf-config {str(p)!r} is {p.stat().st_size} bytes: a model config is a few KiB; "
                         "is this the right file?")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"--hf-config {str(p)!r} is not JSON ({err}): give the model's config.json") from None
    if not isinstance(data, dict):
        raise InputError(f"--hf-config {str(p)!r} holds a {type(data).__name__}, not a config object")
    return data


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"config field {key!r} must be an integer, got {value!r}")
    return value


def spec_from_config(cfg: Mapping[str, Any], *, seq: int, name: str | None = None) -> DecoderSpec:
    """The decoder a Hugging Face config describes, trained on sequences of ``seq`` tokens."""
    kind = cfg.get("model_type")
    if kind not in SUPPORTED:
        raise InputError(
            f"synth does not know model_type {kind!r} (it writes {', '.join(SUPPORTED)}): profile it from the "
            "same config on fake tensors with `pipeplan profile --fake --hf-config PATH` (needs torch and "
            "transformers)"
        )
    label = name or str(cfg.get("_name_or_path") or kind)
    if kind == "gpt2":
        h = _int(cfg, "n_embd")
        return DecoderSpec(layers=_int(cfg, "n_layer"), hidden=h, heads=_int(cfg, "n_head"), seq=seq,
                           vocab=_int(cfg, "vocab_size"), ffn=cfg.get("n_inner") or 4 * h,
                           tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                           dropout=float(cfg.get("resid_pdrop", 0.1)) > 0, name=label)
    heads = _int(cfg, "num_attention_heads")
    h = _int(cfg, "hidden_size")
    moe = None
    if kind == "mixtral":
        moe = MoESpec(experts=_int(cfg, "num_local_experts"), top_k=_int(cfg, "num_experts_per_tok"),
                      expert_ffn=_int(cfg, "intermediate_size"))
    elif kind == "qwen3_moe":
        sparse = _int(cfg, "decoder_sparse_step", 1)
        dense_only = cfg.get("mlp_only_layers") or []
        layers = _int(cfg, "num_hidden_layers")
        moe_blocks = [i for i in range(layers) if i not in dense_only and sparse > 0 and (i + 1) % sparse == 0]
        first = min(moe_blocks) if moe_blocks else layers
        if moe_blocks != list(range(first, layers)):
            raise InputError(
                f"model_type qwen3_moe with decoder_sparse_step {sparse} and mlp_only_layers {dense_only}: "
                "synth writes dense first blocks then experts only; profile it with `pipeplan profile --fake`"
            )
        experts = "num_experts" if "num_experts" in cfg else "num_local_experts"  # transformers 5 renamed it
        moe = MoESpec(experts=_int(cfg, experts), top_k=_int(cfg, "num_experts_per_tok"),
                      expert_ffn=_int(cfg, "moe_intermediate_size"), dense_layers=first)
    return DecoderSpec(
        layers=_int(cfg, "num_hidden_layers"),
        hidden=h,
        heads=heads,
        seq=seq,
        vocab=_int(cfg, "vocab_size"),
        ffn=_int(cfg, "intermediate_size"),
        kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") if isinstance(cfg.get("head_dim"), int) else None,
        gated_mlp=True,
        norm="rmsnorm",
        bias=bool(cfg.get("mlp_bias", False)) and bool(cfg.get("attention_bias", False)),
        qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        positions="rotary",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dropout=False,  # these families have no residual dropout (attention_dropout is 0 in training)
        moe=moe,
        name=label,
    )
