"""Context parallelism, axis C: each device of a context-parallel group holds s/C of every sequence.

Priced, like tensor parallelism (:mod:`planner.mesh`), as a transformation of each layer into
what one device of the group runs and holds (:func:`context_layer`); the T x C devices of a
tensor- and context-parallel group then act as one virtual device of the D x K problem.

* **Work.** Every operation of a layer's census runs on s/C of the tokens: a GEMM's m, a memory-
  bound kernel's bytes and attention's queries divide by C (rounded up); attention's keys stay
  whole, and a causal mask's work divides evenly because the sequence is cut into 2C chunks and
  device i holds chunks i and 2C-1-i (Llama 3, Dubey et al. 2024, §3.3.2; torch's
  ``context_parallel`` does the same, "load-balanced" sharding).  The device model prices both
  (:func:`planner.cost.compute.layer_times`); a layer without a census divides its time by C.
* **Keys and values.** Attention needs every key and value of the sequence:

  - ``all-gather`` (Llama 3): the layer all-gathers K and V before attention (forward), and
    reduce-scatters their gradients (backward), both on the critical path; the gathered K and V,
    (C-1)/C of the sequence's, are kept for the backward;
  - ``ring`` (torch's ``context_parallel``, ring attention): the K/V shards travel around the
    group in C-1 steps while each device computes attention on the shard it holds, so the pass
    hides behind attention's compute: the layer pays ``max(0, pass - attention)`` forward and
    ``max(0, 2 pass - attention's backward)`` backward (K/V, then their gradients); nothing
    gathered is kept.

  The bytes are 2·b·s·g·d·p for g key/value heads of d dims (``Operation.kv_heads``; absent: the
  query heads), divided by T when tensor parallelism shards heads; a ring pass moves the same
  bytes in the same steps as the all-gather (:func:`planner.cost.collectives.all_gather_ms`).
* **Memory.** Activations, the bytes crossing a cut and those held for the weight gradient
  divide by C; parameters (and their gradients and optimizer state) are replicated over C, and
  the gradients are reduced over the group once per step (:func:`context_gradient_ms`), before
  the data-parallel reduction (a two-level reduction: C inside, then D).

The group is C devices T apart (tensor parallelism innermost), all T such groups of a node
communicating at once.  C must divide the sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from planner.cost.collectives import (
    Group,
    all_gather_ms,
    all_reduce_ms,
    group_on,
    reduce_scatter_ms,
)
from planner.cost.compute import DTYPE_BYTES, layer_times
from planner.errors import InputError
from planner.schema import Cluster, LayerProfile, Operation, Profile

#: how attention sees the whole sequence's keys and values under context parallelism
CONTEXT_ATTENTION = ("all-gather", "ring")


def materialised_attention(ops: Sequence[Operation]) -> list[tuple[Operation, Operation]]:
    """Attention a census records as what it runs (``softmax(q @ k^T) @ v``: the zoo GPT, Hugging
    Face's eager attention): the pairs of batched GEMMs ``q @ k^T`` (``batch`` = b·heads,
    ``m`` = ``n`` = the sequence, ``k`` = the head width) and ``scores @ v`` (the same batch and
    ``m``, ``k`` = the sequence, ``n`` = the head width) that follow it."""
    out = []
    for i, a in enumerate(ops):
        if a.kind != "gemm" or a.expert or (a.batch or 1) < 2 or not a.m or a.m != a.n:
            continue
        b = next((x for x in ops[i + 1:] if x.kind == "gemm" and x.batch == a.batch and x.m == a.m
                  and x.k == a.n and x.n == a.k), None)
        if b is not None:
            out.append((a, b))
    return out


def sequence_length(profile: Profile) -> int | None:
    """The profile's sequence length: its attention operations' query length (the longest, fused
    or :func:`materialised_attention`), else synth's metadata; None when none says."""
    best = 0
    for layer in profile.layers:
        ops = (layer.operations or [[]])[0]
        for op in ops:
            if op.kind == "attention" and op.query_len:
                best = max(best, op.query_len)
        for scores, _ in materialised_attention(ops):
            best = max(best, scores.m or 0)
    if best:
        return best
    seq = profile.metadata.get("synth", {}).get("seq") if isinstance(profile.metadata.get("synth"), dict) else None
    return seq if isinstance(seq, int) and seq > 0 else None


