"""Analytic profiles: fill the profile format from formulas, for models too big to run here.

The formulas for any decoder (grouped-query attention, gated MLPs, RMSNorm, mixtures of experts)
are in :mod:`profiler.decoder`; this module assembles a profile from them.  What follows is the
GPT-3 layout (``synth_transformer``), the case the formulas reduce to.

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
* activations kept for backward, with materialised attention and f = 4h:
  s·b·h·(34 + 5·a·s/h) bytes for 16-bit training (Korthikanti et al. 2022, eq. 1); with fused
  (flash) attention, the default, the a·s²·b terms become flash attention's float32
  log-sum-exp, 4·a·s·b (tensor by tensor in :mod:`profiler.decoder`).  Term by term that is s·b·h·(16p + 2) + a·s²·b·(2p + 1):
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
* selective recompute (Korthikanti et al. 2022), with materialised attention: a block drops attention's softmax, its dropout
  mask and output, a·s²·b·(2p + 1) bytes, and recomputes them (4·b·s²·h FLOPs) in the backward.

The token embedding and the LM head are layers of their own (the head holds the final
LayerNorm and the logits; it keeps the LayerNorm input and output, the token targets and
the float32 log-probabilities of the cross-entropy loss).

``tests/profiler`` checks these formulas against a measured small Transformer
(``examples.gpt``) on CPU: parameter and activation bytes agree within 10 %.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.cost.compute import DeviceConstants, OpTimes, layer_times
from planner.presets import DEVICES, unknown_preset
from planner.schema import LayerProfile, MeasuredOn, MoELayer, Operation, Profile
from profiler.decoder import (
    ATTENTION_KINDS,
    CANONICAL_DTYPE,
    DTYPE_BYTES,
    DecoderSpec,
    MoESpec,
    attention_core,
    block_activation_bytes,
    block_activation_bytes_of,
    block_gemm_flops,
    block_operations_of,
    block_param_count,
    block_replicated_bytes,
    block_tp_param_count,
    block_weight_grad_bytes,
    embedding_operations_of,
    embedding_param_count,
    expert_params,
    head_operations_of,
    head_param_count,
    norm_kept_bytes,
    score_pass_bytes,
)

__all__ = [
    "ATTENTION_KINDS", "DTYPE_BYTES", "DecoderSpec", "MoESpec", "block_activation_bytes", "score_pass_bytes",
    "synth_decoder", "synth_transformer",
]


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
    """A GPT-3-style decoder profile (multi-head attention, LayerNorm, a two-matrix MLP, learned
    positions): :func:`synth_decoder` of that :class:`DecoderSpec`."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {attention!r}: choose one of {', '.join(ATTENTION_KINDS)}")
    spec = DecoderSpec(layers=layers, hidden=hidden, ffn=ffn, heads=heads, seq=seq, vocab=vocab,
                       tied_embeddings=tied_embeddings, dropout=dropout, attention=attention,  # type: ignore[arg-type]
                       name=name)
    return synth_decoder(spec, device_type=device_type, dtype=dtype, mfu=mfu, constants=constants,
                         microbatch_sizes=microbatch_sizes)


