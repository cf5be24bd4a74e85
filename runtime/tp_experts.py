"""Tensor parallelism (T > 1) on mixture-of-experts blocks, Megatron-LM's expert tensor
parallelism (needs torch).

DTensor has no sharding rule for transformers' grouped products (``grouped_mm``) nor for the
routing's ``histc``, so a block's MoE module (``mlp``: router, routed experts, shared expert)
runs on plain local tensors inside the unit's DTensor graph (:func:`localize`): its nodes (found
by ``nn_module_stack``) read their DTensor inputs as local tensors (activations whole).  Each
expert's FFN is split along its hidden width: the first product(s) (``gate_up_proj``, gate and
up each split: ``_StridedShard``) column-parallel, the last (``down_proj``) row-parallel; a
shared expert's ``gate_proj``/``up_proj`` and ``down_proj`` the same; the router and the shared
expert's gate stay replicated.  The weights stay DTensors over "tp" (``--check``, checkpoints,
FSDP2 and ZeRO see the whole parameter); the graph reads their local shards (``to_local``).

Collectives, combine first and reduce once (:func:`partial_sums` checks the region is linear in
the row products' partial sums: in Mixtral's and Qwen2-MoE's the routing-weight multiply, the
gather back to token order, the sum over each token's ``top_k`` rows, the shared expert's
sigmoid-gate multiply, the sum with the routed output, casts and views; no bias):

* forward: each rank combines its partial sums; the MoE output is reduced once where it leaves
  the region (``sum``: one all-reduce of the block's output size; under sequence parallelism a
  reduce-scatter along the sequence, :func:`sum_partials`);
* backward: that reduction's backward (identity; under sequence parallelism an all-gather); one
  Megatron ``f`` where the experts (routed and shared) start reading the tokens (the movement
  after that point duplicated where the router reads it too, so the router's replicated
  gradient is not summed T times; under sequence parallelism the tokens' all-gather itself,
  whose backward reduce-scatters, :func:`gather_tokens`, the router's side scaling its gradient
  by 1/T, :func:`share_gradient`); an ``f`` on each replicated factor of a partial sum (the
  routing weights, the shared gate: their gradient is a partial sum; ``top_k`` and 1 values a
  token).

A region that is not linear in the partial sums (a bias added after a row product, a non-linear
function of them) falls back to an ``f`` before each column product and a ``g`` (all-reduce,
identity backward) after each row product, the output leaving replicated (under sequence
parallelism sliced).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: column- and row-parallel linears of a shared expert, by name inside the MoE block
SHARED = (("shared_expert", "shared_experts"), ("gate_proj", "up_proj"), ("down_proj",))


def moe_blocks(unit: Any) -> tuple[str, ...]:
    """The MoE modules of a unit (parents of the routed experts: ``model.layers.0.mlp``)."""
    from runtime.experts import find_sites

    sites = find_sites(unit)
    if isinstance(sites, str):
        return ()
    return tuple(sorted({w.rpartition(".")[0].rpartition(".")[0] for s in sites for w in s.weights}))


def _path(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _weight_chain(node: Any) -> tuple[Any, int]:
    """The ``get_attr`` a product's weight comes from and how many transposes lie between."""
    flips = 0
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        flips += "transpose" in str(node.target)
        node = next(a for a in node.args if isinstance(a, torch.fx.Node))
    return node, flips


