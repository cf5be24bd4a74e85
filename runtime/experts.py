"""Expert parallelism (the plan's E): each mixture-of-experts layer's routed experts sharded
over E ranks, tokens sent to the rank owning their expert and back by all-to-all (needs torch).

The splitter's units are flattened aten graphs, so a mixture-of-experts layer is found in the
graph, not as a module: Hugging Face's fused experts (``Mixtral``, ``Qwen2-MoE`` and every
``@use_experts_implementation`` class of transformers 5) run as grouped matrix products
(``grouped_mm``) of the tokens sorted by expert, with the per-expert ``offsets``
(cumulative token counts) and 3-D expert weights ``[experts, out, in]``.  A *site* is the
grouped products sharing one ``offsets``.  :func:`apply_expert_parallel` rewrites each site:

* the expert weights become ``DTensor`` parameters ``Shard(0)`` over the "ep" mesh (rank r of
  the group keeps experts ``r*L .. r*L+L-1``, ``L = experts / E``); the graph uses their local
  shard (``to_local``: the gradient comes back as the same ``Shard(0)`` DTensor);
* before the first product, :class:`Dispatch`: the per-expert counts are exchanged
  (``all_to_all_single`` of integers), then the sorted tokens themselves (autograd-aware
  :class:`_AllToAll`: its backward is the reverse all-to-all), and what arrived is regrouped
  expert-major with the local offsets;
* after the last product, :class:`Combine`: the inverse regrouping and the reverse all-to-all,
  so the layer goes on (routing weights, un-sorting, shared experts) on its own tokens.

Ranks: the E ranks of a group are consecutive data-parallel replicas of one stage and
tensor-parallel rank (``replica = g * E + e``); :func:`expert_mesh` makes the DeviceMesh
``("pp", "ep_replicate", "ep", "tp")`` over the plan's ranks.  Expert gradients are reduced
over "ep_replicate" (the D/E replicas holding the same experts) and divided by D
(:meth:`ExpertParallel.reduce_gradients`); every other parameter keeps the data-parallel
all-reduce over all D.  gloo runs ``all_to_all_single`` on CPU (torch 2.13), so no fallback is
needed.  Only public torch APIs are used.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor, nn

from planner.errors import InputError


@dataclass
class Site:
    """One mixture-of-experts layer inside a unit's graph."""

    offsets: fx.Node
    products: list[fx.Node]  # grouped_mm nodes, in graph order
    weights: dict[str, fx.Node] = field(default_factory=dict)  # parameter name -> get_attr node
    experts: int = 0


def _is_grouped_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and "grouped_mm" in str(node.target)


