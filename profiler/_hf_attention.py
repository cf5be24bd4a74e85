"""Causal attention of Hugging Face decoders as it runs on a GPU (the one place that relies on
transformers' attention and mask registries; ``tests/profiler/test_hf_attention.py`` checks them,
so a transformers upgrade that renames one fails there with its name).

Traced (``torch.export``, which the profiler's capture uses), transformers' own attention does
not run as in training on a GPU: its ``is_causal`` shortcut is off while tracing, so it builds a
4-D ``b·s²`` causal mask, passes it across every cut between blocks and into
``scaled_dot_product_attention`` with ``attn_mask``, which then repeats K and V to every query
head (``repeat_kv``) -- and the mask and the repeated K/V are kept for backward.  On a GPU (flash
attention, SDPA with ``is_causal=True`` and ``enable_gqa``), in Megatron-LM and torchtitan,
neither exists.

:func:`gpu_attention` gives a model's config this module's attention instead: the attention
function :func:`causal_sdpa` (``scaled_dot_product_attention(q, k, v, is_causal=True,
scale=..., enable_gqa=True)``) registered with transformers' ``AttentionInterface`` under
:data:`NAME`.  The name is deliberately *not* registered with ``AttentionMaskInterface``: for an
attention implementation without a mask function transformers' mask builders
(``masking_utils.create_causal_mask`` and the others, through ``_preprocess_mask_arguments``)
return ``None`` before doing anything -- no mask is built, none crosses a cut, and not even the
packed-sequence detection (a ``diff``/``cumsum`` of the position ids) that a registered mask
function, even one returning ``None``, would leave in the embedding's graph.  Only decoder-only
causal LMs whose every layer attends causally to the whole sequence take it (:func:`applies`);
sliding windows (Gemma 2, Mistral v0.1), logit soft-capping, encoders and encoder-decoders keep
transformers' attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from planner.errors import InputError

#: the name under which :func:`causal_sdpa` is registered (``config._attn_implementation``)
NAME = "pipeplan_causal_sdpa"

#: what ``metadata.profiler.attention`` says about :data:`NAME`
DESCRIPTION = "scaled_dot_product_attention(is_causal=True, enable_gqa=True): no mask, K/V not repeated"

#: model types checked to run :func:`causal_sdpa` exactly (tests/profiler/test_hf_attention.py)
MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3"})


def applies(config: Any) -> str | None:
    """Why ``config`` keeps transformers' attention, or ``None`` when it takes :func:`causal_sdpa`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(sorted(MODEL_TYPES))}"
    if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
        return "not a causal decoder"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"sliding_window {window}"
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"layer_types {sorted(kinds)}"
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"attn_logit_softcapping {softcap}"
    return None


def gpu_attention(config: Any) -> bool:
    """Give ``config`` (before the model is built from it) :func:`causal_sdpa` when it
    :func:`applies`; whether it did (else the config keeps its own attention).

    Registers :data:`NAME` with transformers' attention registry here, not at import (the
    project keeps no module-level state of its own; transformers' registry is process-wide):
    registering again puts the same function under the same name, so calling this any number
    of times is harmless.
    """
    if applies(config) is not None:
        return False
    register()
    config._attn_implementation = NAME
    return True


def register() -> None:
    """Register :func:`causal_sdpa` under :data:`NAME` with transformers' ``AttentionInterface``
    (idempotent; no mask function, module doc)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, causal_sdpa)


def causal_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention of ``query`` ``(b, heads, s, d)`` over ``key``/``value`` ``(b, kv_heads,
    s, d)``, grouped-query natively; returns ``((b, s, heads, d_v), None)`` as transformers'
    attention functions do."""
    for what, value_given in (
        ("an attention mask", attention_mask),
        ("a sliding window", kwargs.get("sliding_window")),
        ("logit soft-capping", kwargs.get("softcap")),
        ("a position bias", kwargs.get("position_bias")),
        ("attention sinks", kwargs.get("s_aux")),
    ):
        if value_given is not None:
            raise InputError(
                f"{type(module).__name__} passed {what} to pipeplan's causal attention ({NAME}), which "
                "has none: this architecture does not attend causally over the whole sequence -- "
                "profile it with --model path/to/file.py:FUNC building it with attn_implementation='sdpa' "
                "(profiler/_hf_attention.py lists the model types that take it)"
            )
    if query.shape[2] != key.shape[2]:
        raise InputError(
            f"{type(module).__name__}: {query.shape[2]} queries over {key.shape[2]} keys -- pipeplan's "
            f"causal attention ({NAME}) profiles training without a cache (use_cache=False)"
        )
    d_v = value.shape[-1]
    if d_v < query.shape[-1]:
        # multi-head latent attention (DeepSeek-V3: query/key 192 wide, value 128): the fused
        # kernels take one head width, so V is zero-padded to it and the output cut back, as
        # transformers does for flash_attention_2 (modeling_deepseek_v3.py) -- else the CPU
        # kernel falls back to the math path, which upcasts to fp32 and materialises s^2 scores
        value = F.pad(value, [0, query.shape[-1] - d_v])
    out = F.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True
    )
    return out[..., :d_v].transpose(1, 2).contiguous(), None


def attention_metadata(model: Any) -> dict[str, str]:
    """``{"attention": ...}`` for a profile's ``metadata.profiler``: the attention implementation
    of a transformers model's config (:data:`NAME` with :data:`DESCRIPTION`, or ``transformers
    <name>``); nothing for a model without one."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not isinstance(name, str):
        return {}
    return {"attention": f"{NAME}: {DESCRIPTION}" if name == NAME else f"transformers {name}"}


__all__ = ["DESCRIPTION", "MODEL_TYPES", "NAME", "applies", "attention_metadata", "causal_sdpa", "gpu_attention", "register"]
