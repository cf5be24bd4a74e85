"""Analytic profiles: fill the profile format from formulas, for models too big to run here.

Torch-free.  Per Transformer block with hidden size h, FFN size f, a heads, sequence s,
micro-batch b and dtype of p bytes:

* parameters: 4h^2 + 2hf weights + 9h + f biases and LayerNorm (GPT-2 layout);
* forward FLOPs: 2·b·s·(4h^2 + 2hf) for the matrix products + 4·b·s^2·h for attention;
  backward costs twice the forward (Narayanan et al. 2021, appendix), split (Qi et al. 2024)
  into the weight gradient W (the matrix products once more: 2·b·s·(4h^2 + 2hf)) and the
  input gradient I (the rest: the matrix products and attention's backward);
* bytes held between I and W (what torch.distributed.pipelining keeps for the weight pass):
  the inputs of the weight layers (the four matrix products, the two LayerNorms) and the
  gradients at their outputs, s·b·(10h + 2f)·p;
* time: FLOPs ÷ (peak FLOP/s of the device and dtype × MFU); with ``attention="materialized"``
  (Megatron-LM before flash attention) also the softmax's and the dropout's passes over the
  a·s²·b score matrix, timed at the device's memory bandwidth (:func:`score_pass_bytes`:
  forward 4p + 1 bytes per score, backward 5p + 1, without dropout 2p and 3p), which weigh
  most on models with few hidden units per sequence position (s / h large);
* activations kept for backward: s·b·h·(34 + 5·a·s/h) bytes for 16-bit training
  (Korthikanti et al. 2022, eq. 1).  Term by term that is s·b·h·(16p + 2) + a·s²·b·(2p + 1):
  the 2·sbh and a·s²·b one-byte terms are dropout masks, and one p·a·s²·b term is the
  dropout's output.  Without dropout (``dropout=False``) it is 16p·sbh + p·a·s²·b.  For
  p = 2 with dropout this is exactly Korthikanti's figure; other dtypes scale every term
  but the one-byte masks;
* output of a block: s·b·h·p bytes.
* tensor parallelism (Megatron; Narayanan et al. 2021, Korthikanti et al. 2022): a block's
  matrix products and attention shard over T (``tp_compute_fraction`` 1), its weights and the
  column-parallel biases too (LayerNorms and the row-parallel biases, 6h, stay whole); each
  forward and each backward all-reduces the attention and the MLP outputs, 2 x s·b·h·p bytes;
  without sequence parallelism the LayerNorm inputs and the dropout masks stay whole on every
  device, s·b·h·(4p + 2) (Korthikanti's 10·sbh), the rest divides by T; with it everything does.
  The embedding is vocabulary-parallel (its table shards; one all-reduce of its output
  forward), the LM head column-parallel with a vocabulary-parallel loss (the table shards; two
  small all-reduces of b·s floats forward, the input gradient's all-reduce backward; the log
  probabilities shard, the LayerNorm's input and output and the targets stay whole);
* selective recompute (Korthikanti et al. 2022): a block drops attention's softmax, its dropout
  mask and output, a·s²·b·(2p + 1) bytes, and recomputes them (4·b·s²·h FLOPs) in the backward.

The token embedding and the LM head are layers of their own (the head holds the final
LayerNorm and the logits; it keeps the LayerNorm input and output, the token targets and
the float32 log-probabilities of the cross-entropy loss).

``tests/profiler`` checks these formulas against a measured small Transformer
(``examples.gpt``) on CPU: parameter and activation bytes agree within 10 %.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from planner.cost.compute import DeviceConstants, OpTimes, layer_times
from planner.presets import DEVICES, unknown_preset
from planner.schema import LayerProfile, MeasuredOn, Operation, Profile

DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2})
_CANONICAL: Mapping[str, str] = MappingProxyType({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"})


def synth_transformer(
    *,
    layers: int,
    hidden: int,
    ffn: int | None = None,
    heads: int,
    seq: int,
    vocab: int,
    device_type: str = "h100-80g",
    dtype: str = "bfloat16",
    mfu: float | None = None,
    constants: DeviceConstants | None = None,
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8),
    tied_embeddings: bool = False,
    name: str | None = None,
    dropout: bool = True,
    attention: str = "fused",
) -> Profile:
    """A GPT-style decoder profile: embedding, ``layers`` blocks, LM head.

    Times come from the device model (:mod:`planner.cost.compute`): every layer's operation
    census (:func:`block_operations`, written into the profile) priced on ``device_type`` with
    ``constants`` (default: the device's published defaults).  ``mfu``, when given, prices every
    layer's FLOPs at that one fraction of peak instead (the flat model of profiles before schema
    version 4); the census is written either way.

    ``dropout``: whether the model trains with dropout (its masks are kept for backward).
    ``attention``: ``"fused"`` (the score matrix never reaches memory, as with flash attention)
    or ``"materialized"`` (as in Megatron-LM before flash attention: the a·s² scores per sample
    are written to memory and read back by the softmax and the dropout, memory-bound passes
    timed at the device's memory bandwidth; see :func:`score_pass_bytes`).
    """
    if device_type not in DEVICES:
        raise unknown_preset("device_type", device_type, DEVICES)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(sorted(DTYPE_BYTES))}")
    for label, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"--{label} must be >= 1, got {value}")
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} must be a multiple of --heads {heads}")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}: choose one of {', '.join(ATTENTION_KINDS)}")
    dtype = _CANONICAL.get(dtype, dtype)
    f = ffn if ffn is not None else 4 * hidden
    h, s, a, v = hidden, seq, heads, vocab
    p = DTYPE_BYTES[dtype]
    preset = DEVICES[device_type]
    flops_per_s = preset.peak_flops.get(dtype, preset.peak_flops["float32"]) * (mfu or 1.0)
    membw = preset.memory_bandwidth_bytes_per_s
    sizes = sorted(microbatch_sizes)
    shape = _Shape(h=h, f=f, a=a, s=s, v=v, dtype=dtype, dropout=dropout, fused=attention == "fused")

    def ms(flops: float) -> float:
        return flops / flops_per_s * 1e3

    def priced(ops: list[Operation]) -> OpTimes:
        return layer_times(ops, device_type=device_type, constants=constants)

    block_params = (4 * h * h + 2 * h * f + 9 * h + f) * p
    out: list[LayerProfile] = []

    # Embedding: a gather, bound by memory bandwidth; backward scatters into the table.
    emb_ops = [embedding_operations(b, shape) for b in sizes]
    emb_fwd = (
        [ms(0) + (b * s * h * p * 2) / membw * 1e3 for b in sizes] if mfu is not None
        else [priced(ops).forward for ops in emb_ops]
    )
    out.append(
        LayerProfile(
            name="embed",
            param_bytes=(v * h + s * h) * p,
            forward_ms=emb_fwd,
            backward_ms=[2 * t for t in emb_fwd],
            # token ids have no gradient: the whole backward is the table's (weight) gradient
            backward_input_ms=[0.0 for _ in emb_fwd],
            backward_weight_ms=[2 * t for t in emb_fwd],
            operations=emb_ops,
            weight_grad_bytes=[b * s * 8 + b * s * h * p for b in sizes],
            # token ids, position ids (+ the dropout mask)
            activation_bytes=[b * s * 8 + s * 8 + (b * s * h if dropout else 0) for b in sizes],
            output_bytes=[b * s * h * p for b in sizes],
            kind="Embedding",
            tensor_parallel="vocab-embedding",
            tp_param_bytes=v * h * p,
            tp_forward_bytes=[b * s * h * p for b in sizes],
            tp_backward_bytes=[0 for _ in sizes],
            tp_forward_collectives=1,
            tp_backward_collectives=0,
            tp_replicated_activation_bytes=[b * s * 8 + s * 8 + (b * s * h if dropout else 0) for b in sizes],
            sp_replicated_activation_bytes=[b * s * 8 + s * 8 for b in sizes],
        )
    )
    # the attention scores' memory-bound passes (0 when fused), forward and backward
    score_fwd_bytes, score_bwd_bytes = score_pass_bytes(p, dropout=dropout, attention=attention)
    score_fwd = [a * s * s * b * score_fwd_bytes / membw * 1e3 for b in sizes]
    score_bwd = [a * s * s * b * score_bwd_bytes / membw * 1e3 for b in sizes]
    block_ops = [block_operations(b, shape) for b in sizes]
    if mfu is not None:
        fwd = [ms(2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h) + sf for b, sf in zip(sizes, score_fwd, strict=True)]
        bwd = [2 * (t - sf) + sb for t, sf, sb in zip(fwd, score_fwd, score_bwd, strict=True)]
        wgt = [ms(2 * b * s * (4 * h * h + 2 * h * f)) for b in sizes]
        redo = [ms(4 * b * s * s * h) + sf for b, sf in zip(sizes, score_fwd, strict=True)]
        frac = 1.0
    else:
        block_t = [priced(ops) for ops in block_ops]
        fwd = [x.forward for x in block_t]
        bwd = [x.backward for x in block_t]
        wgt = [x.backward_weight for x in block_t]
        # selective recompute re-runs attention's core (and its dropout) in the backward
        redo = [priced(_attention_core(ops)).forward for ops in block_ops]
        sharded = [priced([o for o in ops if o.tp_shard is not None]).forward for ops in block_ops]
        frac = min(1.0, sharded[-1] / fwd[-1]) if fwd[-1] > 0 else 1.0
    for i in range(layers):
        out.append(
            LayerProfile(
                name=f"blocks.{i}",
                param_bytes=block_params,
                forward_ms=fwd,
                backward_ms=bwd,
                backward_input_ms=[t - w_ for t, w_ in zip(bwd, wgt, strict=True)],
                backward_weight_ms=wgt,
                weight_grad_bytes=[s * b * (10 * h + 2 * f) * p for b in sizes],
                activation_bytes=[block_activation_bytes(b, s, h, a, p, dropout=dropout) for b in sizes],
                output_bytes=[b * s * h * p for b in sizes],
                flops=[2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h for b in sizes],
                kind="TransformerBlock",
                tensor_parallel="block",
                tp_param_bytes=(4 * h * h + 2 * h * f + 3 * h + f) * p,
                tp_compute_fraction=frac,
                tp_forward_bytes=[2 * b * s * h * p for b in sizes],
                tp_backward_bytes=[2 * b * s * h * p for b in sizes],
                tp_replicated_activation_bytes=[s * b * h * (4 * p + (2 if dropout else 0)) for b in sizes],
                sp_replicated_activation_bytes=[0 for _ in sizes],
                selective_recompute_bytes=[a * s * s * b * ((2 * p + 1) if dropout else p) for b in sizes],
                selective_recompute_ms=redo,
                operations=block_ops,
            )
        )
    head_ops = [head_operations(b, shape) for b in sizes]
    if mfu is not None:
        head_fwd = [ms(2 * b * s * h * v) for b in sizes]
        head_in, head_wt = head_fwd, head_fwd
    else:
        head_t = [priced(ops) for ops in head_ops]
        head_fwd = [x.forward for x in head_t]
        head_in, head_wt = [x.backward_input for x in head_t], [x.backward_weight for x in head_t]
    out.append(
        LayerProfile(
            name="head",
            param_bytes=(0 if tied_embeddings else v * h * p) + 2 * h * p,
            forward_ms=head_fwd,
            backward_ms=[x + y for x, y in zip(head_in, head_wt, strict=True)],
            backward_input_ms=head_in,
            backward_weight_ms=head_wt,
            operations=head_ops,
            # the LayerNorm's input and output, the gradient of the logits
            weight_grad_bytes=[2 * b * s * h * p + b * s * v * p for b in sizes],
            # LayerNorm input and output, targets, float32 log-probabilities of the loss
            activation_bytes=[2 * b * s * h * p + b * s * 8 + b * s * v * 4 for b in sizes],
            output_bytes=[4 for _ in sizes],
            flops=[2 * b * s * h * v for b in sizes],
            kind="LMHead",
            tensor_parallel="column-head",
            tp_param_bytes=0 if tied_embeddings else v * h * p,
            tp_forward_bytes=[2 * b * s * 4 for b in sizes],
            tp_backward_bytes=[b * s * h * p for b in sizes],
            tp_forward_collectives=2,
            tp_backward_collectives=1,
            tp_replicated_activation_bytes=[2 * b * s * h * p + b * s * 8 for b in sizes],
            sp_replicated_activation_bytes=[b * s * 8 for b in sizes],
        )
    )
    return Profile(
        model=name or f"transformer-{layers}l-h{h}",
        measured_on=MeasuredOn(device=f"synthetic:{device_type}", device_name=device_type, dtype=dtype),
        microbatch_sizes=sizes,
        input_bytes=[b * s * 8 for b in sizes],
        layers=out,
        metadata={
            "synth": {
                "kind": "transformer",
                "layers": layers,
                "hidden": h,
                "ffn": f,
                "heads": a,
                "seq": s,
                "vocab": v,
                "mfu": mfu,
                "timing": "flat mfu" if mfu is not None else "device model",
                **({} if constants is None else {"gemm_efficiency": constants.gemm_efficiency,
                                                 "memory_efficiency": constants.memory_efficiency}),
                "device_type": device_type,
                "attention": attention,
            }
        },
    )


@dataclass(frozen=True)
class _Shape:
    """A decoder's sizes, as the census needs them."""

    h: int
    f: int
    a: int
    s: int
    v: int
    dtype: str
    dropout: bool
    fused: bool

    @property
    def p(self) -> int:
        return DTYPE_BYTES[self.dtype]


def _memory(nbytes: int, dtype: str, *, count: int = 1, sharded: bool = False) -> Operation:
    return Operation(kind="memory", bytes=nbytes, dtype=dtype, count=count, tp_shard="bytes" if sharded else None)


def block_operations(b: int, x: _Shape) -> list[Operation]:
    """One GPT block's forward at micro-batch ``b`` (the census ``pipeplan profile`` records for
    ``examples.gpt``): the four GEMMs (QKV and the MLP's first: column-parallel, ``tp_shard`` n;
    the attention output and the MLP's second: row-parallel, k), causal attention (sharded by
    heads), and the memory-bound kernels: two LayerNorms (read and write s·b·h), two residual
    adds (two reads, one write), the MLP's activation (s·b·f, inside the tensor-parallel region),
    two dropouts (read, write and a one-byte mask) and, with materialised attention, the dropout
    on the a·s²·b probabilities (sharded by heads).  m = b·s tokens."""
    t, p, h, f = b * x.s, x.p, x.h, x.f
    ops = [
        _memory(2 * t * h * p, x.dtype, count=2),  # the two LayerNorms
        Operation(kind="gemm", m=t, n=3 * h, k=h, dtype=x.dtype, tp_shard="n"),
        Operation(kind="attention", batch=b, heads=x.a, query_len=x.s, key_len=x.s, head_dim=h // x.a,
                  causal=True, fused=x.fused, dtype=x.dtype, tp_shard="heads"),
        Operation(kind="gemm", m=t, n=h, k=h, dtype=x.dtype, tp_shard="k"),
        Operation(kind="gemm", m=t, n=f, k=h, dtype=x.dtype, tp_shard="n"),
        _memory(2 * t * f * p, x.dtype, sharded=True),  # GeLU
        Operation(kind="gemm", m=t, n=h, k=f, dtype=x.dtype, tp_shard="k"),
        _memory(3 * t * h * p, x.dtype, count=2),  # the residual adds
    ]
    if x.dropout:
        ops.append(_memory(t * h * (2 * p + 1), x.dtype, count=2))
        if not x.fused:
            ops.append(_memory(x.a * x.s * x.s * b * (2 * p + 1), x.dtype, sharded=True))
    return ops


def _attention_core(ops: list[Operation]) -> list[Operation]:
    """What selective recompute re-runs of a block: attention and the dropout on its
    probabilities (the sharded memory kernel the attention's scores size)."""
    attn = [o for o in ops if o.kind == "attention"]
    scores = attn[0].batch * (attn[0].heads or 0) * (attn[0].query_len or 0) * (attn[0].key_len or 0) if attn else 0
    return attn + [o for o in ops if o.kind == "memory" and o.tp_shard == "bytes" and (o.bytes or 0) >= scores > 0]


def embedding_operations(b: int, x: _Shape) -> list[Operation]:
    """The embedding's forward: the token and position lookups (gather: read and write s·b·h),
    their add, and dropout."""
    t, p, h = b * x.s, x.p, x.h
    ops = [_memory(2 * t * h * p, x.dtype), _memory(3 * t * h * p, x.dtype)]
    if x.dropout:
        ops.append(_memory(t * h * (2 * p + 1), x.dtype))
    return ops


def head_operations(b: int, x: _Shape) -> list[Operation]:
    """The head's forward: the final LayerNorm, the logits GEMM (column-parallel over the
    vocabulary) and the cross-entropy over float32 logits (read the logits, write and read the
    float32 log-probabilities: vocabulary-parallel)."""
    t, p, h = b * x.s, x.p, x.h
    return [
        _memory(2 * t * h * p, x.dtype),
        Operation(kind="gemm", m=t, n=x.v, k=h, dtype=x.dtype, tp_shard="n"),
        _memory(t * x.v * (p + 8), x.dtype, sharded=True),
    ]


#: how attention's score matrix is computed: see :func:`synth_transformer`
ATTENTION_KINDS = ("fused", "materialized")


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


def block_activation_bytes(b: int, s: int, h: int, a: int, p: int, *, dropout: bool = True) -> int:
    """Bytes one Transformer block keeps for backward (Korthikanti et al. 2022, by dtype).

    With dropout and p = 2 this is s·b·h·(34 + 5·a·s/h).
    """
    if dropout:
        return s * b * h * (16 * p + 2) + a * s * s * b * (2 * p + 1)
    return s * b * h * 16 * p + a * s * s * b * p