def _weight_source(node: Any) -> fx.Node | None:
    """The ``get_attr`` a grouped product's weight argument comes from through single-input
    ops (transpose, dtype casts), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return node if isinstance(node, fx.Node) and node.op == "get_attr" else None


def find_sites(unit: fx.GraphModule) -> list[Site] | str:
    """The mixture-of-experts sites of ``unit``, or why the runtime cannot shard its experts."""
    sites: dict[fx.Node, Site] = {}
    for node in unit.graph.nodes:
        if not _is_grouped_mm(node):
            continue
        if len(node.args) < 3 or not isinstance(node.args[2], fx.Node):
            return f"grouped product {node.name} has no per-expert offsets argument"
        src = _weight_source(node.args[1])
        if src is None:
            return f"the weight of grouped product {node.name} is not a parameter of the layer"
        param = unit.get_parameter(str(src.target))
        site = sites.setdefault(node.args[2], Site(node.args[2], []))
        if param.dim() != 3 or (site.experts and param.shape[0] != site.experts):
            return f"expert weight {src.target} has shape {tuple(param.shape)}, not [experts, out, in]"
        site.experts = int(param.shape[0])
        site.products.append(node)
        site.weights[str(src.target)] = src
    return list(sites.values())


def _three_d_expert_params(unit: nn.Module) -> list[str]:
    return [n for n, p in unit.named_parameters() if p.dim() == 3 and "expert" in n]


def expert_problems(units: Sequence[Any], layer_names: Sequence[str], plan: Any) -> list[str]:
    """Why the runtime cannot execute the plan's E (empty when it can, or E = 1), each naming
    the layer or the axis, torch-side facts only (the graphs)."""
    e = plan.expert_parallel_degree
    if e <= 1:
        return []
    problems: list[str] = []
    if plan.tensor_parallel_degree > 1:
        moe = [f"layer {i} '{layer_names[i]}'" for i, u in enumerate(units) if find_sites(u)]
        problems.append(f"expert parallelism (E={e}) with tensor parallelism (T={plan.tensor_parallel_degree})"
                        f"{' on ' + ', '.join(moe) if moe else ''}: the runtime shards a layer's experts over "
                        "data-parallel ranks (E) or along their hidden width (T, runtime/tp_experts.py), not both "
                        "(replan with --tensor-parallel 1 or --expert-parallel 1)")
    if plan.context_parallel_degree > 1:
        problems.append(f"expert parallelism (E={e}) with context parallelism (C={plan.context_parallel_degree}): "
                        "the runtime draws the E ranks from D only (replan with --context-parallel 1)")
    if plan.zero_stage > 0:
        problems.append(f"expert parallelism (E={e}) with ZeRO {plan.zero_stage}: the runtime's ZeRO would "
                        "shard or broadcast the expert shards over ranks holding other experts (replan with --zero 0)")
    if plan.data_parallel_degree % e:
        problems.append(f"expert parallelism (E={e}) does not divide the data-parallel degree "
                        f"D={plan.data_parallel_degree} (replan with an E dividing D)")
    found = 0
    for i, unit in enumerate(units):
        sites = find_sites(unit)
        name = layer_names[i]
        if isinstance(sites, str):
            problems.append(f"layer {i} '{name}': expert parallelism (E={e}): {sites}")
            continue
        if not sites and _three_d_expert_params(unit):
            problems.append(f"layer {i} '{name}': expert parallelism (E={e}): its experts "
                            f"({', '.join(_three_d_expert_params(unit))}) do not run as grouped products the "
                            "runtime recognises (transformers' fused experts); replan with --expert-parallel 1")
        for site in sites:
            found += 1
            if site.experts % e:
                problems.append(f"layer {i} '{name}': {site.experts} experts are not divisible by E={e} "
                                "(replan with an E dividing the expert count)")
    if found == 0 and layer_names:
        problems.append(f"expert parallelism (E={e}): no layer of this model is a mixture-of-experts layer the "
                        f"runtime recognises (layers {layer_names[0]!r}..{layer_names[-1]!r}); replan with "
                        "--expert-parallel 1")
    return problems


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x``; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """Autograd-aware ``all_to_all_single`` of ``x``'s rows over ``group``."""
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, group)  # type: ignore[no-untyped-call]
    return out


class Dispatch(nn.Module):
    """Send each token (sorted by expert) to the rank owning its expert; returns the received
    tokens grouped by local expert, the local offsets, and the routing for :class:`Combine`."""

    def __init__(self, group: Any, *, experts: int, fault_from: tuple[list[int], int] | None = None) -> None:
        super().__init__()
        self.group, self.experts = group, experts
        # --inject-fault R:S:wrong-expert: (the runtime's step box, S)
        self.fault_from = fault_from

    def forward(self, x: Tensor, offsets: Tensor) -> tuple[Any, ...]:
        e = dist.get_world_size(self.group)
        local = self.experts // e
        offs = offsets.long()
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        if self.fault_from is not None and self.fault_from[0][0] >= self.fault_from[1]:
            # a wrong implementation for tests: each block of tokens goes to the next rank's experts
            chunks = torch.split(x, counts.view(e, local).sum(1).tolist())
            x = torch.cat([*chunks[-1:], *chunks[:-1]])
            counts = counts.view(e, local).roll(1, 0).flatten()
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # src j's counts for my experts
        matrix = received.view(e, local)
        send = counts.view(e, local).sum(1).tolist()
        recv = matrix.sum(1).tolist()
        rows = all_to_all(x, recv, send, self.group)
        # rows arrive source-major (src, local expert); the products want them expert-major
        key = (torch.arange(local).repeat(e) * e + torch.arange(e).repeat_interleave(local)).to(offs.device)
        order = torch.argsort(key.repeat_interleave(matrix.flatten()), stable=True)
        local_offsets = torch.cumsum(matrix.sum(0), 0).to(offsets.dtype)
        return rows[order], local_offsets, order, send, recv


class Combine(nn.Module):
    """Undo :class:`Dispatch`: back to source-major order, and each row to the rank it came from."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, y: Tensor, order: Tensor, send: list[int], recv: list[int]) -> Tensor:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all(y[inverse], send, recv, self.group)


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
        from torch.distributed.tensor import DTensor, Shard

        group = self.ep_mesh.get_group()
        e, r = self.ep_mesh.size(), self.ep_mesh.get_local_rank()
        local = site.experts // e
        self.sites.append((local, site.experts))
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
            node.replace_all_uses_with(shard_node, delete_user_cb=_all_but(shard_node))
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
        last.replace_all_uses_with(back, delete_user_cb=_all_but(back))

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


def _all_but(node: fx.Node) -> Any:
    """``replace_all_uses_with``'s filter: every user but ``node`` itself (which reads the old value)."""
    return lambda user: user is not node