def layout(unit: Any, blocks: Sequence[str], t: int) -> dict[str, Any] | str:
    """Where :func:`localize` rewrites ``unit``, or why it cannot: ``region`` (the MoE modules'
    nodes), ``column``/``row`` (product nodes), ``shards`` (parameter -> ``(dim, parts)``)."""
    from runtime.experts import find_sites

    inside = tuple(blocks)
    region = [n for n in unit.graph.nodes if n.op in ("call_function", "call_method")
              and any(_path(n) == b or _path(n).startswith(b + ".") for b in inside)]  # fmt: skip
    sites = find_sites(unit)
    if isinstance(sites, str) or not region:
        return sites if isinstance(sites, str) else "its graph has no module paths (nn_module_stack) to find the MoE module by"
    members, shards = set(region), {}
    column: list[Any] = []
    row: list[Any] = []
    for site in sites:
        if len(site.products) < 2 or not set(site.products) <= members:
            return f"its experts' grouped products ({len(site.products)}) are not a first and a last inside {inside}"
        for k, product in enumerate(site.products):
            src, flips = _weight_chain(product.args[1])
            users = list(product.users)
            last = k == len(site.products) - 1
            cut = [u for u in users if "chunk" in str(u.target) or "split" in str(u.target)]
            parts, a = 1, cut[0].args if cut else ()
            if cut and not last:  # gate | up side by side: each rank its share of each
                if len(users) > 1 or "chunk" not in str(cut[0].target) or len(a) != 3 or a[2] not in (-1, 1):
                    return f"the output of grouped product {product.name} is cut other than by one chunk(n, -1)"
                parts = int(a[1])  # type: ignore[arg-type]
            dim = (2 if flips % 2 else 1) if last else (1 if flips % 2 else 2)
            width = unit.get_parameter(str(src.target)).shape[dim]
            if width % (parts * t):
                return f"expert weight {src.target} has a hidden width {width} ({parts} part(s)), not divisible by T={t}"
            shards[str(src.target)] = (dim, parts)
            (row if last else column).append(product)
    params = dict(unit.named_parameters())
    for node in region:
        w: Any = node.args[1] if node.target is torch.ops.aten.linear.default else None
        name = str(w.target)[: -len(".weight")] if getattr(w, "op", None) == "get_attr" else ""
        owner, _, leaf = name.rpartition(".")
        if not any(owner == f"{b}.{s}" for b in inside for s in SHARED[0]) or leaf not in SHARED[1] + SHARED[2]:
            continue
        is_row = leaf in SHARED[2]
        if is_row and f"{name}.bias" in params:
            return f"{name} has a bias, which a row-parallel shared expert would add T times"
        width = params[f"{name}.weight"].shape[1 if is_row else 0]
        if width % t:
            return f"{name} has a hidden width {width}, not divisible by T={t}"
        shards[f"{name}.weight"] = (1, 1) if is_row else (0, 1)
        if not is_row and f"{name}.bias" in params:
            shards[f"{name}.bias"] = (0, 1)
        (row if is_row else column).append(node)
    return {"region": region, "column": column, "row": row, "shards": shards}


#: ops linear in their first argument that only move, cast or add up its elements (the other
#: arguments sizes, dtypes or integer indices): a partial sum in, a partial sum out
_MOVES = frozenset({
    "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "permute", "transpose", "t", "expand",
    "contiguous", "clone", "alias", "to", "_to_copy", "index", "select", "slice", "flatten", "sum", "neg",
    "chunk", "split", "split_with_sizes", "getitem",
})  # fmt: skip
#: products by a second operand: a partial sum times (or over) a replicated factor
_SCALES = frozenset({"mul", "div"})
#: sums of partial sums
_SUMS = frozenset({"add", "sub"})
#: scatter-adds of partial rows into a partial (or all-zero) tensor
_SCATTERS = frozenset({"index_add", "index_add_"})
_ZEROS = frozenset({"zeros", "zeros_like", "new_zeros"})
_ASSERTS = frozenset({"_assert_tensor_metadata"})


def _op(node: Any) -> str:
    """``aten.view.default`` -> ``view``; ``operator.getitem`` -> ``getitem``."""
    target = node.target
    if getattr(target, "__name__", None) == "getitem":
        return "getitem"
    parts = str(target).split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "aten" else str(getattr(target, "__name__", target))


def _is_float(node: Any) -> bool:
    """Whether ``node`` may hold a floating-point tensor (unknown: yes; a size or a tuple: no)."""
    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        return isinstance(node, torch.fx.Node)
    val = node.meta["val"]
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _moved(node: Any) -> Any:
    """The tensor a data-movement node (:data:`_MOVES`) reads, or None for anything else."""
    if node.op != "call_function" or _op(node) not in _MOVES or not node.args:
        return None
    src = node.args[0]
    # its other inputs: sizes, dtypes, integer indices (an input of unknown type, a size helper)
    known = [a.meta["val"] for a in node.all_input_nodes if a is not src and "val" in a.meta]
    if not isinstance(src, torch.fx.Node) or any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in known):
        return None
    return src


