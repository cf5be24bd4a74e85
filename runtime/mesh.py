"""The device mesh of a plan and what each axis does to a stage module (needs torch).

Axes, ordered like torchtitan's: ``("pp", "dp_replicate", "dp_shard", "tp")``; row-major, so
the tensor-parallel ranks of one stage replica are consecutive (one host) and the pipeline
axis is outermost::

    rank = ((k * D_replicate + d_replicate) * D_shard + d_shard) * T + t

ZeRO 0 and 1 put the plan's D on ``dp_replicate`` (``dp_shard`` = 1); ZeRO 2 and 3 on
``dp_shard`` (``dp_replicate`` = 1).  :class:`MeshSpec` computes the coordinates without
torch; :func:`build_mesh` makes the ``DeviceMesh``.

:func:`apply_mesh` turns one stage module (:meth:`profiler.split.SplitModel.stage_module`)
into what the pipeline stage runs, one function per axis in a fixed order:

1. :func:`apply_tensor_parallel` (T > 1): each unit the runtime has a sharding rule for
   (:data:`RULES`: the zoo GPT block, Hugging Face Llama/Qwen2-style decoder layers and
   BERT/ViT-style encoder layers) gets its
   linear weights distributed as DTensors over the "tp" axis,
   Megatron style (column-parallel: ``Shard(0)`` of weight and bias; row-parallel:
   ``Shard(1)`` of the weight, bias replicated), every other tensor of the unit replicated.
   The units are the splitter's flattened graphs (aten operators, not module calls), so the
   styles of ``parallelize_module`` (forward hooks on ``nn.Linear``) would never fire: the
   unit runs on DTensors instead, and DTensor's sharding propagation places the
   collectives (``_TensorParallelUnit``: the unit's inputs enter as replicated DTensors,
   its outputs leave as plain tensors, replicated).  Units without a rule run whole on every
   tensor-parallel rank (their inputs and gradients are replicated, so they stay in step).
   A sharded unit's dropout draws the whole tensor's mask and keeps its shard
   (:func:`whole_dropout`), so it drops what the unsharded model drops.
   With sequence parallelism (the plan's ``sequence_parallel``), Megatron style, for rules
   with a ``sequence_dim`` (every block rule): the unit's graph gets an all-gather along the
   sequence before each column-parallel linear and a reduce-scatter after each row-parallel one
   (:func:`_make_sequence_parallel`; around a ``Conv1D``, which flattens batch and sequence,
   before the view that flattens its input and after the view that restores its output), so its
   norms, dropout and residual adds run on 1/T of the sequence; only the hidden states are split
   on entry (not an attention mask or position bias beside them; T5's decoder blocks also split
   the encoder's output, gathered for the cross-attention's keys and values); consecutive
   sharded units of a stage hand each other sequence shards, and the activations are gathered
   whole where the stage ends or a unit without a rule follows.
2. recompute: the first ``checkpointed_layers`` units of the stage (``StagePlan.checkpointed_layers``)
   each under its own ``torch.utils.checkpoint`` (:func:`runtime.modules.checkpoint_layers`):
   a checkpointed unit keeps only its input and re-runs its forward in the backward, one unit at
   a time, as Megatron-LM, torchtitan and DeepSpeed checkpoint layer by layer.
3. :func:`apply_data_sharding` (ZeRO 2 and 3): FSDP2 ``fully_shard`` over "dp_shard" of each
   layer (unit), then of the stage;
   ``reshard_after_forward`` is ``zero_stage == 3``, forced to False under the split-backward
   schedules (:data:`SPLIT_BACKWARD_SCHEDULES`), which otherwise give wrong gradients.  With
   T > 1 the tensor-parallel DTensors are sharded again over "dp_shard" (2-D, FSDP2 over the
   "tp"-sharded parameters, as torchtitan does).

ZeRO 1 is the optimizer: :func:`make_sharded_optimizer` (``ZeroRedundancyOptimizer`` over
"dp_replicate"; with T > 1, :class:`DTensorZeroOptimizer`, the same scheme for DTensor
parameters).  ZeRO 0 and 1 average the gradients as :func:`gradient_reduction` says: torch's
``DistributedDataParallel`` per stage (:mod:`runtime._ddp`: buckets all-reduced during each
stage's last micro-batch's backward) with T = 1 and a schedule without split backward, else the
runtime's flat all-reduce after the schedule (the reasons are in that function).

:func:`refuse_unexecutable` refuses, before training, a plan with an axis the runtime cannot
execute, naming the layer.  ``torch.distributed.tensor.experimental.implicit_replication``
(an experimental API) is used here only; ``tests/runtime/test_mesh.py`` fails clearly when it
moves.

Each part lives in its own module, and every name stays importable from here:
:mod:`runtime.mesh_spec` (:class:`MeshSpec`, :func:`build_mesh`, :func:`data_mesh`), the
tensor-parallel axis in :mod:`runtime.tp_rules` (the rules and how a unit is recognised),
:mod:`runtime.tp_plan` (the plan's shardings, :func:`refuse_unexecutable`),
:mod:`runtime.tp_apply` (:func:`apply_tensor_parallel`, with :mod:`runtime.tp_unit` and
:mod:`runtime.tp_rewrites`), :mod:`runtime.tp_experts` (MoE blocks' experts),
:mod:`runtime.tp_graph` (where a unit's
graph uses its linears, fused projections split by heads), :mod:`runtime.tp_sequence` (sequence
parallelism), :mod:`runtime.tp_dropout` (the unsharded model's dropout masks) and
:mod:`runtime.vocab_loss` (the vocabulary-parallel loss); the data axis in
:mod:`runtime.zero_fsdp` (FSDP2 for ZeRO 2 and 3, the ZeRO 1 optimizers) and
:mod:`runtime.grad_reduction` (which path averages the gradients, DTensor gradients in the
runtime's collectives); ``--check``'s gathers in :mod:`runtime.check_gather`.  :func:`apply_mesh`,
the order of the axes, is here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from runtime.check_gather import full_gradients, full_parameters, gradient_norms
from runtime.grad_reduction import (
    DEFAULT_BUCKET_MB,
    GradientReduction,
    all_reduce_grad,
    gradient_reduction,
    local_grad,
    reduces_data_gradients,
    squared_grad_norm,
)
from runtime.mesh_spec import MESH_AXES, SPLIT_BACKWARD_SCHEDULES, MeshSpec, build_mesh, data_mesh
from runtime.tp_apply import apply_tensor_parallel, reduce_row_output, replicated_like
from runtime.tp_dropout import attention_whole_dropout, whole_dropout
from runtime.tp_graph import split_fused
from runtime.tp_plan import plan_sharding, refuse_unexecutable, split_sharding, stage_shardings
from runtime.tp_rules import (
    KIND_RULES,
    RULES,
    RULES_WITH_EXPERTS,
    Rule,
    UnitSharding,
    kind_sharding,
    match_rule,
    profiled_kinds,
    unit_sharding,
)
from runtime.tp_rules import _has_grouped_experts as _has_grouped_experts
from runtime.tp_sequence import _make_sequence_parallel as _make_sequence_parallel
from runtime.tp_sequence import _sequence_parallel_problem as _sequence_parallel_problem
from runtime.tp_sequence import (
    gather_sequence,
    scatter_sequence,
    sequence_parallel_note,
    summed_gradient,
)
from runtime.vocab_loss import loss_parallel_context, vocab_parallel_loss
from runtime.zero_fsdp import DTensorZeroOptimizer, apply_data_sharding, make_sharded_optimizer

__all__ = [
    "DEFAULT_BUCKET_MB",
    "KIND_RULES",
    "MESH_AXES",
    "RULES",
    "RULES_WITH_EXPERTS",
    "SPLIT_BACKWARD_SCHEDULES",
    "DTensorZeroOptimizer",
    "GradientReduction",
    "MeshSpec",
    "Rule",
    "UnitSharding",
    "all_reduce_grad",
    "apply_data_sharding",
    "apply_mesh",
    "apply_tensor_parallel",
    "attention_whole_dropout",
    "build_mesh",
    "data_mesh",
    "full_gradients",
    "full_parameters",
    "gather_sequence",
    "gradient_norms",
    "gradient_reduction",
    "kind_sharding",
    "local_grad",
    "loss_parallel_context",
    "make_sharded_optimizer",
    "match_rule",
    "plan_sharding",
    "profiled_kinds",
    "reduce_row_output",
    "reduces_data_gradients",
    "refuse_unexecutable",
    "replicated_like",
    "scatter_sequence",
    "sequence_parallel_note",
    "split_fused",
    "split_sharding",
    "squared_grad_norm",
    "stage_shardings",
    "summed_gradient",
    "unit_sharding",
    "vocab_parallel_loss",
    "whole_dropout",
]


def apply_mesh(
    stage_module: Any,
    spec: MeshSpec,
    mesh: Any,
    *,
    checkpointed_layers: int = 0,
    selective_inputs: Sequence[Sequence[Any]] | None = None,
    shardings: Mapping[int, UnitSharding] | None = None,
    wrap: Callable[[Any], Any] | None = None,
    keep_whole: Iterable[Any] = (),
    sharded_logits: bool = False,
) -> Any:
    """The module a ``PipelineStage`` runs for one stage (``sharded_logits``: it ends the model,
    see :func:`apply_tensor_parallel`): Megatron's selective recompute
    (``selective_inputs``: each unit's example inputs; the units past the checkpointed ones that
    make attention scores get their attention core checkpointed, :mod:`runtime.selective`),
    tensor parallelism (``shardings``,
    unit index within the stage -> sharding, from :func:`plan_sharding`), then recompute (the
    first ``checkpointed_layers`` units each under its own checkpoint), then ``wrap`` (e.g. the
    runtime's autocast), then FSDP2 over the data axis for ZeRO 2 and 3 (of each unit, a
    checkpointed one with its checkpoint inside, as torchtitan shards its checkpointed blocks).
    The stage's parameters keep their qualified names inside the units.  ``keep_whole``: the
    parameters FSDP2 must leave alone (tied across pipeline ranks, see
    :func:`apply_data_sharding`)."""
    from runtime.modules import checkpoint_layers

    mod: Any = stage_module
    if selective_inputs is not None:
        from runtime.selective import recompute_selectively

        recompute_selectively(stage_module, selective_inputs, skip=checkpointed_layers)
    if spec.tensor_parallel_degree > 1 and shardings:
        apply_tensor_parallel(
            stage_module, shardings, mesh["tp"], sequence_parallel=spec.sequence_parallel, sharded_logits=sharded_logits
        )
    if checkpointed_layers:
        checkpoint_layers(stage_module, checkpointed_layers)
    if wrap is not None:
        mod = wrap(mod)
    if spec.zero_stage >= 2 and spec.data_parallel_degree > 1:
        mod = apply_data_sharding(mod, spec, mesh["dp_shard"], units=stage_module.units, keep_whole=keep_whole)
    return mod