def synth_decoder(
    spec: DecoderSpec,
    *,
    device_type: str = "h100-80g",
    dtype: str = "bfloat16",
    mfu: float | None = None,
    constants: DeviceConstants | None = None,
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8),
) -> Profile:
    """A decoder's profile: embedding, ``spec.layers`` blocks, head.

    Times come from the device model (:mod:`planner.cost.compute`): every layer's operation
    census (:mod:`profiler.decoder`, written into the profile) priced on ``device_type`` with
    ``constants`` (default: the device's published defaults).  ``mfu``, when given, prices every
    layer's FLOPs at that one fraction of peak instead (the flat model of profiles before schema
    version 4); the census is written either way.

    ``spec.attention``: ``"fused"`` (the score matrix never reaches memory, as with flash
    attention: the block keeps its log-sum-exp) or ``"materialized"`` (as in Megatron-LM before
    flash attention: the a·s² scores per sample are written to memory and read back by the
    softmax and the dropout, memory-bound passes timed at the device's memory bandwidth, see
    :func:`score_pass_bytes`, and kept for backward; selective recompute drops them).
    """
    if device_type not in DEVICES:
        raise unknown_preset("device_type", device_type, DEVICES)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(sorted(DTYPE_BYTES))}")
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    dtype = CANONICAL_DTYPE.get(dtype, dtype)
    h, s, v = spec.hidden, spec.seq, spec.vocab
    p = DTYPE_BYTES[dtype]
    preset = DEVICES[device_type]
    flops_per_s = preset.peak_flops.get(dtype, preset.peak_flops["float32"]) * (mfu or 1.0)
    membw = preset.memory_bandwidth_bytes_per_s
    sizes = sorted(microbatch_sizes)

    def ms(flops: float) -> float:
        return flops / flops_per_s * 1e3

    def priced(ops: list[Operation]) -> OpTimes:
        return layer_times(ops, device_type=device_type, constants=constants)

    out: list[LayerProfile] = []

    # Embedding: a gather, bound by memory bandwidth; backward scatters into the table.
    emb_ops = [embedding_operations_of(spec, b, dtype) for b in sizes]
    emb_fwd = (
        [(b * s * h * p * 2) / membw * 1e3 for b in sizes] if mfu is not None
        else [priced(ops).forward for ops in emb_ops]
    )
    positions = s * 8 if spec.positions == "learned" else 0  # the position ids
    emb_kept = [b * s * 8 + positions + (b * s * h if spec.dropout else 0) for b in sizes]
    out.append(
        LayerProfile(
            name="embed",
            param_bytes=embedding_param_count(spec) * p,
            forward_ms=emb_fwd,
            backward_ms=[2 * t for t in emb_fwd],
            # token ids have no gradient: the whole backward is the table's (weight) gradient
            backward_input_ms=[0.0 for _ in emb_fwd],
            backward_weight_ms=[2 * t for t in emb_fwd],
            operations=emb_ops,
            weight_grad_bytes=[b * s * 8 + b * s * h * p for b in sizes],
            # token ids, position ids (+ the dropout mask)
            activation_bytes=emb_kept,
            output_bytes=[b * s * h * p for b in sizes],
            kind="Embedding",
            tensor_parallel="vocab-embedding",
            tp_param_bytes=v * h * p,
            tp_forward_bytes=[b * s * h * p for b in sizes],
            tp_backward_bytes=[0 for _ in sizes],
            tp_forward_collectives=1,
            tp_replicated_activation_bytes=emb_kept,
            tp_backward_collectives=0,
            sp_replicated_activation_bytes=[b * s * 8 + positions for b in sizes],
        )
    )
    kinds = [False] if spec.moe is None else sorted({spec.is_moe_block(i) for i in range(spec.layers)})
    blocks = {moe: _block(spec, dtype, sizes, moe=moe, mfu_ms=ms if mfu is not None else None,
                          priced=priced, membw=membw) for moe in kinds}
    for i in range(spec.layers):
        out.append(replace_name(blocks[spec.is_moe_block(i)], f"blocks.{i}"))
    head_ops = [head_operations_of(spec, b, dtype) for b in sizes]
    if mfu is not None:
        head_fwd = [ms(2 * b * s * h * v) for b in sizes]
        head_in, head_wt = head_fwd, head_fwd
    else:
        head_t = [priced(ops) for ops in head_ops]
        head_fwd = [x.forward for x in head_t]
        head_in, head_wt = [x.backward_input for x in head_t], [x.backward_weight for x in head_t]
    # the final norm, the logits' input, the targets (and below the float32 log-probabilities)
    head_whole = [norm_kept_bytes(spec, b * s, p) + b * s * h * p + b * s * 8 for b in sizes]
    out.append(
        LayerProfile(
            name="head",
            param_bytes=head_param_count(spec) * p,
            forward_ms=head_fwd,
            backward_ms=[x + y for x, y in zip(head_in, head_wt, strict=True)],
            backward_input_ms=head_in,
            backward_weight_ms=head_wt,
            operations=head_ops,
            # the norm's input and output, the gradient of the logits
            weight_grad_bytes=[2 * b * s * h * p + b * s * v * p for b in sizes],
            activation_bytes=[w + b * s * v * 4 for w, b in zip(head_whole, sizes, strict=True)],
            output_bytes=[4 for _ in sizes],
            flops=[2 * b * s * h * v for b in sizes],
            kind="LMHead",
            tensor_parallel="column-head",
            tp_param_bytes=0 if spec.tied_embeddings else v * h * p,
            tp_forward_bytes=[2 * b * s * 4 for b in sizes],
            tp_backward_bytes=[b * s * h * p for b in sizes],
            tp_forward_collectives=2,
            tp_backward_collectives=1,
            tp_replicated_activation_bytes=head_whole,
            sp_replicated_activation_bytes=[b * s * 8 for b in sizes],
        )
    )
    return Profile(
        model=spec.name or f"transformer-{spec.layers}l-h{h}",
        measured_on=MeasuredOn(device=f"synthetic:{device_type}", device_name=device_type, dtype=dtype,
                               pricing=_pricing(device_type, mfu, constants)),
        microbatch_sizes=sizes,
        input_bytes=[b * s * 8 for b in sizes],
        layers=out,
        metadata={"synth": _metadata(spec, device_type=device_type, mfu=mfu, constants=constants)},
    )


