"""Tensor parallelism's sharding rules and how a unit is recognised by them (part of
:mod:`runtime.mesh`).

:data:`RULES`: the blocks the runtime can shard (the zoo GPT block, Hugging Face Llama/Qwen2-,
Mixtral-, GPT-2-, T5-, BERT- and ViT-style layers), each a :class:`Rule` naming its column- and
row-parallel linears; :func:`match_rule` finds the one block of a unit.  Embeddings and heads the
profiler priced sharded are found by their kind (:data:`KIND_RULES`, :func:`kind_sharding`).
What a rule makes of a unit is a :class:`UnitSharding`; :func:`unit_sharding` picks the way by
the profile's kind (:func:`profiled_kinds`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """How one kind of block shards: parameter-name suffixes of its column- and row-parallel
    linears (the module path inside the block, e.g. ``attn.qkv``), and how to recognise it."""

    name: str
    column: tuple[str, ...]
    row: tuple[str, ...]
    #: the sequence dimension of the block's activations, for sequence parallelism (None: the
    #: runtime does not run this block sequence-parallel)
    sequence_dim: int | None = None
    #: the projections are transposed linears (weight ``[in, out]``, Hugging Face's ``Conv1D``)
    transposed: bool = False
    #: fused projections (suffix, parts): the output is ``parts`` projections side by side
    #: (GPT-2's ``c_attn``: Q, K, V), each sharded by heads (:func:`split_fused`)
    fused: tuple[tuple[str, int], ...] = ()
    #: the block routes tokens to experts run as grouped products (:mod:`runtime.tp_experts`
    #: shards them); a rule without it never matches such a block
    experts: bool = False


#: the name of the rule for blocks with routed experts (:data:`RULES`)
RULES_WITH_EXPERTS = "decoder layer with mixture of experts (Mixtral/Qwen2-MoE style)"


#: the blocks the runtime can shard, in the order they are tried
RULES: tuple[Rule, ...] = (
    Rule("zoo GPT block", column=("attn.qkv", "mlp.fc"), row=("attn.proj", "mlp.out"), sequence_dim=1),
    Rule(
        "decoder layer (Llama/Qwen2 style)",
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        row=("self_attn.o_proj", "mlp.down_proj"),
        sequence_dim=1,
    ),
    Rule(
        RULES_WITH_EXPERTS,
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        row=("self_attn.o_proj",),
        sequence_dim=1,
        experts=True,
    ),
    Rule(
        "encoder layer (BERT style)",
        column=("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
        row=("attention.output.dense", "output.dense"),
        sequence_dim=1,
    ),
    Rule(
        "GPT-2 block (Hugging Face Conv1D)",
        column=("attn.c_attn", "mlp.c_fc"),
        row=("attn.c_proj", "mlp.c_proj"),
        sequence_dim=1,
        transposed=True,
        fused=(("attn.c_attn", 3),),
    ),
    Rule(
        "T5 encoder block",
        column=("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
                "layer.1.DenseReluDense.wi"),
        row=("layer.0.SelfAttention.o", "layer.1.DenseReluDense.wo"),
        sequence_dim=1,
    ),
    Rule(
        "T5 decoder block",
        column=("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
                "layer.1.EncDecAttention.q", "layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v",
                "layer.2.DenseReluDense.wi"),
        row=("layer.0.SelfAttention.o", "layer.1.EncDecAttention.o", "layer.2.DenseReluDense.wo"),
        sequence_dim=1,
    ),
    Rule(
        "encoder layer (ViT style)",
        column=("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
        row=("attention.o_proj", "mlp.fc2"),
        sequence_dim=1,
    ),
)


@dataclass(frozen=True)
class UnitSharding:
    """What a rule makes of one unit: the qualified module names of its column- and
    row-parallel linears (inside the unit)."""

    rule: str
    column: tuple[str, ...]
    row: tuple[str, ...]
    sequence_dim: int | None = None
    #: embedding tables sharded along the vocabulary (``Shard(0)``; a vocabulary-parallel embedding)
    vocab: tuple[str, ...] = ()
    #: the linears (of column and row) whose weight is ``[in, out]`` (``Conv1D``): sharded on the
    #: other dimension (column: weight ``Shard(1)``, bias ``Shard(0)``; row: weight ``Shard(0)``)
    transposed: tuple[str, ...] = ()
    #: fused column-parallel linears -> how many projections side by side, each sharded by heads
    fused: tuple[tuple[str, int], ...] = ()
    #: the mixture-of-experts modules (``model.layers.0.mlp``) whose experts :mod:`runtime.tp_experts` shards
    experts: tuple[str, ...] = ()

    def features(self, linears: Mapping[str, tuple[int, int]], name: str) -> tuple[int, int]:
        """``(out, in)`` features of linear ``name`` (``linears``: :func:`_linear_modules`)."""
        a, b = linears[name]
        return (b, a) if name in self.transposed else (a, b)


def _linear_modules(unit: Any) -> dict[str, tuple[int, int]]:
    """Qualified names of the modules holding a 2-D ``weight`` -> its ``(out, in)`` shape."""
    out = {}
    for name, mod in unit.named_modules():
        w = mod._parameters.get("weight") if hasattr(mod, "_parameters") else None
        if w is not None and w.dim() == 2:
            out[name] = (int(w.shape[0]), int(w.shape[1]))
    return out


def match_rule(unit: Any) -> UnitSharding | None:
    """The sharding of a unit (one layer of the split) when exactly one block of a known kind
    is in it: every linear a rule names found under one common prefix."""
    from runtime.tp_experts import moe_blocks

    linears = _linear_modules(unit)
    moe = _has_grouped_experts(unit)
    for rule in RULES:
        if rule.experts != moe:
            continue
        prefixes = {name[: -len(suffix)] for name in linears for suffix in rule.column[:1] if name.endswith(suffix)}
        for prefix in sorted(prefixes):
            col = tuple(prefix + s for s in rule.column)
            row = tuple(prefix + s for s in rule.row)
            if all(n in linears for n in col + row):
                return UnitSharding(
                    rule.name,
                    col,
                    row,
                    rule.sequence_dim,
                    transposed=col + row if rule.transposed else (),
                    fused=tuple((prefix + f, parts) for f, parts in rule.fused),
                    experts=moe_blocks(unit) if moe else (),
                )
    return None


def _weights_used_by(unit: Any, op: Any, position: int) -> list[str]:
    """Qualified names (inside the unit) of the modules whose ``weight`` is argument
    ``position`` of an ``op`` call in the unit's graph."""
    graph = getattr(unit, "graph", None)
    if graph is None:
        return []
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is op and len(node.args) > position:
            w = node.args[position]
            if getattr(w, "op", None) == "get_attr" and str(w.target).endswith(".weight"):
                out.append(str(w.target)[: -len(".weight")])
    return out


