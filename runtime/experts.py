"""Expert parallelism (the plan's E): each mixture-of-experts layer's routed experts sharded
over E ranks, tokens sent to the rank owning their expert and back by all-to-all (needs torch).

This module applies it: :class:`ExpertParallel` rewrites each site of a stage's units (the
grouped products sharing one per-expert ``offsets``, found by
:func:`runtime.expert_sites.find_sites`):

* the expert weights become ``DTensor`` parameters ``Shard(0)`` over the "ep" mesh (rank r of
  the group keeps experts ``r*L .. r*L+L-1``, ``L = experts / E``); the graph uses their local
  shard (:func:`local_experts`: the gradient comes back as the same ``Shard(0)`` DTensor);
* before the first product, :class:`~runtime.expert_dispatch.Dispatch` sends the tokens to the
  ranks owning their experts; after the last, :class:`~runtime.expert_dispatch.Combine` sends
  them back (the all-to-all collectives: :mod:`runtime.expert_dispatch`).

Ranks: the E ranks of a group are consecutive data-parallel replicas of one stage and
tensor-parallel rank (``replica = g * E + e``); :func:`expert_mesh` makes the DeviceMesh
``("pp", "ep_replicate", "ep", "tp")`` over the plan's ranks.  Expert gradients are reduced
over "ep_replicate" (the D/E replicas holding the same experts) and divided by D
(:meth:`ExpertParallel.reduce_gradients`); every other parameter keeps the data-parallel
all-reduce over all D.  Only public torch APIs are used.

Where each part lives (every name below stays importable from here): finding the sites and
:func:`expert_problems` (why the runtime cannot execute a plan's E) in
:mod:`runtime.expert_sites`; :class:`Dispatch` and :class:`Combine` (and the autograd-aware
``all_to_all`` under them) in :mod:`runtime.expert_dispatch`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.errors import InputError
from runtime.expert_dispatch import Combine, Dispatch
from runtime.expert_sites import Site, expert_problems, find_sites
from runtime.graph_edit import redirect_users

__all__ = [
    "Combine",
    "Dispatch",
    "ExpertParallel",
    "Site",
    "expert_mesh",
    "expert_problems",
    "find_sites",
    "local_experts",
]


def local_experts(w: Any) -> Any:
    """The expert shard this rank holds of a ``Shard(0)`` DTensor weight (called from the graph)."""
    return w.to_local() if hasattr(w, "to_local") else w


def expert_mesh(plan: Any, *, device_type: str = "cpu") -> Any:
    """The DeviceMesh ``("pp", "ep_replicate", "ep", "tp")`` over the plan's ranks
    (``rank = (k * D + d) * T + t`` with ``d = g * E + e``); every rank must call it."""
    from torch.distributed.device_mesh import DeviceMesh

    k, d, t, e = (plan.pipeline_degree, plan.data_parallel_degree, plan.tensor_parallel_degree,
                  plan.expert_parallel_degree)  # fmt: skip
    layout = torch.arange(k * d * t).view(k, d // e, e, t)
    return DeviceMesh(device_type, layout, mesh_dim_names=("pp", "ep_replicate", "ep", "tp"))


class ExpertParallel:
    """The plan's E on this rank: :meth:`apply` rewrites a stage's units, :meth:`reduce_gradients`
    reduces the expert gradients; :meth:`owns` tells the data-parallel all-reduce what to skip."""

    def __init__(self, plan: Any, *, device_type: str = "cpu", fault_from: tuple[list[int], int] | None = None) -> None:
        mesh = expert_mesh(plan, device_type=device_type)
        self.ep_mesh, self.replicate_group = mesh["ep"], mesh["ep_replicate"].get_group()
        self.replicas = plan.data_parallel_degree // plan.expert_parallel_degree
        self.data_parallel = plan.data_parallel_degree
        self.fault_from = fault_from
        self.params: list[nn.Parameter] = []
        self.sites: list[tuple[int, int]] = []  # (experts on this rank, experts) per layer rewritten

    def apply(self, stage_module: Any) -> list[int]:
        """Shard the experts of every site in ``stage_module.units``; the unit indices changed."""
        changed = []
        for i, unit in enumerate(stage_module.units):
            sites = find_sites(unit)
            if isinstance(sites, str):
                raise InputError(f"unit {i}: {sites}")  # expert_problems refused it before training
            for j, site in enumerate(sites):
                self._rewrite(unit, site, j)
            if sites:
                unit.graph.lint()
                unit.recompile()
                changed.append(i)
        return changed

    def _rewrite(self, unit: fx.GraphModule, site: Site, j: int) -> None:
        local = site.experts // self.ep_mesh.size()
        self.sites.append((local, site.experts))
        self._shard_weights(unit, site, local)
        self._route_tokens(unit, site, j)

    def _shard_weights(self, unit: fx.GraphModule, site: Site, local: int) -> None:
        """Each expert weight of ``site`` becomes this rank's ``Shard(0)`` DTensor of ``local``
        experts, which the graph reads through :func:`local_experts`."""
        from torch.distributed.tensor import DTensor, Shard

        r = self.ep_mesh.get_local_rank()
        for name, node in site.weights.items():
            owner, _, pname = name.rpartition(".")
            mod = unit.get_submodule(owner)
            full = mod.get_parameter(pname) if isinstance(mod, nn.Module) else None
            if full is None or isinstance(full, DTensor):
                continue  # shared by two sites of one unit: sharded once
            shard = DTensor.from_local(full.detach()[r * local : (r + 1) * local].clone(), self.ep_mesh, [Shard(0)],
                                       run_check=False)  # fmt: skip
            param = nn.Parameter(shard, requires_grad=full.requires_grad)
            mod.register_parameter(pname, param)
            self.params.append(param)
            with unit.graph.inserting_after(node):
                shard_node = unit.graph.call_function(local_experts, (node,))
            redirect_users(node, shard_node)

    def _route_tokens(self, unit: fx.GraphModule, site: Site, j: int) -> None:
        """:class:`Dispatch` before the site's first product (which then runs on the received
        tokens, every product on the local offsets), :class:`Combine` after its last."""
        group = self.ep_mesh.get_group()
        dispatch, combine = f"pipeplan_ep_dispatch_{j}", f"pipeplan_ep_combine_{j}"
        unit.add_submodule(dispatch, Dispatch(group, experts=site.experts, fault_from=self.fault_from))
        unit.add_submodule(combine, Combine(group))
        first, last = site.products[0], site.products[-1]
        graph = unit.graph
        with graph.inserting_before(first):
            routed = graph.call_module(dispatch, (first.args[0], site.offsets))
            parts = [graph.call_function(operator.getitem, (routed, k)) for k in range(5)]
        first.args = (parts[0], *first.args[1:])
        for product in site.products:
            product.args = (*product.args[:2], parts[1], *product.args[3:])
        with graph.inserting_after(last):
            back = graph.call_module(combine, (last, parts[2], parts[3], parts[4]))
        redirect_users(last, back)

    def owns(self, p: Any) -> bool:
        return any(p is q for q in self.params)

    def reduce_gradients(self) -> None:
        """Expert gradients: summed over the D/E replicas holding the same experts, divided by D
        (each already holds the sum over the tokens of its E-group, by the all-to-all's backward)."""
        from runtime.mesh import all_reduce_grad

        for p in self.params:
            if p.grad is None:
                continue
            if self.replicas > 1:
                all_reduce_grad(p, self.replicate_group, divide=self.data_parallel)
            else:
                p.grad.div_(self.data_parallel)
