"""The module a tensor-parallel unit runs in (needs torch when called):
:func:`tp_unit_class` returns ``_TensorParallelUnit``.

:func:`runtime.tp_apply.apply_tensor_parallel` wraps each sharded unit in it: the unit's tensors
are DTensors over the "tp" mesh and its inputs enter as replicated DTensors (or, sequence-parallel,
split along the sequence), so DTensor's sharding propagation places the collectives; outputs
leave replicated as plain tensors, or stay DTensors when the next unit of the stage takes them so.
"""

from __future__ import annotations

from typing import Any


def tp_unit_class() -> Any:
    """The ``_TensorParallelUnit`` class, defined when called (it imports torch)."""
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