def replace_name(layer: LayerProfile, name: str) -> LayerProfile:
    return layer.model_copy(update={"name": name})


def _pricing(device_type: str, mfu: float | None, constants: DeviceConstants | None) -> str:
    if mfu is not None:
        return f"flat {mfu:g} of {device_type}'s peak FLOP/s"
    from planner.cost.compute import default_constants

    c = constants or default_constants(device_type)
    return (f"device model {device_type}: gemm efficiency {c.gemm_efficiency:g}, "
            f"memory efficiency {c.memory_efficiency:g}")


def _metadata(spec: DecoderSpec, *, device_type: str, mfu: float | None,
              constants: DeviceConstants | None) -> dict[str, object]:
    meta: dict[str, object] = {
        "kind": "transformer",
        "layers": spec.layers,
        "hidden": spec.hidden,
        "ffn": spec.f,
        "heads": spec.heads,
        "seq": spec.seq,
        "vocab": spec.vocab,
        "mfu": mfu,
        "timing": "flat mfu" if mfu is not None else "device model",
        **({} if constants is None else {"gemm_efficiency": constants.gemm_efficiency,
                                         "memory_efficiency": constants.memory_efficiency}),
        "device_type": device_type,
        "attention": spec.attention,
    }
    if spec.g != spec.heads:
        meta["kv_heads"] = spec.g
    if spec.head_dim is not None:
        meta["head_dim"] = spec.head_dim
    if spec.gated_mlp or spec.norm != "layernorm" or not spec.bias or spec.positions != "learned":
        meta.update(gated_mlp=spec.gated_mlp, norm=spec.norm, bias=spec.bias, positions=spec.positions)
    if spec.tied_embeddings:
        meta["tied_embeddings"] = True
    if spec.moe is not None:
        m = spec.moe
        meta["moe"] = {"experts": m.experts, "top_k": m.top_k, "expert_ffn": m.expert_ffn,
                       "shared_experts": m.shared_experts, "shared_ffn": m.shared_total_ffn,
                       "dense_layers": m.dense_layers, "capacity_factor": m.capacity_factor}
    return meta


