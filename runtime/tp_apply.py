"""Tensor parallelism applied to a stage's units (part of :mod:`runtime.mesh`):
:func:`apply_tensor_parallel`.

Each unit with a sharding has its linear weights distributed as DTensors over the "tp" axis,
Megatron style (column-parallel: ``Shard(0)`` of weight and bias; row-parallel: ``Shard(1)`` of
the weight, bias replicated), every other tensor replicated.  The units are the splitter's
flattened graphs, so the unit runs on DTensors (``_TensorParallelUnit``: :mod:`runtime.tp_unit`)
and DTensor's sharding propagation places the collectives; the graph is prepared first (torch
export's metadata asserts dropped and replicated embedding indices: :mod:`runtime.tp_rewrites`,
the unsharded model's dropout masks: :mod:`runtime.tp_dropout`, fused projections split by
heads: :mod:`runtime.tp_graph`) and each row-parallel output summed right after its linear
(:func:`~runtime.tp_rewrites.reduce_row_output`), or, sequence-parallel, reduce-scattered
(:mod:`runtime.tp_sequence`).  :func:`reduce_row_output` and :func:`replicated_like` stay
importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.tp_dropout import _whole_randomness
from runtime.tp_graph import _split_fused_by_heads
from runtime.tp_rewrites import (
    drop_metadata_asserts,
    reduce_row_output,
    replicate_lookup_indices,
    replicated_like,
    sum_row_outputs,
)
from runtime.tp_rules import KIND_RULES, UnitSharding
from runtime.tp_sequence import _make_sequence_parallel
from runtime.tp_unit import tp_unit_class

__all__ = ["apply_tensor_parallel", "reduce_row_output", "replicated_like"]


def apply_tensor_parallel(
    stage_module: Any,
    shardings: Mapping[int, UnitSharding],
    tp_mesh: Any,
    *,
    sequence_parallel: bool = False,
    sharded_logits: bool = False,
) -> Any:
    """Shard the units of ``stage_module`` (a ``StageModule``) listed in ``shardings`` (by unit
    index *within the stage*) over ``tp_mesh``; returns ``stage_module``.

    ``sequence_parallel``: Megatron's sequence parallelism on top (:func:`_make_sequence_parallel`):
    each sharded unit runs its norms, dropout and residual adds on sequence shards; between two
    consecutive sharded units of the stage the activations stay sequence-sharded DTensors, and
    they are gathered whole where the stage ends or a unit without a rule follows.

    ``sharded_logits`` (the stage ends the model): a column-parallel head that is the stage's last
    unit hands its logits on sharded along the vocabulary (a ``Shard(-1)`` DTensor), for the
    vocabulary-parallel loss (:func:`vocab_parallel_loss`), as Megatron does; else it gathers them."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    from runtime._strided_shard import strided_shard

    cls = tp_unit_class()
    for i, sharding in shardings.items():
        unit = stage_module.units[i]
        column, row = set(sharding.column) | set(sharding.vocab), set(sharding.row)
        transposed, fused = set(sharding.transposed), dict(sharding.fused)
        experts: dict[str, tuple[int, int]] = {}
        if sharding.experts:
            from runtime.tp_experts import layout, localize

            found = layout(unit, sharding.experts, tp_mesh.size())
            experts = found["shards"] if isinstance(found, dict) else {}

        def partition(
            name: str,
            mod: Any,
            mesh: Any,
            column: set[str] = column,
            row: set[str] = row,
            transposed: set[str] = transposed,
            fused: dict[str, int] = fused,
            experts: dict[str, tuple[int, int]] = experts,
        ) -> None:
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if f"{name}.{pname}" in experts:  # an expert's (or shared expert's) hidden width
                    dim, parts = experts[f"{name}.{pname}"]
                    placement: Any = strided_shard(dim, parts) if parts > 1 else Shard(dim)
                elif name in fused:  # [Q | K | V] side by side: each rank its heads of each
                    placement = strided_shard(1 if pname == "weight" and name in transposed else 0, fused[name])
                elif name in column:  # column-parallel linear, or a table sharded along the vocabulary
                    placement = Shard(1 if pname == "weight" and name in transposed else 0)
                elif name in row and pname == "weight":
                    placement = Shard(0 if name in transposed else 1)
                else:
                    placement = Replicate()
                dt = distribute_tensor(p.detach(), mesh, [placement])
                mod.register_parameter(pname, torch.nn.Parameter(dt, requires_grad=p.requires_grad))
            for bname, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[bname] = distribute_tensor(b, mesh, [Replicate()])

        drop_metadata_asserts(unit)
        _whole_randomness(unit)
        _split_fused_by_heads(unit, fused)
        replicate_lookup_indices(unit)
        distribute_module(unit, tp_mesh, partition)
        if sharding.experts:
            seq = sharding.sequence_dim if sequence_parallel else None
            localize(unit, sharding.experts, tp_mesh, sequence_dim=seq)
        if sequence_parallel and sharding.sequence_dim is not None:
            split = _make_sequence_parallel(unit, sharding)
            nxt = shardings.get(i + 1)
            keep = nxt is not None and nxt.sequence_dim is not None and i + 1 < len(stage_module.units)
            stage_module.units[i] = cls(
                unit, tp_mesh, sequence_dim=sharding.sequence_dim, split_inputs=split, keep_sharded=keep
            )
        else:
            sum_row_outputs(unit, sharding.row, sharding.transposed)
            last_head = sharded_logits and sharding.rule == KIND_RULES["column-head"] and i == len(stage_module.units) - 1
            stage_module.units[i] = cls(unit, tp_mesh, keep_sharded=last_head)
    return stage_module
