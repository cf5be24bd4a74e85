"""Megatron's sequence parallelism on a sharded unit's graph (part of
:mod:`runtime.mesh`).

:func:`_make_sequence_parallel` puts an all-gather along the sequence (:func:`gather_sequence`)
before each column-parallel linear and a reduce-scatter (:func:`scatter_sequence`) after each
row-parallel one (around a ``Conv1D``, which flattens batch and sequence, before the view that
flattens its input and after the view that restores its output: :func:`_flattening_views`), so
norms, dropout and residual adds run on 1/T of the sequence; the replicated parameters used there
get summed gradients (:func:`summed_gradient`).  :func:`_sequence_sites` finds where, or why not
(:func:`_sequence_parallel_problem`); :func:`sequence_parallel_note` is the report's line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planner.errors import InputError
from runtime.graph_edit import redirect_users
from runtime.mesh_spec import MeshSpec
from runtime.tp_graph import _RESHAPES, _linear_sites
from runtime.tp_rules import UnitSharding


def _sequence_parallel_problem(unit: Any, sharding: UnitSharding) -> str:
    """Why ``unit`` cannot run sequence-parallel (empty: it can)."""
    sites = _sequence_sites(unit, sharding)
    return sites if isinstance(sites, str) else ""


def _sequence_sites(unit: Any, sharding: UnitSharding) -> tuple[list[Any], list[Any]] | str:
    """Where sequence parallelism rewrites a unit's graph, or why it cannot: the nodes whose
    first argument (the activation entering a column-parallel linear) is gathered along the
    sequence, and the nodes whose output (a row-parallel linear's) is reduce-scattered along it.
    A linear's ``aten.linear`` node for both; a transposed one's (``Conv1D``) flattens batch and
    sequence around its ``aten.addmm`` (:func:`_flattening_views`): the gather goes before the
    view that flattens its input, the reduce-scatter after the view that restores its output."""
    if sharding.sequence_dim is None:
        return "the runtime has no sequence-parallel rule for this kind of layer"
    transposed = set(sharding.transposed)
    out: list[list[Any]] = []
    for names, end in ((sharding.column, 0), (sharding.row, 1)):
        sites = _linear_sites(unit, [f"{n}.weight" for n in names], transposed=transposed)
        if isinstance(sites, str):
            return sites
        nodes = []
        for name, node in zip(names, sites, strict=True):
            views = _flattening_views(node, name, sharding.sequence_dim) if name in transposed else (node, node)
            if isinstance(views, str):
                return views
            nodes.append(views[end])
        out.append(nodes)
    return out[0], out[1]


def _flattening_views(addmm: Any, name: str, sequence_dim: int) -> tuple[Any, Any] | str:
    """The views around a transposed linear's ``aten.addmm`` (Hugging Face ``Conv1D.forward``:
    ``x.view(-1, x.size(-1))``, then ``.view(size_out)``): ``(the view flattening its input, the
    one view of its output)``, or why they are not there."""
    before, users = addmm.args[1], list(addmm.users)
    after = users[0] if len(users) == 1 else None
    if (
        getattr(before, "op", None) != "call_function"
        or str(before.target) not in _RESHAPES
        or after is None
        or after.op != "call_function"
        or str(after.target) not in _RESHAPES
        or not isinstance(after.args[1], (list, tuple))
        or len(after.args[1]) <= sequence_dim
    ):
        return (
            f"{name}'s aten.addmm is not between a view flattening its input and one view restoring the "
            f"sequence dimension {sequence_dim} of its output (Conv1D's x.view(-1, x.size(-1)) ... .view(size_out))"
        )
    return before, after


def gather_sequence(x: Any) -> Any:
    """Megatron's sequence-parallel ``g``: the whole sequence of a sequence-sharded DTensor
    (all-gather; its gradient is reduce-scattered back).  Called from a unit's graph before each
    column-parallel linear."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor) or all(p.is_replicate() for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)