def _block(
    spec: DecoderSpec, dtype: str, sizes: list[int], *, moe: bool, mfu_ms: Callable[[float], float] | None,
    priced: Callable[[list[Operation]], OpTimes], membw: float,
) -> LayerProfile:
    """One block's profile (dense, or a mixture of experts)."""
    s, a, h = spec.seq, spec.heads, spec.hidden
    p = DTYPE_BYTES[dtype]
    materialized = spec.attention == "materialized"
    # the attention scores' memory-bound passes (0 when fused), forward and backward
    score_fwd_bytes, score_bwd_bytes = score_pass_bytes(p, dropout=spec.dropout, attention=spec.attention)
    score_fwd = [a * s * s * b * score_fwd_bytes / membw * 1e3 for b in sizes]
    score_bwd = [a * s * s * b * score_bwd_bytes / membw * 1e3 for b in sizes]
    ops = [block_operations_of(spec, b, dtype, moe=moe) for b in sizes]
    flops = [block_gemm_flops(spec, b, moe=moe) for b in sizes]
    if mfu_ms is not None:
        fwd = [mfu_ms(f) + sf for f, sf in zip(flops, score_fwd, strict=True)]
        bwd = [2 * (t - sf) + sb for t, sf, sb in zip(fwd, score_fwd, score_bwd, strict=True)]
        attn_flops = [4 * b * s * s * a * spec.d for b in sizes]
        wgt = [mfu_ms(f - af) for f, af in zip(flops, attn_flops, strict=True)]
        redo = [mfu_ms(af) + sf for af, sf in zip(attn_flops, score_fwd, strict=True)]
        frac = 1.0
    else:
        times = [priced(o) for o in ops]
        fwd = [x.forward for x in times]
        bwd = [x.backward for x in times]
        wgt = [x.backward_weight for x in times]
        # selective recompute re-runs attention's core (and its dropout) in the backward
        redo = [priced(attention_core(o)).forward for o in ops]
        sharded = [priced([op for op in o if op.tp_shard is not None]).forward for o in ops]
        frac = min(1.0, sharded[-1] / fwd[-1]) if fwd[-1] > 0 else 1.0
    moe_mark = None
    if moe and spec.moe is not None:
        m = spec.moe
        moe_mark = MoELayer(
            experts=m.experts, top_k=m.top_k, shared_experts=m.shared_experts,
            expert_param_bytes=expert_params(spec) * p,
            routing="balanced" if m.capacity_factor is None else "capacity",
            capacity_factor=m.capacity_factor,
            dispatch_bytes=[b * s * m.top_k * h * p for b in sizes],
        )
    return LayerProfile(
        name="block",
        param_bytes=block_param_count(spec, moe=moe) * p,
        forward_ms=fwd,
        backward_ms=bwd,
        backward_input_ms=[t - w_ for t, w_ in zip(bwd, wgt, strict=True)],
        backward_weight_ms=wgt,
        weight_grad_bytes=[block_weight_grad_bytes(spec, b, p, moe=moe) for b in sizes],
        activation_bytes=[block_activation_bytes_of(spec, b, p, moe=moe) for b in sizes],
        output_bytes=[b * s * h * p for b in sizes],
        flops=[float(f) for f in flops],
        kind="MoEBlock" if moe else "TransformerBlock",
        tensor_parallel="block",
        tp_param_bytes=block_tp_param_count(spec, moe=moe) * p,
        tp_compute_fraction=frac,
        tp_forward_bytes=[2 * b * s * h * p for b in sizes],
        tp_backward_bytes=[2 * b * s * h * p for b in sizes],
        tp_replicated_activation_bytes=[block_replicated_bytes(spec, b, p, moe=moe) for b in sizes],
        sp_replicated_activation_bytes=[0 for _ in sizes],
        selective_recompute_bytes=(
            [a * s * s * b * ((2 * p + 1) if spec.dropout else p) for b in sizes] if materialized else None),
        selective_recompute_ms=redo if materialized else None,
        operations=ops,
        moe=moe_mark,
    )
