"""How each measured unit shards over a tensor-parallel group (Megatron style), for the profile.

The planner prices tensor parallelism from per-layer fields (``LayerProfile.tensor_parallel``
and the ``tp_*`` fields, :mod:`planner.mesh`).  ``pipeplan synth`` fills them from formulas;
this module fills them for the units of a measured model it recognises, from the unit's
modules and its measured bytes:

* a *transformer block*: at least four projections (attention's, the MLP's) and a
  normalisation layer (the zoo's GPT and BERT blocks, Hugging Face decoder and encoder layers).
  A projection is an ``nn.Linear`` or a transposed linear, Hugging Face's ``Conv1D`` (GPT-2:
  weight ``[in, out]``, ``nf`` = out; its fused ``c_attn`` computes Q, K and V, which the runtime
  shards by heads, :mod:`runtime.mesh`) -- recognised by what it holds, without importing
  transformers (:func:`projection_widths`).
  Its linear layers shard (column-parallel, then row-parallel); each forward and backward
  all-reduces the attention and the MLP outputs: 2 x the unit's output bytes; the inputs of its
  normalisations stay whole on every device without sequence parallelism (one output-sized
  tensor each), plus a one-byte mask per element for each of two residual dropouts when it has
  dropout; with sequence parallelism everything shards.  A block holding routed experts (Mixtral,
  Qwen2-MoE) also shards each expert's FFN along its hidden width, the router whole; its
  collectives move attention's output and the MoE module's output once each (the experts'
  partial sums combined first, reduced once), backward also the routing weights' and a shared
  gate's small gradients (:func:`_experts_sharding`, as :mod:`runtime.tp_experts` runs it);
* a *vocabulary-parallel embedding*: an ``nn.Embedding`` and no linear layer: the largest table
  shards, one all-reduce of its output forward; its activations (token ids) stay whole
  (a table tied to the LM head is replicated: see below);
* a *column-parallel LM head*: a unit whose largest ``nn.Linear`` maps to at least four times
  its input width (the vocabulary): that weight shards; the backward all-reduces the input
  gradient (the unit's input bytes); its activations stay whole (conservative);
* anything else is replicated (T divides nothing there, and the plan's notes say so), and so is
  a unit that is more than one module (blocks merged by split points) or shares its weights
  (:func:`own_modules`): the runtime shards exactly the units priced as sharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from profiler._moe_balanced import is_experts_module
from profiler.census import ShardedWeights

#: module class names treated as normalisation layers besides nn.LayerNorm
_NORM_SUFFIXES = ("LayerNorm", "RMSNorm", "Norm")


def module_bytes(module: nn.Module) -> int:
    """Parameter bytes of ``module`` (each tensor once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def own_modules(split: Any) -> list[nn.Module | None]:
    """Per unit of ``split`` (a :class:`profiler.split.SplitModel`), the model's module the unit
    is exactly (same name, same parameter bytes), or None: a unit that is more than its module
    (blocks merged by split points) or shares a weight with another unit (a tied embedding
    and head) stays replicated.  The profiler prices what this finds
    (:func:`tensor_parallel_fields`) and the runtime shards the same units."""
    named = dict(split.model.named_modules())
    param_bytes = split.param_bytes()
    tied = {u for group in split.shared_parameters() for u, _ in group}
    out: list[nn.Module | None] = []
    for i, name in enumerate(split.names):
        module = named.get(name)
        own = module is not None and i not in tied and module_bytes(module) == param_bytes[i]
        out.append(module if own else None)
    return out


def projection_widths(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` features of a projection: an ``nn.Linear``, or a transposed linear (a class
    named ``Conv1D`` with a 2-D ``weight`` of shape ``[in, nf]``, Hugging Face's GPT-2 projections;
    transformers stays an optional dependency); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    w = module._parameters.get("weight")
    nf = getattr(module, "nf", None)
    if type(module).__name__ == "Conv1D" and w is not None and w.dim() == 2 and int(w.shape[1]) == nf:
        return int(w.shape[0]), int(w.shape[1])
    return None


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(_NORM_SUFFIXES)


def _kind(unit: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """How ``unit`` shards (the module docstring): ``("block", its projections)``,
    ``("vocab-embedding", its tables)``, ``("column-head", [its logits projection])``, or None."""
    mods = list(unit.modules())
    linears = [m for m in mods if projection_widths(m) is not None]
    embeds: list[nn.Module] = [m for m in mods if isinstance(m, nn.Embedding)]
    if len(linears) >= 4 and any(_is_norm(m) for m in mods):
        return "block", linears
    if embeds and not linears:
        return "vocab-embedding", embeds
    if linears:
        # an nn.Linear head only: the runtime shards a head's aten.linear (kind_sharding)
        widest = max(linears, key=lambda m: (projection_widths(m) or (0, 0))[1])
        w_in, w_out = projection_widths(widest) or (0, 0)
        if isinstance(widest, nn.Linear) and w_out >= 4 * w_in and len(linears) <= 2:
            return "column-head", [widest]
    return None


def _experts_sharding(
    mods: Sequence[nn.Module], projections: Sequence[nn.Module]
) -> tuple[int, int, float, int] | None:
    """A block holding routed experts, as the runtime shards it (:mod:`runtime.tp_experts`):
    (its tensor-parallel parameter bytes, the outputs its collectives move per forward, the
    outputs they move per backward, its collectives per backward).  Each expert's FFN splits
    along its hidden width, and so does a shared expert's; the router (a projection to one score
    per expert) stays whole.  Forward: attention's output and the MoE module's output, one
    all-reduce each of the block's output size (the routed rows are weighted and combined, and
    the shared expert's output added, on each rank's partial sums, reduced once where they leave;
    under sequence parallelism an all-gather in and a reduce-scatter out each, the same bytes).
    Backward: the same two (the attention's input and the experts' input), plus a small
    all-reduce for the gradient of each replicated factor of a partial sum: the routing weights
    (``top_k`` per token) and a shared expert's gate (one per token), each token's
    ``top_k + shared`` values next to its ``hidden``.  None without routed experts."""
    experts = [m for m in mods if is_experts_module(m)]
    if not experts:
        return None
    count = getattr(experts[0], "num_experts", 0)
    # the router (one score per expert) and a shared expert's gate (one score) stay whole
    routers = [m for m in projections if (projection_widths(m) or (0, 0))[1] in (count, 1)]
    top_k = next((int(v) for m in mods for key in ("top_k", "num_experts_per_tok")
                  if isinstance(v := getattr(m, key, None), int) and v > 0), 1)  # fmt: skip
    shared = any(getattr(m, key, None) is not None for m in mods for key in ("shared_expert", "shared_experts"))
    sharded = sum(module_bytes(m) for m in projections if m not in routers) + sum(module_bytes(e) for e in experts)
    hidden = getattr(experts[0], "hidden_dim", None) or next((w[0] for m in routers if (w := projection_widths(m))), 0)
    factors = (top_k + int(shared)) / hidden if hidden else 0.0
    return sharded, 2, 2 + factors, 3 + int(shared)


def sharded_weights(unit: nn.Module) -> ShardedWeights | None:
    """The weights whose products the census marks with tensor-parallel roles
    (:mod:`profiler.census`): a block's projections, a column-parallel head's logits
    projection; None for a vocabulary-parallel embedding (its lookup writes the whole output on
    every rank: nothing it runs divides), a block holding routed experts (a transformers experts
    module: its census keeps no roles) and a replicated unit.  ``unit`` is the model's own
    module of a layer (:func:`own_modules`)."""
    found = _kind(unit)
    if found is None or found[0] == "vocab-embedding":
        return None
    if any(is_experts_module(m) for m in unit.modules()):
        # a mixture of experts: whether its experts divide over the group is the profile's
        # tp_param_bytes' call (they are not among its projections); its census stays as it was
        # (no roles: the flat efficiency scales the block, planner.mesh.census_prices)
        return None
    kind, modules = found
    weights = tuple(w for m in modules if isinstance(w := m._parameters.get("weight"), nn.Parameter | Tensor))
    return ShardedWeights("block" if kind == "block" else "column-head", weights)


def units_sharded_weights(split: Any) -> list[ShardedWeights | None]:
    """Per unit of ``split``, its :func:`sharded_weights` (None for a unit that is not its own
    module, :func:`own_modules`: replicated)."""
    return [None if m is None else sharded_weights(m) for m in own_modules(split)]


def tensor_parallel_fields(unit: nn.Module, layer: dict[str, Any], input_bytes: Sequence[int]) -> dict[str, Any]:
    """The ``LayerProfile`` tensor-parallel fields of one measured unit (empty: replicated).

    ``layer`` holds the unit's measured lists (``output_bytes``, ``activation_bytes``);
    ``input_bytes`` are the bytes the unit receives per micro-batch size.
    """
    found = _kind(unit)
    if found is None:
        return {}
    kind, modules = found
    out = [int(x) for x in layer["output_bytes"]]
    acts = [int(x) for x in layer["activation_bytes"]]
    n = len(out)
    if kind == "block":
        mods = list(unit.modules())
        norms = [m for m in mods if _is_norm(m)]
        dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in mods)
        elem = next((p.element_size() for p in unit.parameters() if p.is_floating_point()), 4)
        repl = [min(a, len(norms) * o + (2 * o // elem if dropout else 0)) for o, a in zip(out, acts, strict=True)]
        sharded, forward, backward, collectives = sum(module_bytes(m) for m in modules), 2, 2.0, 2
        moe = _experts_sharding(mods, modules)
        if moe is not None:
            sharded, forward, backward, collectives = moe
        fields: dict[str, Any] = {
            "tensor_parallel": "block",
            "tp_param_bytes": sharded,
            "tp_compute_fraction": 1.0,
            "tp_forward_bytes": [forward * o for o in out],
            "tp_backward_bytes": [round(backward * o) for o in out],
            "tp_replicated_activation_bytes": repl,
            "sp_replicated_activation_bytes": [0] * n,
        }
        if moe is not None:  # (a dense block: the schema's default, 2)
            fields["tp_backward_collectives"] = collectives
        return fields
    if kind == "vocab-embedding":
        return {
            "tensor_parallel": "vocab-embedding",
            "tp_param_bytes": max(module_bytes(m) for m in modules),
            "tp_forward_bytes": out,
            "tp_backward_bytes": [0] * n,
            "tp_forward_collectives": 1,
            "tp_backward_collectives": 0,
            "tp_replicated_activation_bytes": acts,
            "sp_replicated_activation_bytes": acts,
        }
    return {
        "tensor_parallel": "column-head",
        "tp_param_bytes": module_bytes(modules[0]),
        "tp_forward_bytes": [0] * n,
        "tp_backward_bytes": [int(x) for x in input_bytes],
        "tp_forward_collectives": 2,
        "tp_backward_collectives": 1,
        "tp_replicated_activation_bytes": acts,
        "sp_replicated_activation_bytes": acts,
    }
