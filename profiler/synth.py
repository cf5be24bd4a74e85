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
from types import MappingProxyType

from planner.presets import DEVICES, unknown_preset
from planner.schema import LayerProfile, MeasuredOn, Profile

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
    mfu: float = 0.5,
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8),
    tied_embeddings: bool = False,
    name: str | None = None,
    dropout: bool = True,
    attention: str = "fused",
) -> Profile:
    """A GPT-style decoder profile: embedding, ``layers`` blocks, LM head.

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
    if not 0 < mfu <= 1:
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
    flops_per_s = preset.peak_flops.get(dtype, preset.peak_flops["float32"]) * mfu
    membw = preset.memory_bandwidth_bytes_per_s
    sizes = sorted(microbatch_sizes)

    def ms(flops: float) -> float:
        return flops / flops_per_s * 1e3

    block_params = (4 * h * h + 2 * h * f + 9 * h + f) * p
    out: list[LayerProfile] = []

    # Embedding: a gather, bound by memory bandwidth; backward scatters into the table.
    emb_fwd = [ms(0) + (b * s * h * p * 2) / membw * 1e3 for b in sizes]
    out.append(
        LayerProfile(
            name="embed",
            param_bytes=(v * h + s * h) * p,
            forward_ms=emb_fwd,
            backward_ms=[2 * t for t in emb_fwd],
            # token ids have no gradient: the whole backward is the table's (weight) gradient
            backward_input_ms=[0.0 for _ in emb_fwd],
            backward_weight_ms=[2 * t for t in emb_fwd],
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
    for i in range(layers):
        fwd = [ms(2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h) + sf for b, sf in zip(sizes, score_fwd, strict=True)]
        bwd = [2 * (t - sf) + sb for t, sf, sb in zip(fwd, score_fwd, score_bwd, strict=True)]
        wgt = [ms(2 * b * s * (4 * h * h + 2 * h * f)) for b in sizes]
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
                tp_compute_fraction=1.0,
                tp_forward_bytes=[2 * b * s * h * p for b in sizes],
                tp_backward_bytes=[2 * b * s * h * p for b in sizes],
                tp_replicated_activation_bytes=[s * b * h * (4 * p + (2 if dropout else 0)) for b in sizes],
                sp_replicated_activation_bytes=[0 for _ in sizes],
                selective_recompute_bytes=[a * s * s * b * ((2 * p + 1) if dropout else p) for b in sizes],
                selective_recompute_ms=[ms(4 * b * s * s * h) + sf for b, sf in zip(sizes, score_fwd, strict=True)],
            )
        )
    head_fwd = [ms(2 * b * s * h * v) for b in sizes]
    out.append(
        LayerProfile(
            name="head",
            param_bytes=(0 if tied_embeddings else v * h * p) + 2 * h * p,
            forward_ms=head_fwd,
            backward_ms=[2 * t for t in head_fwd],
            backward_input_ms=head_fwd,
            backward_weight_ms=head_fwd,
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
                "device_type": device_type,
                "attention": attention,
            }
        },
    )


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
