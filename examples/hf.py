"""Hugging Face transformers models, tiny and randomly initialised (needs ``pip install '.[models]'``).

The architectures people train, built from tiny configurations in code (no download), each
with its default dropout and called as a user would, with keyword arguments:
``model(input_ids=ids)`` returning a ``ModelOutput``.  Entry points (no arguments, for
``pipeplan profile --model examples.hf:gpt2``):

* decoders: ``gpt2`` (learned positions, tied LM head, dropout 0.1), ``llama`` (rotary
  embeddings, grouped-query attention, untied head), ``qwen2`` (Llama-style, tied head,
  attention biases), ``mixtral`` (mixture of experts: a router and 4 experts per block),
  ``qwen2_moe`` (Qwen-MoE: a router, 4 routed experts and a gated shared expert per block);
* encoder: ``bert`` (masked LM, head tied to the word embeddings, dropout 0.1);
* encoder-decoder: ``t5`` (relative position bias, one embedding shared by encoder, decoder
  and head, dropout 0.1; inputs ``input_ids`` and ``decoder_input_ids``);
* vision: ``vit`` (patch embedding, CLS token, classifier).

The loss is cross-entropy of the logits against class 0 (token 0 for language models), which
works at any batch size without labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples._seed import seeded

VOCAB = 128
SEQ = 16
BATCH = 4
LAYERS = 4
HIDDEN = 32


def class0_loss(output: Any) -> Tensor:
    """Cross-entropy of ``output.logits`` against class 0 at every position."""
    logits = output.logits if hasattr(output, "logits") else output[0]
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


def _ids(batch: int = BATCH, seq: int = SEQ) -> Tensor:
    return torch.randint(0, VOCAB, (batch, seq))


Entry = tuple[nn.Module, dict[str, Tensor], Callable[[Any], Tensor]]

_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _lm(make: Callable[[], nn.Module], seed: int) -> Entry:
    def build() -> tuple[nn.Module, dict[str, Tensor]]:
        return make(), {"input_ids": _ids()}

    model, inputs = seeded(seed, build)
    return model, inputs, class0_loss


def gpt2() -> Entry:
    """GPT-2: 4 blocks, hidden 32, dropout 0.1 (embeddings, attention, residual)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
                     bos_token_id=1, eos_token_id=2)  # fmt: skip
    return _lm(lambda: GPT2LMHeadModel(cfg), 1)


def llama() -> Entry:
    """Llama: rotary embeddings ((cos, sin) cross every cut), GQA, RMSNorm, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      tie_word_embeddings=False, **_TOKENS)  # fmt: skip
    return _lm(lambda: LlamaForCausalLM(cfg), 2)


def qwen2() -> Entry:
    """Qwen2: Llama-style with attention biases and the LM head tied to the embedding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      tie_word_embeddings=True, **_TOKENS)  # fmt: skip
    return _lm(lambda: Qwen2ForCausalLM(cfg), 3)


def mixtral() -> Entry:
    """Mixtral: a mixture of experts (router, top-2 of 4 experts) in every block."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                        num_local_experts=4, num_experts_per_tok=2, **_TOKENS)  # fmt: skip
    return _lm(lambda: MixtralForCausalLM(cfg), 4)


def qwen2_moe() -> Entry:
    """Qwen2-MoE: top-2 of 4 routed experts plus a shared expert (gated by a sigmoid) in every block."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True,
                         tie_word_embeddings=False, **_TOKENS)  # fmt: skip
    return _lm(lambda: Qwen2MoeForCausalLM(cfg), 8)


def bert() -> Entry:
    """BERT masked LM: 4 encoder layers, dropout 0.1, head tied to the word embeddings."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                     vocab_size=VOCAB, max_position_embeddings=SEQ, pad_token_id=0)  # fmt: skip
    return _lm(lambda: BertForMaskedLM(cfg), 5)


def t5() -> Entry:
    """T5: 2 encoder + 2 decoder blocks, relative position bias, shared embedding, dropout 0.1."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(num_layers=2, num_decoder_layers=2, d_model=HIDDEN, d_ff=64, num_heads=4, d_kv=8,
                   vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip

    def build() -> tuple[nn.Module, dict[str, Tensor]]:
        return T5ForConditionalGeneration(cfg), {"input_ids": _ids(), "decoder_input_ids": _ids(seq=SEQ // 2)}

    model, inputs = seeded(6, build)
    return model, inputs, class0_loss


def vit() -> Entry:
    """ViT: 16x16 images in 4x4 patches, a CLS token, 4 encoder layers, a 10-way classifier."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                    image_size=16, patch_size=4, num_labels=10)  # fmt: skip

    def build() -> tuple[nn.Module, dict[str, Tensor]]:
        return ViTForImageClassification(cfg), {"pixel_values": torch.randn(BATCH, 3, 16, 16)}

    model, inputs = seeded(7, build)
    return model, inputs, class0_loss


ENTRIES = ("gpt2", "llama", "qwen2", "mixtral", "qwen2_moe", "bert", "t5", "vit")
