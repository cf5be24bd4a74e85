"""Tensor parallelism applied to a stage's units (part of :mod:`runtime.mesh`):
:func:`apply_tensor_parallel`.

Each unit with a sharding has its linear weights distributed as DTensors over the "tp" axis,
Megatron style (column-parallel: ``Shard(0)`` of weight and bias; row-parallel: ``Shard(1)`` of
the weight, bias replicated), every other tensor replicated.  The units are the splitter's
flattened graphs, so the unit runs on DTensors (``_TensorParallelUnit``, :func:`_tp_unit_class`)
and DTensor's sharding propagation places the collectives; the graph is prepared first (torch
export's metadata asserts dropped, the unsharded model's dropout masks:
:mod:`runtime.tp_dropout`, fused projections split by heads: :mod:`runtime.tp_graph`, replicated
embedding indices) and each row-parallel output summed right after its linear
(:func:`reduce_row_output`), or, sequence-parallel, reduce-scattered (:mod:`runtime.tp_sequence`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.tp_dropout import _whole_randomness
from runtime.tp_graph import _linear_sites, _split_fused_by_heads
from runtime.tp_rules import KIND_RULES, UnitSharding
from runtime.tp_sequence import _make_sequence_parallel


def _tp_unit_class() -> Any:
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class _TensorParallelUnit(nn.Module):
        """Runs a unit whose tensors are DTensors over the "tp" mesh: plain inputs enter as
        replicated DTensors (their gradients are summed over the group on the way back),
        integer inputs too; outputs leave replicated, as plain tensors.

        Sequence-parallel (``sequence_dim`` set): the inputs at ``split_inputs`` (the hidden
        states; the others, such as attention masks and rotary tables, stay replicated) are split
        along the sequence on entry (each rank keeps its slice, no communication); DTensor inputs
        (from the previous sequence-parallel unit of the stage) enter as they are.  With
        ``keep_sharded`` (the next unit of the stage is sequence-parallel too) the outputs stay
        DTensors, sharded along the sequence; else they are gathered and leave whole."""

        def __init__(
            self,
            inner: nn.Module,
            mesh: Any,
            *,
            sequence_dim: int | None = None,
            split_inputs: tuple[int, ...] = (0,),
            keep_sharded: bool = False,
        ) -> None:
            super().__init__()
            self.inner = inner
            self.tp_mesh = mesh
            self.sequence_dim = sequence_dim
            self.split_inputs = split_inputs
            self.keep_sharded = keep_sharded

        def _enter(self, a: Any, *, split: bool) -> Any:
            if not isinstance(a, torch.Tensor) or isinstance(a, DTensor):
                return a
            d = DTensor.from_local(a, self.tp_mesh, [Replicate()], run_check=False)
            seq = self.sequence_dim
            if split and seq is not None and a.is_floating_point() and a.dim() > seq:
                d = d.redistribute(self.tp_mesh, [Shard(seq)])  # a local slice: no communication
            return d

        def forward(self, *args: Any) -> Any:
            xs = tuple(self._enter(a, split=i in self.split_inputs) for i, a in enumerate(args))
            # constants the graph makes (masks, positions) are replicated; fused attention runs
            # as its math composition, which DTensor shards by heads (it has no sharding rule for
            # the CPU flash kernel, and deriving one by decomposition takes minutes)
            with implicit_replication(), sdpa_kernel(SDPBackend.MATH):
                out = self.inner(*xs)
            if self.keep_sharded:
                return tuple(out)
            return tuple(
                o.redistribute(self.tp_mesh, [Replicate()]).to_local() if isinstance(o, DTensor) else o for o in out
            )

    return _TensorParallelUnit


def _drop_metadata_asserts(unit: Any) -> None:
    """Remove ``aten._assert_tensor_metadata`` checks from a unit's graph: torch.export adds them
    (dtype/device asserts, no output) and DTensor has no sharding rule for them."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return
    target = torch.ops.aten._assert_tensor_metadata.default
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is target and not n.users]
    for n in nodes:
        graph.erase_node(n)
    if nodes:
        unit.recompile()


def replicated_like(x: Any, like: Any) -> Any:
    """``x`` as a replicated DTensor on ``like``'s mesh when ``like`` is a DTensor and ``x`` a plain
    tensor (:func:`_replicated_lookups`); otherwise ``x``."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(like, DTensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return x


def _replicated_lookups(unit: Any) -> None:
    """The indices of each ``aten.embedding`` in a sharded unit's graph enter as replicated
    DTensors (:func:`replicated_like`): indices the graph computes itself (T5's relative-position
    buckets, from ``arange``) are plain tensors, which ``implicit_replication`` lets through in
    the forward but not in the backward, where ``embedding_dense_backward`` refused the mix."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.embedding.default]
    for node in nodes:
        with graph.inserting_before(node):
            idx = graph.call_function(replicated_like, (node.args[1], node.args[0]))
        node.args = (node.args[0], idx, *node.args[2:])
    if nodes:
        graph.lint()
        unit.recompile()


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

    cls = _tp_unit_class()
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

        _drop_metadata_asserts(unit)
        _whole_randomness(unit)
        _split_fused_by_heads(unit, fused)
        _replicated_lookups(unit)
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
            _reduce_row_outputs(unit, sharding)
            last_head = sharded_logits and sharding.rule == KIND_RULES["column-head"] and i == len(stage_module.units) - 1
            stage_module.units[i] = cls(unit, tp_mesh, keep_sharded=last_head)
    return stage_module


def reduce_row_output(y: Any) -> Any:
    """Megatron's row-parallel ``g``: a row-parallel linear's partial sums, summed (all-reduce;
    its gradient passes through).  Called from a unit's graph after each row-parallel linear."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(y, DTensor) or all(p.is_replicate() for p in y.placements):
        return y
    return y.redistribute(y.device_mesh, [Replicate()] * y.device_mesh.ndim)


def _reduce_row_outputs(unit: Any, sharding: UnitSharding) -> None:
    """Sum each row-parallel linear's output right after it (:func:`reduce_row_output`), as
    Megatron does.  Left to itself, DTensor carries the partial sums on through the residual
    add and the next norm (measured on ``examples.hf:llama``), and the next column-parallel
    linear then all-gathers its weight instead of sharding its output: the MLP ran unsharded,
    with 12 redistributions per layer and micro-batch.  A unit whose row-parallel weights are not
    each used by exactly one ``aten.linear`` is left to DTensor."""
    row = _linear_sites(unit, [f"{n}.weight" for n in sharding.row], transposed=set(sharding.transposed))
    if isinstance(row, str):
        return
    graph = unit.graph
    for node in row:
        with graph.inserting_after(node):
            summed = graph.call_function(reduce_row_output, (node,))
        node.replace_all_uses_with(summed, delete_user_cb=lambda user, s=summed: user is not s)
    graph.lint()
    unit.recompile()