def scatter_sequence(y: Any, dim: int) -> Any:
    """Megatron's sequence-parallel ``g-bar``: a row-parallel linear's partial sums, summed
    and left sharded along the sequence dimension ``dim`` (reduce-scatter; its gradient is
    all-gathered).  Called from a unit's graph after each row-parallel linear."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(y, DTensor):
        return y
    return y.redistribute(y.device_mesh, [Shard(dim)] * y.device_mesh.ndim)


def summed_gradient(w: Any) -> Any:
    """``w`` (a replicated DTensor parameter) as it is, whose gradient is summed over its mesh on
    the way back: used on sequence shards (a norm's weight), each rank's gradient is a partial
    sum, and the parameter's must be replicated like the parameter (Megatron all-reduces these
    gradients over the tensor-parallel group).  ``from_local``'s backward sums a partial
    gradient into the forward's placements; ``to_local``'s hands it on as the parameter's."""
    from torch.distributed.tensor import DTensor

    if not isinstance(w, DTensor):
        return w
    return DTensor.from_local(w.to_local(), w.device_mesh, w.placements, run_check=False)


def _make_sequence_parallel(unit: Any, sharding: UnitSharding) -> tuple[int, ...]:
    """Rewrite a unit's graph for sequence parallelism: the activation entering each
    column-parallel linear is gathered along the sequence (:func:`gather_sequence`, once per
    activation however many linears read it), the output of each row-parallel linear
    reduce-scattered along it (:func:`scatter_sequence`); everything between (norms, dropout,
    residual adds) then runs on sequence shards, and the replicated parameters used there get
    summed gradients (:func:`summed_gradient`).  Returns the positions of the unit's inputs the
    gathered activations are computed from (:func:`_sequence_inputs`): the ones to split."""
    sites = _sequence_sites(unit, sharding)
    if isinstance(sites, str):
        raise InputError(f"sequence parallelism: {sites}; fix: --no-sequence-parallel")
    column, row = sites
    graph = unit.graph
    _sum_replicated_gradients(unit)
    gathered: dict[Any, Any] = {}
    for node in column:
        source = node.args[0]
        if source in gathered.values():  # a view two transposed linears flatten their input with
            continue
        if source not in gathered:
            with graph.inserting_before(node):
                gathered[source] = graph.call_function(gather_sequence, (source,))
        node.args = (gathered[source], *node.args[1:])
    for node in row:
        with graph.inserting_after(node):
            scattered = graph.call_function(scatter_sequence, (node, sharding.sequence_dim))
        redirect_users(node, scattered)
    graph.lint()
    unit.recompile()
    return _sequence_inputs(graph, list(gathered))


def _sum_replicated_gradients(unit: Any) -> None:
    """Route each replicated DTensor parameter of a unit's graph through :func:`summed_gradient`."""
    graph = unit.graph
    params = dict(unit.named_parameters())
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.target in params]:
        p = params[node.target]
        if all(pl.is_replicate() for pl in getattr(p, "placements", ())) and hasattr(p, "placements"):
            with graph.inserting_after(node):
                summed = graph.call_function(summed_gradient, (node,))
            redirect_users(node, summed)


def _sequence_inputs(graph: Any, activations: Sequence[Any]) -> tuple[int, ...]:
    """Positions (among the graph's placeholders) of the inputs ``activations`` are computed
    from along the sequence-sharded stream: the walk back stops at each reduce-scatter, so what
    only reaches them through attention or an MLP (masks, rotary tables, position biases) is not
    counted.  The hidden states, wherever they sit (GPT-2's blocks take the mask first)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    seen, todo = set(), list(activations)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            if node.target not in (scatter_sequence, gather_sequence):
                todo.extend(node.all_input_nodes)
    return tuple(i for i, n in enumerate(placeholders) if n in seen)


def sequence_parallel_note(spec: MeshSpec, layers: int) -> str:
    """What sequence parallelism shards at run time, for the report's mesh note."""
    t = spec.tensor_parallel_degree
    return (
        f"sequence parallelism on the {layers} tensor-parallel layer(s): their norms, dropout and residual adds "
        f"run on 1/{t} of the sequence (all-gather along it before each column-parallel linear, reduce-scatter "
        "after each row-parallel one); consecutive such layers of a stage pass sequence shards, gathered whole "
        "at the stage's end and before a layer without a rule"
    )