def partial_sums(region: Sequence[Any], row: Sequence[Any]) -> dict[str, Any] | str:
    """Everything the row-parallel products' partial sums flow into inside ``region``, if it is
    linear in them (so the sums can be reduced once, where they leave): ``partial`` (the nodes
    holding partial sums), ``factors`` (``(product, factor)``: a replicated factor a partial sum
    is multiplied or divided by, e.g. the routing weights, a shared expert's gate; its gradient
    is a partial sum too).  A string says what is not linear (an added bias or residual, a
    non-linear function, a product of two partial sums)."""
    partial: set[Any] = set(row)
    factors: list[tuple[Any, Any]] = []
    for node in region:  # in graph (topological) order
        mine = [a for a in node.all_input_nodes if a in partial]
        if node in partial or not mine:
            continue
        op = _op(node) if node.op == "call_function" else ""
        tensors = [a for a in node.all_input_nodes if _is_float(a)]
        if op in _ASSERTS:
            continue
        if op in _MOVES and _moved(node) in partial:
            pass
        elif op in _SCALES and len(mine) == 1 and (op == "mul" or node.args[0] in partial):
            factors += [(node, a) for a in tensors if a not in partial]
        elif op in _SUMS and all(a in partial for a in node.args[:2]):
            pass  # (a constant, a bias or a residual added to a partial sum would count T times)
        elif op in _SCATTERS and len(node.args) > 3 and node.args[3] in partial and (
            node.args[0] in partial or (isinstance(node.args[0], torch.fx.Node) and _op(node.args[0]) in _ZEROS)
        ):
            pass
        else:
            what = f"{op or node.op} of " + ", ".join(a.name for a in mine)
            return f"{node.name} ({what}) is not linear in the row-parallel products' partial sums"
        partial.add(node)
    return {"partial": partial, "factors": factors}


def token_feeds(column: Sequence[Any], members: set[Any]) -> tuple[list[Any], list[Any]]:
    """What the column-parallel products read, traced back through data movement
    (:data:`_MOVES`: views, casts, the gather of each expert's tokens) inside the region:
    ``(chain, roots)``, the movement nodes on the way and the tensors they start from (the
    region's entered input: one root, where one ``f`` covers every column product)."""
    chain: list[Any] = []
    roots: list[Any] = []
    stack = [c.args[0] for c in column]
    while stack:
        node = stack.pop()
        if node in chain or node in roots:
            continue
        src = _moved(node) if node in members else None
        if src is None:
            roots.append(node)
        else:
            chain.append(node)
            stack.append(src)
    return chain, roots


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``f``: ``x`` as it is; its gradient (partial sums) all-reduced over ``group``."""
    out: torch.Tensor = _Copy.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's ``g``: the partial sums of ``x`` all-reduced over ``group``; identity backward."""
    out: torch.Tensor = _Reduce.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def sum_partials(x: torch.Tensor, mesh: Any, sequence_dim: int | None) -> Any:
    """The region's output ``x`` (this rank's partial sums) summed over ``mesh`` once, as a
    DTensor: all-reduced (``Replicate``; identity backward), or under sequence parallelism
    reduce-scattered along ``sequence_dim`` (``Shard``; its backward all-gathers)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    d = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    seq = sequence_dim is not None and x.dim() > sequence_dim
    return d.redistribute(mesh, [Shard(sequence_dim) if seq else Replicate()])  # type: ignore[arg-type]


def gather_tokens(x: Any) -> torch.Tensor:
    """A sequence-sharded DTensor ``x`` all-gathered whole (local tensor) for the experts; the
    backward reduce-scatters the gradient (partial sums) back to this rank's slice (Megatron's
    ``g``-bar under sequence parallelism)."""
    from torch.distributed.tensor import Shard

    (place,) = x.placements
    if not isinstance(place, Shard):
        raise ValueError(f"the experts' input under sequence parallelism is {x.placements}, not Shard(sequence) on 'tp'")
    local = x.to_local()
    out: torch.Tensor = _Gather.apply(local, x.device_mesh, place.dim, x.shape, x.stride())  # type: ignore[no-untyped-call]
    return out


def share_gradient(x: torch.Tensor, parts: int) -> torch.Tensor:
    """``x`` as it is; its gradient divided by ``parts`` (a replicated consumer's whole gradient
    entering a reduce-scatter with the experts' partial sums counts once, not ``parts`` times)."""
    out: torch.Tensor = _Share.apply(x, parts)  # type: ignore[no-untyped-call]
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: Any, dim: int, shape: Any, stride: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        ctx.mesh, ctx.dim = mesh, dim
        d = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=stride)
        return d.redistribute(mesh, [Replicate()]).to_local()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        from torch.distributed.tensor import DTensor, Partial, Shard

        d = DTensor.from_local(grad.contiguous(), ctx.mesh, [Partial()], run_check=False)
        return d.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local(), None, None, None, None


