"""ZeRO on the data axis (part of :mod:`runtime.mesh`): ZeRO 2 and 3 are FSDP2's
``fully_shard`` of each layer, then of the stage (:func:`apply_data_sharding`); ZeRO 1 is the
optimizer (:func:`make_sharded_optimizer`: ``ZeroRedundancyOptimizer``, or
:class:`DTensorZeroOptimizer` for tensor-parallel parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from runtime.mesh_spec import MeshSpec


def apply_data_sharding(
    module: Any, spec: MeshSpec, dp_mesh: Any, *, units: Iterable[Any] = (), keep_whole: Iterable[Any] = ()
) -> Any:
    """FSDP2 ``fully_shard`` over ``dp_mesh`` (ZeRO 2 and 3) of each of the stage's ``units``
    (its layers) that holds a parameter, then of the whole stage ``module`` (what is left), as
    torchtitan shards each transformer block: a layer's parameters are gathered just before it
    runs and, under ZeRO 3, freed after it, so a device holds about two layers' gathered
    parameters (the running one and the prefetched next), as the cost model prices it, and each
    layer's collectives are its own.  Parameters in ``keep_whole`` stay plain tensors, averaged
    by the runtime's all-reduce: the tied weights whose copies sit on several pipeline ranks
    (under FSDP2 their gradients came out wrong in 1F1B with K = 2, measured: 1e-2 off after
    one step).  A layer sharing a weight with another layer of the stage stays in the stage's
    group."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(keep_whole)
    reshard = spec.reshard_after_forward()
    units = list(units)
    holders: dict[int, int] = {}
    for unit in units:
        for p in unit.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    for unit in units:
        own = [p for p in unit.parameters() if p not in ignored]
        # a layer sharing a weight with another layer of the stage (a tied embedding and head
        # on one rank) is left to the stage's group, which holds the weight once
        if own and all(holders[id(p)] == 1 for p in own):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    return fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)


def make_sharded_optimizer(
    name: str, params: Iterable[Any], *, lr: float, spec: MeshSpec, mesh: Any, fused: bool = False
) -> Any:
    """The optimizer for ``spec``: ZeRO 1 (D > 1): each replica keeps the state of its share of
    the parameters and broadcasts its updated share over "dp_replicate" --
    ``ZeroRedundancyOptimizer`` for plain parameters, :class:`DTensorZeroOptimizer` when some
    are tensor-parallel DTensors (T > 1); otherwise :func:`runtime.training.make_optimizer`.
    ``fused``: the kernels (:func:`runtime.training.optimizer_class`)."""
    from runtime.training import make_optimizer, optimizer_class

    plist = list(params)
    if spec.zero_stage != 1 or spec.data_parallel_degree == 1:
        return make_optimizer(name, plist, lr=lr, fused=fused)
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in plist):
        return DTensorZeroOptimizer(name, plist, lr=lr, group=mesh["dp_replicate"].get_group(), fused=fused)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, extra = optimizer_class(name, fused=fused)
    return ZeroRedundancyOptimizer(
        plist, optimizer_class=cls, process_group=mesh["dp_replicate"].get_group(), lr=lr, **extra
    )


def _local(t: Any) -> Any:
    """The tensor this rank holds of ``t`` (a DTensor's local shard, sharing its storage)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class DTensorZeroOptimizer:
    """ZeRO 1 over the replicas ``group`` for parameters that may be tensor-parallel DTensors
    (``ZeroRedundancyOptimizer`` broadcasts ``param.data``, which a DTensor is not).

    Each parameter has one owner replica (greedy by this rank's element count, largest first;
    every replica of a tensor-parallel rank holds the same shards, so all agree); a replica keeps
    optimizer state (``optim``: the ordinary optimizer over its share, whole DTensors) for its
    share only, steps it, and broadcasts each updated shard from its owner.  Gradients stay
    whole (averaged by the runtime's all-reduce, as ZeRO 1 does).  The optimizers here are
    elementwise, so stepping a shard is stepping that part of the parameter."""

    def __init__(self, name: str, params: Sequence[Any], *, lr: float, group: Any, fused: bool = False) -> None:
        import torch
        import torch.distributed as dist

        from runtime.training import make_optimizer

        self.params = list(params)
        self.group = group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        load = [0] * size
        self.owner = [0] * len(self.params)
        for i in sorted(range(len(self.params)), key=lambda i: -_local(self.params[i]).numel()):
            r = min(range(size), key=lambda r: load[r])
            self.owner[i] = r
            load[r] += _local(self.params[i]).numel()
        self.sources = [dist.get_global_rank(group, r) for r in range(size)]
        self.mine = [p for p, r in zip(self.params, self.owner, strict=True) if r == me]
        # a replica with no share still needs param_groups (the runtime sets the learning rate)
        self.optim = make_optimizer(name, self.mine or [torch.zeros(0, requires_grad=True)], lr=lr, fused=fused)
        self.param_groups = self.optim.param_groups

    def step(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for p in self.mine:  # a gradient left as partial sums: sum it first (elementwise updates need it whole)
            g = p.grad
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)
        self.optim.step()
        with torch.no_grad():
            works = [
                dist.broadcast(_local(p), src=self.sources[r], group=self.group, async_op=True)
                for p, r in zip(self.params, self.owner, strict=True)
            ]
            for w in works:
                w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