#: the units the profiler prices as sharded that are not blocks: kind -> the runtime's name for it
KIND_RULES = {"vocab-embedding": "vocabulary-parallel embedding", "column-head": "column-parallel head"}


def kind_sharding(unit: Any, kind: str) -> UnitSharding | None:
    """The sharding of a unit the profiler priced as a ``vocab-embedding`` (its largest table,
    the one ``aten.embedding`` reads, sharded along the vocabulary: each rank looks up its rows,
    the partial embeddings are summed on the way out) or a ``column-head`` (its widest linear
    column-parallel: each rank computes its share of the vocabulary's logits, gathered on the
    way out; the input gradient's partial sums are summed on the way back); None when the
    unit's graph has no such call."""
    import torch

    linears = _linear_modules(unit)
    if kind == "vocab-embedding":
        tables = [n for n in _weights_used_by(unit, torch.ops.aten.embedding.default, 0) if n in linears]
        if not tables:
            return None
        widest = max(tables, key=lambda n: linears[n][0] * linears[n][1])
        return UnitSharding(KIND_RULES[kind], column=(), row=(), vocab=(widest,))
    if kind == "column-head":
        heads = [n for n in _weights_used_by(unit, torch.ops.aten.linear.default, 1) if n in linears]
        if not heads:
            return None
        return UnitSharding(KIND_RULES[kind], column=(max(heads, key=lambda n: linears[n][0]),), row=())
    return None


def unit_sharding(unit: Any, kind: str | None) -> UnitSharding | None:
    """How the runtime shards one unit the profile calls ``kind`` (None: unknown, a block rule
    is tried): a block by its rule (:func:`match_rule`), an embedding or head by its kind
    (:func:`kind_sharding`), a replicated unit not at all."""
    if kind == "replicated":
        return None
    if kind in KIND_RULES:
        return kind_sharding(unit, kind)
    return match_rule(unit)


def profiled_kinds(split: Any) -> list[str]:
    """How the profiler classified each unit of ``split`` for tensor parallelism (the
    ``LayerProfile.tensor_parallel`` kind the planner priced, :mod:`profiler.sharding`), by the
    same test as the profiler (:func:`profiler.sharding.own_modules`)."""
    from profiler.sharding import own_modules, tensor_parallel_fields

    out = []
    for module in own_modules(split):
        kind = "replicated"
        if module is not None:
            kind = tensor_parallel_fields(module, {"output_bytes": [0], "activation_bytes": [0]}, [0]).get(
                "tensor_parallel", "replicated"
            )
        out.append(kind)
    return out


def _has_grouped_experts(unit: Any) -> bool:
    """True when a unit's graph runs experts as grouped products (:mod:`runtime.experts`)."""
    graph = getattr(unit, "graph", None)
    return graph is not None and any(n.op == "call_function" and "grouped_mm" in str(n.target) for n in graph.nodes)
