"""A decoder's architecture and the formulas synth fills a profile with (torch-free).

:class:`DecoderSpec` describes the decoders people train today: GPT-3 (multi-head attention,
LayerNorm, a two-matrix MLP, learned positions, dropout) through Llama 3 (grouped-query
attention, RMSNorm, SwiGLU, rotary positions, no biases, no dropout) to Mixtral and Qwen3-MoE
(:class:`MoESpec`: routed experts, top-k, shared experts, dense first blocks).  For a spec and
a micro-batch of b sequences of s tokens (t = b·s) in a dtype of p bytes this module gives

* **parameters**, exactly as the Hugging Face implementations count them
  (:func:`block_param_count`): attention h·(a + 2g)·d + a·d·h (g key/value heads of d dims),
  MLP (3 if gated else 2)·h·f, biases where ``bias`` (qkv (a + 2g)·d, out h, the MLP's f or 2f
  and h), norms 2h (LayerNorm) or h (RMSNorm) each; an MoE block has a router h·E, E experts of
  (3 or 2)·h·f_e and its shared experts;
* **activations kept for backward**, tensor by tensor (:func:`block_activation_bytes_of`):
  each norm its input (RMSNorm as transformers' ``LlamaRMSNorm`` runs it: the float32 copy of its
  input, the float32 reciprocal RMS per token and the normalised tensor at p), the QKV input, Q
  (a·d), K and V (g·d each), the attention output (the output projection's input) and, with
  ``attention="materialized"``, the a·s² softmax output (its dropout's mask and output too), with
  ``"fused"`` (flash attention) its float32 log-sum-exp per head and query instead; the MLP's
  input, the activation's input and the down projection's input (gated: the gate's and the up
  projection's outputs, the activation's output and their product, 4·f per token); one-byte
  dropout masks after attention and the MLP.  For GPT-3's layout with f = 4h, materialised
  attention and dropout this is exactly Korthikanti et al. (2022), eq. 1:
  s·b·h·(34 + 5·a·s/h) at p = 2 (:func:`block_activation_bytes`).  An MoE block keeps, per
  routed token and expert (t·k of them under balanced routing), its input and output rows
  (p·h each), the expert's 4·f_e (gated) or 2·f_e values, its routing weight and index, and per
  token the router's float32 probabilities (E);
* **the operation census** of one forward (:func:`block_operations`), which the device model
  (:mod:`planner.cost.compute`) prices.

The formulas are checked against measured models: ``examples.gpt`` (GPT-3 layout,
``tests/profiler/test_profiler_synth.py``) and transformers' Llama and Mixtral on CPU
(``tests/profiler/test_synth_decoders.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from planner.schema import Operation

DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2})
CANONICAL_DTYPE: Mapping[str, str] = MappingProxyType({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"})

#: how attention's score matrix is computed: ``fused`` (flash attention: the scores never reach
#: memory) or ``materialized`` (Megatron-LM before flash attention)
ATTENTION_KINDS = ("fused", "materialized")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
Norm = Literal["layernorm", "rmsnorm"]
Positions = Literal["learned", "rotary"]
Attention = Literal["fused", "materialized"]


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: ``experts`` routed experts of FFN size ``expert_ffn``, each token
    routed to ``top_k`` of them, ``shared_experts`` that every token passes (FFN size
    ``shared_ffn`` in all; default ``shared_experts`` x ``expert_ffn``), the first
    ``dense_layers`` blocks dense (the decoder's ``ffn``).  Routing is balanced (every expert gets
    t·k/E tokens) unless ``capacity_factor`` is given (every expert processes that many times
    its balanced share, padding and dropped tokens included)."""

    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    shared_ffn: int | None = None
    dense_layers: int = 0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for label, value in (("experts", self.experts), ("top-k", self.top_k), ("expert-ffn", self.expert_ffn)):
            if value < 1:
                raise ValueError(f"--{label} must be >= 1, got {value}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k {self.top_k} is more than --experts {self.experts}: route each token to at most every expert")
        if self.shared_experts < 0 or self.dense_layers < 0:
            raise ValueError(f"--shared-experts and --dense-layers must be >= 0, got {self.shared_experts} and {self.dense_layers}")
        if self.shared_ffn is not None and self.shared_ffn < 1:
            raise ValueError(f"--shared-expert-ffn must be >= 1, got {self.shared_ffn}")
        if self.capacity_factor is not None and not (math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
            raise ValueError(f"--capacity-factor must be a positive number, got {self.capacity_factor}")

    @property
    def shared_total_ffn(self) -> int:
        """The shared experts' FFN size, all of them together."""
        if self.shared_experts == 0:
            return 0
        return self.shared_ffn if self.shared_ffn is not None else self.shared_experts * self.expert_ffn

    def tokens_per_expert(self, tokens: int) -> int:
        """Tokens one expert processes in a forward of ``tokens`` tokens (balanced, or at capacity)."""
        share = tokens * self.top_k / self.experts
        return max(1, math.ceil(share * (self.capacity_factor or 1.0)))


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder-only Transformer: an embedding, ``layers`` blocks, a head.

    ``kv_heads``: key/value heads (grouped-query attention; default ``heads``).  ``head_dim``:
    default hidden ÷ heads.  ``ffn``: the dense MLP's size (default 4 x hidden).  ``gated_mlp``:
    SwiGLU/GeGLU (three matrices).  ``norm``, ``bias``, ``positions``: LayerNorm with biases and
    learned positions (GPT) or RMSNorm without biases and rotary positions (Llama).
    ``qkv_bias``: biases on the query, key and value projections only (Qwen2).  ``qk_norm``: a
    norm over each query and key head (Qwen3).
    ``tied_embeddings``: the head reuses the embedding's table.  ``dropout``: trained with
    dropout (its masks are kept).  ``moe``: the blocks' MLPs are mixtures of experts."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    gated_mlp: bool = False
    norm: Norm = "layernorm"
    bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    positions: Positions = "learned"
    tied_embeddings: bool = False
    dropout: bool = True
    attention: Attention = "fused"
    moe: MoESpec | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        for label, value in (("layers", self.layers), ("hidden", self.hidden), ("heads", self.heads),
                             ("seq", self.seq), ("vocab", self.vocab)):
            if value < 1:
                raise ValueError(f"--{label} must be >= 1, got {value}")
        if self.ffn is not None and self.ffn < 1:
            raise ValueError(f"--ffn must be >= 1, got {self.ffn}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads} (or give --head-dim)")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"--head-dim must be >= 1, got {self.head_dim}")
        g = self.kv_heads if self.kv_heads is not None else self.heads
        if g < 1 or self.heads % g:
            raise ValueError(f"--kv-heads {g} must divide --heads {self.heads} (grouped-query attention)")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}: choose one of {', '.join(ATTENTION_KINDS)}")
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}: choose one of {', '.join(NORMS)}")
        if self.positions not in POSITIONS:
            raise ValueError(f"unknown positions {self.positions!r}: choose one of {', '.join(POSITIONS)}")
        if self.moe is not None and self.moe.dense_layers > self.layers:
            raise ValueError(f"--dense-layers {self.moe.dense_layers} is more than --layers {self.layers}")

    # derived sizes -------------------------------------------------------------------------
    @property
    def g(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def d(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def f(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (from 0) is a mixture of experts."""
        return self.moe is not None and index >= self.moe.dense_layers


# ------------------------------------------------------------------------------- parameters


def norm_params(spec: DecoderSpec) -> int:
    return 2 * spec.hidden if spec.norm == "layernorm" else spec.hidden


def attention_gemm_params(spec: DecoderSpec) -> int:
    """The attention's projection weights: QKV and the output."""
    return spec.hidden * (spec.heads + 2 * spec.g) * spec.d + spec.heads * spec.d * spec.hidden


def attention_params(spec: DecoderSpec) -> tuple[int, int]:
    """(weights, biases) of one block's attention."""
    h, a, g, d = spec.hidden, spec.heads, spec.g, spec.d
    weights = attention_gemm_params(spec)
    if spec.qk_norm:
        weights += 2 * (2 * d if spec.norm == "layernorm" else d)
    biases = ((a + 2 * g) * d if spec.bias or spec.qkv_bias else 0) + (h if spec.bias else 0)
    return weights, biases


def dense_mlp_params(spec: DecoderSpec, ffn: int) -> tuple[int, int]:
    """(weights, biases) of a dense MLP of size ``ffn``."""
    h = spec.hidden
    weights = spec.mlp_matrices * h * ffn
    biases = ((ffn * (spec.mlp_matrices - 1) + h) if spec.bias else 0)
    return weights, biases


def expert_params(spec: DecoderSpec) -> int:
    """The routed experts' parameters, all of them (0 for a dense decoder)."""
    if spec.moe is None:
        return 0
    return spec.moe.experts * spec.mlp_matrices * spec.hidden * spec.moe.expert_ffn


def block_param_count(spec: DecoderSpec, *, moe: bool = False) -> int:
    """Parameters of one block (dense, or a mixture of experts with ``moe``)."""
    aw, ab = attention_params(spec)
    total = aw + ab + 2 * norm_params(spec)
    if moe and spec.moe is not None:
        total += spec.hidden * spec.moe.experts + expert_params(spec)  # router, experts
        if spec.moe.shared_total_ffn:
            total += sum(dense_mlp_params(spec, spec.moe.shared_total_ffn))
    else:
        total += sum(dense_mlp_params(spec, spec.f))
    return total


def block_tp_param_count(spec: DecoderSpec, *, moe: bool = False) -> int:
    """The parameters tensor parallelism divides: the attention and MLP (expert) weights and the
    column-parallel biases (QKV, the MLP's first); norms, row-parallel biases and the router stay."""
    h = spec.hidden
    aw = attention_gemm_params(spec)
    col_bias = (spec.heads + 2 * spec.g) * spec.d if spec.bias or spec.qkv_bias else 0
    if moe and spec.moe is not None:
        mlp = expert_params(spec) + spec.mlp_matrices * h * spec.moe.shared_total_ffn
        if spec.bias and spec.moe.shared_total_ffn:
            col_bias += spec.moe.shared_total_ffn * (spec.mlp_matrices - 1)
    else:
        mlp = spec.mlp_matrices * h * spec.f
        if spec.bias:
            col_bias += spec.f * (spec.mlp_matrices - 1)
    return aw + mlp + col_bias


def embedding_param_count(spec: DecoderSpec) -> int:
    return spec.vocab * spec.hidden + (spec.seq * spec.hidden if spec.positions == "learned" else 0)


def head_param_count(spec: DecoderSpec) -> int:
    return (0 if spec.tied_embeddings else spec.vocab * spec.hidden) + norm_params(spec)


def total_param_count(spec: DecoderSpec) -> int:
    """Every parameter of the model (shared ones once)."""
    moe_blocks = sum(spec.is_moe_block(i) for i in range(spec.layers))
    return (embedding_param_count(spec) + head_param_count(spec)
            + moe_blocks * block_param_count(spec, moe=True)
            + (spec.layers - moe_blocks) * block_param_count(spec, moe=False))


# ------------------------------------------------------------------------------- activations


def norm_kept_bytes(spec: DecoderSpec, tokens: int, p: int) -> int:
    """What one norm keeps for backward: LayerNorm its input; RMSNorm (transformers' upcasting
    LlamaRMSNorm) its float32 input, the float32 reciprocal RMS per token and the normalised
    tensor at p."""
    h = spec.hidden
    if spec.norm == "layernorm":
        return tokens * h * p
    return tokens * h * 4 + tokens * 4 + tokens * h * p


def attention_kept_bytes(spec: DecoderSpec, b: int, p: int) -> int:
    """Attention's own tensors kept for backward (its input is the norm's output, counted apart):
    Q, K, V, the output and either the softmax's probabilities (materialised: with dropout also
    its mask and output) or flash attention's float32 log-sum-exp."""
    s, a, g, d = spec.seq, spec.heads, spec.g, spec.d
    t = b * s
    kept = t * a * d * p + 2 * t * g * d * p + t * a * d * p
    if spec.qk_norm:  # each head's norm over d (for RMSNorm, LlamaRMSNorm's upcast as above)
        for n in (t * a * d, t * g * d):
            kept += n * p if spec.norm == "layernorm" else n * 4 + n // d * 4 + n * p
    if spec.attention == "materialized":
        kept += a * s * s * b * ((2 * p + 1) if spec.dropout else p)
    else:
        kept += 4 * b * a * s
    return kept


def dense_mlp_kept_bytes(spec: DecoderSpec, tokens: int, ffn: int, p: int) -> int:
    """A dense MLP's inner tensors (its input apart): gated 4·f per token, else 2·f."""
    return tokens * ffn * p * (4 if spec.gated_mlp else 2)


def moe_kept_bytes(spec: DecoderSpec, tokens: int, p: int) -> int:
    """An MoE MLP's tensors (its input apart): the router's float32 probabilities, per routed
    token and expert its input and output rows, the expert's inner tensors, its routing weight
    (float32) and index (int64), and the shared experts' inner tensors."""
    assert spec.moe is not None
    m = spec.moe
    slots = m.tokens_per_expert(tokens) * m.experts
    return (tokens * m.experts * 4
            + slots * (2 * spec.hidden * p + dense_mlp_kept_bytes(spec, 1, m.expert_ffn, p) + 4 + 8)
            + dense_mlp_kept_bytes(spec, tokens, m.shared_total_ffn, p))


def block_activation_bytes_of(spec: DecoderSpec, b: int, p: int, *, moe: bool = False) -> int:
    """Bytes one block keeps for backward at micro-batch ``b`` (see the module's docstring)."""
    t, h = b * spec.seq, spec.hidden
    kept = 2 * norm_kept_bytes(spec, t, p)
    kept += t * h * p + attention_kept_bytes(spec, b, p)  # QKV input, attention
    kept += t * h * p  # the MLP's input
    if moe and spec.moe is not None:
        kept += moe_kept_bytes(spec, t, p)
    else:
        kept += dense_mlp_kept_bytes(spec, t, spec.f, p)
    if spec.dropout:
        kept += 2 * t * h  # the masks after attention and after the MLP
    return kept


def block_activation_bytes(b: int, s: int, h: int, a: int, p: int, *, dropout: bool = True) -> int:
    """Bytes one GPT-3 block (f = 4h, materialised attention) keeps for backward: Korthikanti et
    al. (2022), eq. 1, by dtype; with dropout and p = 2, s·b·h·(34 + 5·a·s/h)."""
    spec = DecoderSpec(layers=1, hidden=h, heads=a, seq=s, vocab=1, dropout=dropout, attention="materialized")
    return block_activation_bytes_of(spec, b, p)


def block_replicated_bytes(spec: DecoderSpec, b: int, p: int, *, moe: bool = False) -> int:
    """What a block keeps whole on every device of a tensor-parallel group without sequence
    parallelism (Korthikanti's 10·sbh for GPT-3): the norms', the QKV and MLP inputs, the dropout
    masks and the router's probabilities."""
    t, h = b * spec.seq, spec.hidden
    kept = 2 * norm_kept_bytes(spec, t, p) + 2 * t * h * p + (2 * t * h if spec.dropout else 0)
    if moe and spec.moe is not None:
        kept += t * spec.moe.experts * 4
    return kept


def block_weight_grad_bytes(spec: DecoderSpec, b: int, p: int, *, moe: bool = False) -> int:
    """Bytes held between a block's input gradient and its weight gradient (what
    torch.distributed.pipelining keeps for the weight pass): the inputs of the weight layers (the
    two norms, QKV, the output projection, the MLP's two inputs) and the gradients at their
    outputs, about as large: 2·p·t·(4h + a·d + f_down)."""
    t, h = b * spec.seq, spec.hidden
    if moe and spec.moe is not None:
        f_down = spec.moe.top_k * spec.moe.expert_ffn + spec.moe.shared_total_ffn
    else:
        f_down = spec.f
    return 2 * p * t * (4 * h + spec.heads * spec.d + f_down)


def block_gemm_flops(spec: DecoderSpec, b: int, *, moe: bool = False) -> int:
    """Forward FLOPs of a block's matrix products and attention (2·m·n·k per GEMM; attention's
    two batched products 4·b·s²·a·d, counted whole as in Narayanan et al. 2021)."""
    t, h, s = b * spec.seq, spec.hidden, spec.seq
    per_token = attention_gemm_params(spec)
    if moe and spec.moe is not None:
        m = spec.moe
        per_token += h * m.experts + spec.mlp_matrices * h * m.shared_total_ffn
        expert = 2 * m.tokens_per_expert(t) * m.experts * spec.mlp_matrices * h * m.expert_ffn
    else:
        per_token += spec.mlp_matrices * h * spec.f
        expert = 0
    return 2 * t * per_token + expert + 4 * b * s * s * spec.heads * spec.d


# ------------------------------------------------------------------------------- census


def memory_op(nbytes: int, dtype: str, *, count: int = 1, sharded: bool = False, expert: bool = False) -> Operation:
    return Operation(kind="memory", bytes=nbytes, dtype=dtype, count=count,
                     tp_shard="bytes" if sharded else None, expert=True if expert else None)


def _mlp_operations(spec: DecoderSpec, tokens: int, ffn: int, dtype: str, *, count: int = 1,
                    expert: bool = False) -> list[Operation]:
    """A (gated) MLP of size ``ffn`` on ``tokens`` tokens, ``count`` of them (experts)."""
    h, p = spec.hidden, DTYPE_BYTES[dtype]
    mark = True if expert else None
    up = Operation(kind="gemm", m=tokens, n=ffn, k=h, dtype=dtype, tp_shard="n",
                   count=count * (2 if spec.gated_mlp else 1), expert=mark)
    # GeLU reads and writes t·f; SwiGLU's activation and product read 2·t·f and write t·f... twice
    act = memory_op((5 if spec.gated_mlp else 2) * tokens * ffn * p * count, dtype, sharded=True, expert=expert)
    down = Operation(kind="gemm", m=tokens, n=h, k=ffn, dtype=dtype, tp_shard="k", count=count, expert=mark)
    return [up, act, down]


def block_operations_of(spec: DecoderSpec, b: int, dtype: str, *, moe: bool = False) -> list[Operation]:
    """One block's forward at micro-batch ``b``: the norms (read and write t·h), QKV (column-
    parallel, ``tp_shard`` n), causal attention (by heads), the output projection (row-parallel,
    k), the MLP (or the router, the experts' GEMMs at balanced routing — ``expert`` marked —, the
    dispatch and combine permutations and the shared experts), two residual adds (two reads, one
    write), the dropouts (read, write and a one-byte mask) and, with materialised attention, the
    dropout on the a·s²·b probabilities.  m = b·s tokens."""
    t, p, h, s = b * spec.seq, DTYPE_BYTES[dtype], spec.hidden, spec.seq
    a, g, d = spec.heads, spec.g, spec.d
    ops = [
        memory_op(2 * t * h * p, dtype, count=2),  # the two norms
        Operation(kind="gemm", m=t, n=(a + 2 * g) * d, k=h, dtype=dtype, tp_shard="n"),
        Operation(kind="attention", batch=b, heads=a, query_len=s, key_len=s, head_dim=d,
                  kv_heads=g if g != a else None,
                  causal=True, fused=spec.attention == "fused", dtype=dtype, tp_shard="heads"),
        Operation(kind="gemm", m=t, n=h, k=a * d, dtype=dtype, tp_shard="k"),
    ]
    if moe and spec.moe is not None:
        m = spec.moe
        ops.append(Operation(kind="gemm", m=t, n=m.experts, k=h, dtype=dtype))  # the router
        ops.append(memory_op(t * m.experts * (p + 8), dtype))  # softmax in float32, top-k
        ops.append(memory_op(2 * 2 * t * m.top_k * h * p, dtype))  # dispatch and combine permutations
        ops += _mlp_operations(spec, m.tokens_per_expert(t), m.expert_ffn, dtype, count=m.experts, expert=True)
        if m.shared_total_ffn:
            ops += _mlp_operations(spec, t, m.shared_total_ffn, dtype)
    else:
        ops += _mlp_operations(spec, t, spec.f, dtype)
    ops.append(memory_op(3 * t * h * p, dtype, count=2))  # the residual adds
    if spec.dropout:
        ops.append(memory_op(t * h * (2 * p + 1), dtype, count=2))
        if spec.attention == "materialized":
            ops.append(memory_op(a * s * s * b * (2 * p + 1), dtype, sharded=True))
    return ops


def embedding_operations_of(spec: DecoderSpec, b: int, dtype: str) -> list[Operation]:
    """The embedding's forward: the token lookup (gather: read and write t·h), with learned
    positions their lookup and add, and dropout."""
    t, p, h = b * spec.seq, DTYPE_BYTES[dtype], spec.hidden
    ops = [memory_op(2 * t * h * p, dtype)]
    if spec.positions == "learned":
        ops.append(memory_op(3 * t * h * p, dtype))
    if spec.dropout:
        ops.append(memory_op(t * h * (2 * p + 1), dtype))
    return ops


def head_operations_of(spec: DecoderSpec, b: int, dtype: str) -> list[Operation]:
    """The head's forward: the final norm, the logits GEMM (column-parallel over the vocabulary)
    and the cross-entropy over float32 logits (read the logits, write and read the float32
    log-probabilities: vocabulary-parallel)."""
    t, p, h = b * spec.seq, DTYPE_BYTES[dtype], spec.hidden
    return [
        memory_op(2 * t * h * p, dtype),
        Operation(kind="gemm", m=t, n=spec.vocab, k=h, dtype=dtype, tp_shard="n"),
        memory_op(t * spec.vocab * (p + 8), dtype, sharded=True),
    ]


def attention_core(ops: list[Operation]) -> list[Operation]:
    """What selective recompute re-runs of a block: attention and the dropout on its
    probabilities (the sharded memory kernel the attention's scores size)."""
    attn = [o for o in ops if o.kind == "attention"]
    scores = attn[0].batch * (attn[0].heads or 0) * (attn[0].query_len or 0) * (attn[0].key_len or 0) if attn else 0
    return attn + [o for o in ops if o.kind == "memory" and o.tp_shard == "bytes" and (o.bytes or 0) >= scores > 0]


def score_pass_bytes(p: int, *, dropout: bool = True, attention: str = "fused") -> tuple[int, int]:
    """Bytes moved per attention score (one head, one query, one key) by the memory-bound
    operators on a materialized score matrix, forward and backward; ``(0, 0)`` when fused.

    Forward: the softmax reads the scores and writes the probabilities (2p); the dropout
    reads them and writes its output and a one-byte mask (2p + 1).  Backward: the dropout's
    gradient reads the mask and the output gradient and writes the input gradient (2p + 1);
    the softmax's reads the probabilities and the output gradient and writes the input
    gradient (3p).  The two batched matrix products (scores and context) are counted as
    FLOPs, 4·b·s²·h, as in the paper's formula.
    """
    if attention == "fused":
        return 0, 0
    forward = 2 * p + (2 * p + 1 if dropout else 0)
    backward = 3 * p + (2 * p + 1 if dropout else 0)
    return forward, backward
