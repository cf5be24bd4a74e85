"""How the data-parallel gradients are reduced (part of :mod:`runtime.mesh`):
:func:`gradient_reduction` picks the path of a plan (DDP, FSDP2 or the runtime's flat all-reduce,
and why); :func:`all_reduce_grad`, :func:`local_grad`, :func:`reduces_data_gradients` and
:func:`squared_grad_norm` handle DTensor gradients for the runtime's own collectives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from runtime.mesh_spec import SPLIT_BACKWARD_SCHEDULES, MeshSpec

#: ``pipeplan run --dp-bucket-mb``'s default: DDP's own bucket size (MiB)
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class GradientReduction:
    """Which path averages a plan's data-parallel gradients (:func:`gradient_reduction`):
    ``"ddp"`` (torch's ``DistributedDataParallel``: bucketed, overlapped with each stage's last
    backward), ``"fsdp2"`` (ZeRO 2/3: FSDP2's reduce-scatters), ``"all-reduce"`` (the runtime's
    flat all-reduce after the schedule) or ``"none"`` (D = 1); ``why``: the reason a plan with
    D > 1 does not go through DDP."""

    path: str
    why: str = ""


def gradient_reduction(spec: MeshSpec) -> GradientReduction:
    """The path of ``spec``'s data-parallel gradients (expert-parallel weights, E > 1, are
    reduced over their own groups by the runtime whatever the path).

    DDP for ZeRO 0/1 with T = 1 and a schedule without split backward.  The others keep the
    runtime's flat all-reduce, for structural reasons:

    * T > 1: the tensor-parallel weights are DTensors.  DDP takes them only through its 2-D
      path (``device_mesh=`` a slice of the mesh: torch's ``_pre_dp_module_transform``), which
      swaps them for their local shards between forwards and rebuilds DTensors in a forward
      pre-hook, while the runtime's ZeRO 1 optimizer (:class:`DTensorZeroOptimizer`), its
      checkpoints and ``--check`` read the parameters as DTensors (not wired, not measured).
      FSDP2 over a ``dp_replicate`` x ``dp_shard`` mesh (HSDP) takes them as they are, but under
      torch's pipelining FSDP2 reduces in ``perform_reduce_grad`` after the last backward, not
      during it (torch 2.13: ``PipelineStage.backward_maybe_with_nosync`` turns gradient sync off
      for every micro-batch), so it would hide nothing the flat all-reduce does not;
    * the split-backward schedules (:data:`SPLIT_BACKWARD_SCHEDULES`): the weight gradients of a
      stage after the first are computed by ``torch.autograd.grad`` and written to ``.grad`` by
      hand (``stage_backward_weight``), so DDP's gradient hooks never fire for them.
    """
    d = spec.data_parallel_degree
    if d == 1:
        return GradientReduction("none")
    if spec.zero_stage >= 2:
        return GradientReduction("fsdp2", f"ZeRO {spec.zero_stage}: FSDP2 reduce-scatters what it shards")
    if spec.tensor_parallel_degree > 1:
        return GradientReduction(
            "all-reduce",
            f"T = {spec.tensor_parallel_degree}: DDP takes the tensor-parallel DTensor weights only as local shards "
            "swapped in between forwards, which the runtime's optimizer, checkpoints and --check do not expect, and "
            "FSDP2 (HSDP) under torch's pipelining reduces only after the last backward",
        )
    if spec.schedule in SPLIT_BACKWARD_SCHEDULES:
        return GradientReduction(
            "all-reduce",
            f"schedule {spec.schedule} splits the backward: its weight gradients come from torch.autograd.grad, "
            "which DDP's gradient hooks do not see",
        )
    return GradientReduction("ddp")


def reduces_data_gradients(spec: MeshSpec, p: Any) -> bool:
    """True when FSDP2 averages ``p``'s gradient over the data axis itself (ZeRO 2/3, D > 1,
    ``p`` sharded by it): the runtime's all-reduce must then skip it."""
    from torch.distributed.tensor import DTensor

    return spec.zero_stage >= 2 and spec.data_parallel_degree > 1 and isinstance(p, DTensor)


def local_grad(p: Any) -> Any:
    """The gradient tensor of this rank (a DTensor's local shard), for in-place collectives
    such as the tied-weight all-reduce."""
    from torch.distributed.tensor import DTensor

    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


def all_reduce_grad(p: Any, group: Any, *, divide: int = 1) -> None:
    """Sum (then divide) ``p.grad`` over ``group`` in place; a DTensor gradient by its local
    shard, written back (the tied-weight sum between pipeline ranks, the flat data-parallel
    average).  Every rank of ``group`` must hold the same sharding of ``p``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor):
        local = g.to_local().clone()
        dist.all_reduce(local, group=group)
        if divide != 1:
            local /= divide
        p.grad = DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
        return
    dist.all_reduce(g, group=group)
    if divide != 1:
        g /= divide


def squared_grad_norm(params: Iterable[Any], *, skip: set[int] | frozenset[int] = frozenset()) -> float:
    """Sum of squared gradient norms of ``params`` (except ids in ``skip``), DTensor gradients
    counted whole (a collective over their mesh: every rank of it must call this, with the same
    parameters).  Add the pipeline ranks' parts with an all-reduce over "pp"."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0.0
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        g = p.grad.detach()
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        total += float(n) ** 2
    return total