class _Share(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, parts: int) -> torch.Tensor:
        ctx.parts = parts
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.parts, None


#: the kinds of :class:`Boundary` node :func:`localize` inserts
KINDS = ("enter", "weight", "exit", "copy", "reduce", "sum", "gather", "share")


class Boundary(nn.Module):
    """One kind of node :func:`localize` inserts (``kind``, one of :data:`KINDS`): ``enter`` (a
    DTensor input as a whole local tensor), ``weight`` (a parameter's local shard), ``exit`` (a
    replicated result as a DTensor), ``copy``/``reduce`` (Megatron's ``f``/``g``), ``sum`` (the
    region's partial sums reduced once: :func:`sum_partials`), ``gather`` (the experts' input
    all-gathered under sequence parallelism, :func:`gather_tokens`), ``share`` (a replicated
    consumer's gradient over T: :func:`share_gradient`)."""

    def __init__(self, kind: str, mesh: Any, sequence_dim: int | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown boundary kind {kind!r} (expected one of {', '.join(KINDS)})")
        self.kind, self.mesh, self.sequence_dim = kind, mesh, sequence_dim

    def forward(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if self.kind in ("copy", "reduce"):
            fn = copy_to_region if self.kind == "copy" else reduce_from_region
            return fn(x, self.mesh.get_group())
        if self.kind == "sum":
            return sum_partials(x, self.mesh, self.sequence_dim if x.is_floating_point() else None)
        if self.kind == "share":
            return share_gradient(x, self.mesh.size())
        if self.kind == "exit":
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return x
            d = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            seq = self.sequence_dim
            if seq is not None and x.is_floating_point() and x.dim() > seq:
                d = d.redistribute(self.mesh, [Shard(seq)])  # a slice; its backward all-gathers
            return d
        if not isinstance(x, DTensor):
            return x
        if self.kind == "gather" and not all(p.is_replicate() for p in x.placements):
            return gather_tokens(x)
        if self.kind in ("enter", "gather") and not all(p.is_replicate() for p in x.placements):
            x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)  # the sequence gathered
        return x.to_local()  # a weight: this rank's shard, its gradient the same placement


def localize(unit: Any, blocks: Sequence[str], mesh: Any, *, sequence_dim: int | None = None) -> str:
    """Rewrite ``unit``'s graph (its parameters already DTensors placed by :func:`layout`'s
    ``shards``) so its MoE modules run on local tensors with Megatron's collectives; returns
    how: ``"combined"`` (the partial sums reduced once where they leave the region, one ``f``
    on the experts' input; the module docstring) or ``"per product"`` (an ``f`` before each
    column product and a ``g`` after each row product: the region is not linear in the row
    products' partial sums, :func:`partial_sums`)."""
    found = layout(unit, blocks, mesh.size())
    if isinstance(found, str):
        from planner.errors import InputError

        raise InputError(f"tensor parallelism on a mixture-of-experts layer: {found}")
    graph, region = unit.graph, found["region"]
    members = set(region)
    mods = {k: f"pipeplan_tp_experts_{k}" for k in KINDS}
    for kind, name in mods.items():
        unit.add_submodule(name, Boundary(kind, mesh, sequence_dim))
    entered: dict[Any, Any] = {}
    for node in region:
        for a in node.all_input_nodes:
            if a in members or ("val" in a.meta and not isinstance(a.meta["val"], torch.Tensor)):
                continue  # sizes (symbolic integers) pass as they are
            if a not in entered:
                with graph.inserting_before(node):
                    entered[a] = graph.call_module(mods["weight" if a.op == "get_attr" else "enter"], (a,))
            node.replace_input_with(a, entered[a])
    sums = partial_sums(region, found["row"])
    combined = not isinstance(sums, str)
    partial = sums["partial"] if not isinstance(sums, str) else set()
    for node in region:
        outside = [u for u in node.users if u not in members]
        if outside:
            with graph.inserting_after(node):
                leave = graph.call_module(mods["sum" if node in partial else "exit"], (node,))
            for u in outside:
                u.replace_input_with(node, leave)
    if isinstance(sums, str):
        _per_product(graph, found, mods)
    else:
        copied: dict[Any, Any] = {}
        for product, factor in sums["factors"]:  # its gradient: partial sums, all-reduced
            if factor not in copied:
                with graph.inserting_before(product):
                    copied[factor] = graph.call_module(mods["copy"], (factor,))
            product.replace_input_with(factor, copied[factor])
        _copy_tokens_once(graph, found["column"], members, mods, set(entered.values()), sequence_dim is not None)
    graph.lint()
    unit.recompile()
    return "combined" if combined else "per product"


def _per_product(graph: Any, found: dict[str, Any], mods: dict[str, str]) -> None:
    """An ``f`` before each column product's input and a ``g`` after each row product."""
    copied: dict[Any, Any] = {}
    for node in found["column"]:
        x = node.args[0]
        if x not in copied:
            with graph.inserting_before(node):
                copied[x] = graph.call_module(mods["copy"], (x,))
        node.replace_input_with(x, copied[x])
    for node in found["row"]:
        with graph.inserting_after(node):
            summed = graph.call_module(mods["reduce"], (node,))
        node.replace_all_uses_with(summed, delete_user_cb=lambda u, s=summed: u is not s)


def _copy_tokens_once(
    graph: Any, column: Sequence[Any], members: set[Any], mods: dict[str, str], entries: set[Any], sp: bool
) -> None:
    """One ``f`` where the column products' inputs start (:func:`token_feeds`), the data
    movement after it duplicated where the router (or anything else replicated) reads it too,
    so the replicated consumers' gradient is not summed T times.  Under sequence parallelism a
    root that is the region's entered input becomes :func:`gather_tokens` (all-gather forward,
    reduce-scatter backward) and its replicated consumers read it through ``share`` instead."""
    chain, roots = token_feeds(column, members)
    feeding = set(chain) | set(column)
    expert: dict[Any, Any] = {}  # what the experts' side reads for a node
    other: dict[Any, Any] = {}  # what everything else (the router) reads for it
    for root in roots:
        if sp and root in entries and root.target == mods["enter"]:
            root.target = mods["gather"]
            with graph.inserting_after(root):
                other[root] = graph.call_module(mods["share"], (root,))
        else:
            with graph.inserting_after(root):
                expert[root] = graph.call_module(mods["copy"], (root,))
        for u in list(root.users):
            if u not in feeding and u not in (expert.get(root), other.get(root)) and root in other:
                u.replace_input_with(root, other[root])
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(chain, key=order.__getitem__):
        if all(u in feeding or _op(u) in _ASSERTS for u in node.users):
            node.args = torch.fx.map_arg(node.args, lambda a: expert.get(a, a))
            node.kwargs = torch.fx.map_arg(node.kwargs, lambda a: expert.get(a, a))
            continue
        # read by the router too: the experts' side gets its own copy of the movement
        with graph.inserting_after(node):
            expert[node] = graph.node_copy(node, lambda a: expert.get(a, a))
        node.args = torch.fx.map_arg(node.args, lambda a: other.get(a, a))
        node.kwargs = torch.fx.map_arg(node.kwargs, lambda a: other.get(a, a))
    for node in column:
        x = node.args[0]
        if x in expert:
            node.update_arg(0, expert[x])
