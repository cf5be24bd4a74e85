"""The graph rewrites tensor parallelism makes to a unit besides sharding its parameters
(needs torch when called); :func:`runtime.tp_apply.apply_tensor_parallel` runs them.

Before the parameters are distributed:

* :func:`drop_metadata_asserts`: torch export's ``aten._assert_tensor_metadata`` checks, which
  DTensor has no sharding rule for, removed;
* :func:`replicate_lookup_indices`: each embedding's indices enter as a replicated DTensor
  (:func:`replicated_like`).

After (without sequence parallelism, :mod:`runtime.tp_sequence`):

* :func:`sum_row_outputs`: each row-parallel linear's partial sums summed right after it
  (:func:`reduce_row_output`, Megatron's ``g``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from runtime.graph_edit import redirect_users
from runtime.tp_graph import _linear_sites


def drop_metadata_asserts(unit: Any) -> None:
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
    tensor (:func:`replicate_lookup_indices`); otherwise ``x``."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(like, DTensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return x


def replicate_lookup_indices(unit: Any) -> None:
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


def reduce_row_output(y: Any) -> Any:
    """Megatron's row-parallel ``g``: a row-parallel linear's partial sums, summed (all-reduce;
    its gradient passes through).  Called from a unit's graph after each row-parallel linear."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(y, DTensor) or all(p.is_replicate() for p in y.placements):
        return y
    return y.redistribute(y.device_mesh, [Replicate()] * y.device_mesh.ndim)


def sum_row_outputs(unit: Any, row_linears: Iterable[str], transposed: Iterable[str]) -> None:
    """Sum each row-parallel linear's output right after it (:func:`reduce_row_output`), as
    Megatron does.  Left to itself, DTensor carries the partial sums on through the residual
    add and the next norm (measured on ``examples.hf:llama``), and the next column-parallel
    linear then all-gathers its weight instead of sharding its output: the MLP ran unsharded,
    with 12 redistributions per layer and micro-batch.  A unit whose row-parallel weights are not
    each used by exactly one ``aten.linear`` is left to DTensor.  ``row_linears``: the
    row-parallel linears' module names (``UnitSharding.row``), ``transposed``: those whose weight
    is stored ``[in, out]``."""
    row = _linear_sites(unit, [f"{n}.weight" for n in row_linears], transposed=set(transposed))
    if isinstance(row, str):
        return
    graph = unit.graph
    for node in row:
        with graph.inserting_after(node):
            summed = graph.call_function(reduce_row_output, (node,))
        redirect_users(node, summed)
    graph.lint()
    unit.recompile()