def check_context(profile: Profile, c: int, mode: str) -> None:
    """Refuse a context-parallel degree the profile cannot take, with the fix."""
    if c < 1:
        raise InputError(f"--context-parallel must be >= 1, got {c}")
    if mode not in CONTEXT_ATTENTION:
        raise InputError(f"unknown context-parallel attention {mode!r}: choose one of {', '.join(CONTEXT_ATTENTION)}")
    if c == 1:
        return
    s = sequence_length(profile)
    if s is None:
        raise InputError(
            f"--context-parallel {c} needs the profile's sequence length: it has no attention operations in its "
            "census (profile it with this pipeplan, or synth it) — or drop --context-parallel"
        )
    if s % (2 * c) and s % c:
        raise InputError(f"--context-parallel {c} does not divide the sequence length {s}: use a divisor of {s}")


def context_group(cluster: Cluster, t: int, c: int) -> Group:
    """The C devices of a context-parallel group, T apart, the T groups of a node at once."""
    return group_on(cluster, c, stride=t, concurrent=min(t, max(1, cluster.num_devices // c)))


def _shard_tokens(op: Operation, c: int) -> Operation:
    """What one device of a context-parallel group of ``c`` runs of ``op``."""
    if op.kind == "gemm":
        return op.model_copy(update={"m": max(1, math.ceil((op.m or 1) / c))})
    if op.kind == "attention":
        return op.model_copy(update={"query_len": max(1, math.ceil((op.query_len or 1) / c))})
    nbytes = op.bytes or 0
    return op.model_copy(update={"bytes": math.ceil(nbytes / c) if nbytes else 0})


def kv_bytes(ops: Sequence[Operation], t: int) -> int:
    """Bytes of the keys and values of the whole sequence one device of a tensor-parallel group
    of ``t`` needs for its attention operations (2·b·s·g·d·p each; materialised attention's
    from its ``q k^T`` GEMM, whose batch is sequences x heads: divided by ``t`` where the
    profiler marked it ``heads``, whole where its GEMMs do not say which heads a group divides)."""
    total = 0
    for op in ops:
        if op.kind != "attention":
            continue
        heads = op.kv_heads or op.heads or 1
        if op.tp_shard == "heads" and t > 1:
            heads = math.ceil(heads / t)
        total += 2 * op.batch * (op.key_len or 0) * heads * (op.head_dim or 0) * DTYPE_BYTES.get(op.dtype, 2) * op.count
    for scores, _ in materialised_attention(ops):  # (every head's, as its batch)
        batch = scores.batch or 1
        if scores.tp_shard == "heads" and t > 1:
            batch = math.ceil(batch / t)
        total += 2 * batch * (scores.n or 0) * (scores.k or 0) * DTYPE_BYTES.get(scores.dtype, 2) * scores.count
    return total


@dataclass(frozen=True)
class _ContextScales:
    """Of one census under context parallelism: the K/V bytes, and (priced on a device) the
    local / whole time ratios and the local attention's times."""

    kv: int
    forward: float | None = None
    backward_input: float = 0.0
    backward_weight: float = 0.0
    attention_forward: float = 0.0
    attention_backward: float = 0.0


#: :class:`_ContextScales` by the identities of a census's operations (with them, to check the
#: identities still name them), C, T, sequence parallelism and the device: synth's identical
#: blocks share their operation objects, so a stack is priced once
ContextMemo = dict[tuple[Any, ...], tuple[tuple[Operation, ...], _ContextScales]]


def _context_scales(
    ops: Sequence[Operation], c: int, *, t: int, sequence_parallel: bool, device: str | None
) -> _ContextScales:
    kv = kv_bytes(ops, t)
    if device is None:
        return _ContextScales(kv)
    whole = layer_times(ops, device_type=device, tensor_parallel=t, sequence_parallel=sequence_parallel)
    local_ops = [_shard_tokens(op, c) for op in ops]
    local = layer_times(local_ops, device_type=device, tensor_parallel=t, sequence_parallel=sequence_parallel)
    attn = layer_times([o for o in local_ops if o.kind == "attention"], device_type=device,
                       tensor_parallel=t, sequence_parallel=sequence_parallel)

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 1 / c

    return _ContextScales(
        kv, ratio(local.forward, whole.forward), ratio(local.backward_input, whole.backward_input),
        ratio(local.backward_weight, whole.backward_weight), attn.forward, attn.backward_input,
    )


def context_layer(
    layer: LayerProfile,
    census: LayerProfile,
    c: int,
    *,
    t: int,
    sequence_parallel: bool,
    cluster: Cluster,
    device: str | None,
    mode: str = "all-gather",
    memo: ContextMemo | None = None,
) -> LayerProfile:
    """What one device of a context-parallel group of ``c`` runs and holds of ``layer`` (already
    one tensor-parallel rank's, :mod:`planner.mesh`); ``census`` is the profile's own layer (its
    operations), ``device`` the device preset its census is priced on (None: no census pricing,
    times / C).  ``memo`` shares the pricing between layers made of the same operation objects."""
    if c <= 1:
        return layer
    n = len(layer.forward_ms)
    ops_by_size = census.operations
    group = context_group(cluster, t, c)
    fwd_ratio, bwd_ratio, wgt_ratio = [1 / c] * n, [1 / c] * n, [1 / c] * n
    attn_fwd, attn_bwd = [0.0] * n, [0.0] * n
    kv = [0] * n
    if ops_by_size is not None:
        for i, ops in enumerate(ops_by_size):
            key = (*map(id, ops), c, t, sequence_parallel, device)
            seen = memo.get(key) if memo is not None else None
            if seen is None or any(x is not y for x, y in zip(seen[0], ops, strict=True)):
                seen = (tuple(ops), _context_scales(ops, c, t=t, sequence_parallel=sequence_parallel, device=device))
                if memo is not None:
                    memo[key] = seen
            scales = seen[1]
            kv[i] = scales.kv
            if scales.forward is not None:
                fwd_ratio[i], bwd_ratio[i], wgt_ratio[i] = scales.forward, scales.backward_input, scales.backward_weight
                attn_fwd[i], attn_bwd[i] = scales.attention_forward, scales.attention_backward
    comm_f = [all_gather_ms(x, group, cluster) for x in kv]
    comm_b = [reduce_scatter_ms(x, group, cluster) for x in kv]
    if mode == "ring":
        add_f = [max(0.0, cf - a) for cf, a in zip(comm_f, attn_fwd, strict=True)]
        add_b = [max(0.0, 2 * cb - a) for cb, a in zip(comm_b, attn_bwd, strict=True)]
        gathered = [0] * n
    else:
        add_f, add_b = comm_f, comm_b
        gathered = [math.ceil(x * (c - 1) / c) for x in kv]
    bwd_in = layer.backward_input_ms
    bwd_wt = layer.backward_weight_ms
    if bwd_in is None or bwd_wt is None:
        bwd_in = list(layer.backward_ms)
        bwd_wt = [0.0] * n
        wgt_ratio = bwd_ratio
    new_in = [x * r + a for x, r, a in zip(bwd_in, bwd_ratio, add_b, strict=True)]
    new_wt = [x * r for x, r in zip(bwd_wt, wgt_ratio, strict=True)]

    def div(values: Sequence[int] | None) -> list[int] | None:
        return None if values is None else [math.ceil(v / c) for v in values]

    update: dict[str, object] = {
        "forward_ms": [x * r + a for x, r, a in zip(layer.forward_ms, fwd_ratio, add_f, strict=True)],
        "backward_ms": [a + b for a, b in zip(new_in, new_wt, strict=True)],
        "activation_bytes": [math.ceil(x / c) + g for x, g in zip(layer.activation_bytes, gathered, strict=True)],
        "output_bytes": div(layer.output_bytes),
        "cut_bytes": div(layer.cut_bytes),
        "weight_grad_bytes": div(layer.weight_grad_bytes),
        "peak_memory_bytes": div(layer.peak_memory_bytes),
        "flops": None if layer.flops is None else [f / c for f in layer.flops],
        "selective_recompute_bytes": div(layer.selective_recompute_bytes),
        "selective_recompute_ms": None if layer.selective_recompute_ms is None else [
            x * r for x, r in zip(layer.selective_recompute_ms, fwd_ratio, strict=True)],
        "forward_ms_spread": None,
        "backward_ms_spread": None,
    }
    if layer.backward_input_ms is not None and layer.backward_weight_ms is not None:
        update["backward_input_ms"] = new_in
        update["backward_weight_ms"] = new_wt
    if layer.kept_inputs:
        update["kept_inputs"] = [k.model_copy(update={"bytes": [math.ceil(b / c) if b > 0 else -math.ceil(-b / c)
                                                               for b in k.bytes]}) for k in layer.kept_inputs]
    return layer.model_copy(update=update)


def context_gradient_ms(grad_bytes: float, cluster: Cluster, t: int, c: int) -> float:
    """The once-per-step all-reduce of a device's gradients over its context-parallel group."""
    if c <= 1 or grad_bytes <= 0:
        return 0.0
    return all_reduce_ms(grad_bytes, context_group(cluster, t, c), cluster)
