"""Build a Hugging Face model from its ``config.json`` (``pipeplan profile --hf-config PATH``).

Nothing is downloaded: the config is read from a local file (or a folder holding
``config.json``), ``transformers.AutoConfig.for_model`` makes the config object, and the model
is built from it with randomly initialised weights -- under fake tensors with ``--fake``
(:mod:`profiler.fake`: a 405B model allocates nothing), for real otherwise.  Which class:

* the config's ``architectures`` names one of transformers' ``...ForCausalLM`` /
  ``...LMHeadModel``, ``...ForMaskedLM`` or ``...ForConditionalGeneration`` classes: that class;
* else an encoder-decoder (``is_encoder_decoder``, T5) through ``AutoModelForSeq2SeqLM``, an
  encoder that has a masked-LM head and no causal one through ``AutoModelForMaskedLM`` (BERT),
  everything else through ``AutoModelForCausalLM`` (Llama, Mixtral, Qwen3-MoE, DeepSeek-V3,
  Gemma 2).

It trains on ``input_ids`` of ``seq`` tokens (and ``decoder_input_ids`` of ``seq`` tokens for an
encoder-decoder) with the language-model loss against labels: a causal LM predicts the next
token (logits of positions ``0..s-2`` against the labels of ``1..s-1``), a masked LM and a
sequence-to-sequence model every position.  The labels are the loss's targets (they reach the
last stage, not every cut).  ``use_cache`` is off (training).

A causal decoder whose every layer attends causally to the whole sequence (Llama, Mistral and
Mixtral without a sliding window, Qwen2/3, Qwen3-MoE, DeepSeek-V3) attends as on a GPU
(:mod:`profiler._hf_attention`: ``scaled_dot_product_attention(is_causal=True,
enable_gqa=True)``, no mask built or sent across cuts, K/V not repeated to every query head);
the others (Gemma 2's sliding-window layers, encoders, encoder-decoders) keep transformers'
attention.  ``metadata.profiler.attention`` says which.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from planner.errors import InputError
from profiler import _hf_attention
from profiler.loading import Entrypoint

#: the class families, by suffix of the config's ``architectures`` entry
_CAUSAL = ("ForCausalLM", "LMHeadModel")
_MASKED = ("ForMaskedLM",)
_SEQ2SEQ = ("ForConditionalGeneration", "ForSeq2SeqLM")


def config_path(path: str) -> str:
    """The ``config.json`` that ``path`` names (the file itself, or the one in a folder)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise InputError(
            f"--hf-config {path!r}: no such file; give a config.json or a folder holding one "
            "(e.g. examples/configs/llama3-8b)"
        )
    return path


def read_config(path: str, **overrides: Any) -> Any:
    """The transformers config of ``path`` (a ``config.json`` or its folder), with ``overrides``."""
    file = config_path(path)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"--hf-config {file!r} is not a readable JSON file: {err}") from None
    if not isinstance(data, dict):
        raise InputError(f"--hf-config {file!r} holds a {type(data).__name__}, not a config object")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InputError(
            f"--hf-config {file!r} has no model_type: a Hugging Face config.json names its architecture "
            "in model_type (e.g. \"llama\"); add it, or build the model yourself and profile it with "
            "--model path/to/file.py:FUNC"
        )
    import transformers
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if k not in ("model_type", "auto_map", "transformers_version")}
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as err:
        if "model_type" not in str(err) and "Unrecognized" not in str(err):
            raise InputError(f"--hf-config {file!r}: transformers cannot read it: {err}") from None
        raise InputError(
            f"--hf-config {file!r}: model_type {model_type!r} is not an architecture transformers "
            f"{transformers.__version__} knows -- write a function that builds the model and returns "
            "(model, example_inputs, loss_fn) and profile it with --model path/to/file.py:FUNC "
            "(--fake works there too)"
        ) from None
    for key, value in {"use_cache": False, **overrides}.items():
        setattr(config, key, value)
    return config


def model_class(config: Any) -> Any:
    """The transformers class that builds ``config`` for training with an LM loss (module doc)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(arch), None)
        if cls is not None and str(arch).endswith(_CAUSAL + _MASKED + _SEQ2SEQ):
            return cls
    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    mt = config.model_type
    # an encoder that can also be a decoder (BERT: BertLMHeadModel) trains masked unless it says is_decoder
    if mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES and (
        mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not getattr(config, "is_decoder", False)
    ):
        return AutoModelForMaskedLM
    return AutoModelForCausalLM


def family(cls: Any, config: Any) -> str:
    """``"causal"``, ``"masked"`` or ``"seq2seq"``: which loss the class trains with."""
    name = getattr(cls, "__name__", "")
    if name.endswith(_SEQ2SEQ) or name == "AutoModelForSeq2SeqLM" or getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if name.endswith(_MASKED) or name == "AutoModelForMaskedLM":
        return "masked"
    return "causal"


def lm_loss(kind: str) -> Callable[[Any, Tensor], Tensor]:
    """The language-model loss ``loss(output, labels)`` of a model family (module doc)."""

    def loss(output: Any, labels: Tensor) -> Tensor:
        logits = output.logits if hasattr(output, "logits") else output[0]
        if kind == "causal":
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    return loss


def hf_entrypoint(path: str, *, seq: int, name: str | None = None) -> Entrypoint:
    """The model of the config at ``path`` with ``input_ids`` of ``seq`` tokens and its LM loss.

    Call it inside a fake-tensor mode for a fake model (:func:`profiler.fake.fake_profile` does).
    """
    if seq < 1:
        raise InputError(f"--seq {seq}: give the training sequence length in tokens, e.g. 4096")
    config = read_config(path)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq > limit:
        raise InputError(
            f"--seq {seq} is longer than the config's max_position_embeddings {limit}: give --seq {limit} or "
            "less, or raise max_position_embeddings in the config"
        )
    cls = model_class(config)
    kind = family(cls, config)
    if kind == "causal":  # attention as on a GPU: no mask, K/V not repeated (profiler/_hf_attention.py)
        _hf_attention.gpu_attention(config)
    try:
        model = cls.from_config(config) if cls.__name__.startswith("AutoModel") else cls(config)
    except InputError:
        raise
    except Exception as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise InputError(
            f"building {getattr(cls, '__name__', cls)} from --hf-config {path!r} failed: {type(err).__name__}: {text}"
        ) from err
    vocab = int(config.vocab_size)
    spec = name or f"--hf-config {path}"

    def ids(batch: int) -> Tensor:
        return torch.randint(0, vocab, (batch, seq))

    keywords: tuple[str, ...] = ("input_ids", "decoder_input_ids") if kind == "seq2seq" else ("input_ids",)
    example = tuple(ids(1) for _ in keywords)

    def data(step: int, batch_size: int) -> tuple[dict[str, Tensor], Tensor]:
        return {k: ids(batch_size) for k in keywords}, ids(batch_size)

    return Entrypoint(
        model=model, example_inputs=example, loss_fn=lm_loss(kind), spec=spec, data_fn=data, keywords=keywords,
        takes_target=True,
    )  # fmt: skip


__all__ = ["config_path", "family", "hf_entrypoint", "lm_loss", "model_class", "read_config"]
