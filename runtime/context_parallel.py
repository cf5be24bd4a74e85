"""Context parallelism (the plan's C): each rank holds 1/C of every sequence, attention
all-gathers K and V over the context-parallel group (Llama 3's scheme; needs torch).

``torch.distributed.tensor.experimental.context_parallel`` does not run here: tried on 2 gloo
ranks with torch 2.13.0 (CPU), its SDPA under the context manager raises ``NotImplementedError:
Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered`` (it shards SDPA's flash and efficient CUDA kernels only); and it patches
``F.scaled_dot_product_attention``, which the splitter's aten graphs no longer call.  So the
runtime rewrites the graphs:

* **Sequence split, causal load balancing** (as Megatron-LM and torch do): the sequence is cut
  into 2C chunks and context-parallel rank c holds chunks c and 2C-1-c, so every rank has the
  same share of the causal triangle.  :func:`local_sequence` cuts the inputs (every input whose
  dimension 1 is the sequence length); the worker splits the model on examples of s/C tokens, so
  the graphs' shapes are the local ones.
* **Positions**: every ``arange`` of s/C elements in a unit (the position ids of learned or
  rotary position embeddings) becomes this rank's global positions (:class:`Positions`).
* **Attention**: each ``softmax(mask_fill(q @ k^T * scale)) @ v`` (the zoo GPT) and each
  ``scaled_dot_product_attention`` (Hugging Face decoders) gets its K and V all-gathered along
  the sequence (:class:`GatherSequence`, autograd-aware: the backward all-reduces the gradient
  and keeps this rank's rows; gloo has no reduce-scatter) and the causal mask of the global
  positions, queries on this rank against keys of all ranks (:class:`CausalMask`).  A mask
  present in the graph is taken for the causal one (no padding masks).

Every other operation is assumed to act position by position (norms, MLPs, the LM loss), which
holds for decoder LMs; the gradients of every parameter are averaged over the D x C ranks like
data parallelism (the mesh folds C into the data axis, ``runtime.mesh.MeshSpec``).  Dropout
draws other masks than the unsplit model's (its streams are per rank). Only public torch APIs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor, nn

from planner.errors import InputError


def sequence_length(example_inputs: Sequence[Any]) -> int:
    """The sequence length s: dimension 1 of the first input (token ids ``[batch, seq]``)."""
    first = example_inputs[0] if example_inputs else None
    if not isinstance(first, Tensor) or first.dim() < 2:
        shape = tuple(first.shape) if isinstance(first, Tensor) else type(first).__name__
        raise InputError(f"context parallelism needs the model's first input shaped [batch, sequence, ...]; it is "
                         f"{shape}: replan with --context-parallel 1")  # fmt: skip
    return int(first.shape[1])


def chunks_of(rank: int, degree: int) -> tuple[int, int]:
    """The two of the 2C sequence chunks context-parallel ``rank`` holds: c and 2C-1-c."""
    return rank, 2 * degree - 1 - rank


def local_positions(seq: int, rank: int, degree: int) -> Tensor:
    """Global positions of the tokens context-parallel ``rank`` holds, in its order."""
    size = seq // (2 * degree)
    return torch.cat([torch.arange(i * size, (i + 1) * size) for i in chunks_of(rank, degree)])


def local_sequence(t: Any, seq: int, rank: int, degree: int) -> Any:
    """``t``'s tokens on context-parallel ``rank`` when its dimension 1 is the sequence, else ``t``."""
    if not isinstance(t, Tensor) or t.dim() < 2 or t.shape[1] != seq:
        return t
    return t.index_select(1, local_positions(seq, rank, degree).to(t.device))


def check_sequence(seq: int, degree: int) -> None:
    if seq % (2 * degree):
        raise InputError(f"context parallelism C={degree}: the sequence length {seq} is not divisible by 2C = "
                         f"{2 * degree} (each rank holds two chunks, for causal balance): replan with a "
                         "--context-parallel C such that 2C divides it")  # fmt: skip


class GatherSequence(torch.autograd.Function):
    """All-gather along dimension -2 over ``group``; backward: all-reduce the gradient (gloo has
    no reduce-scatter) and keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.shape[-2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        whole = grad.contiguous().clone()
        dist.all_reduce(whole, group=ctx.group)
        return whole.narrow(-2, ctx.rank * ctx.rows, ctx.rows), None


class Gather(nn.Module):
    """K or V of every context-parallel rank, along the sequence (dimension -2)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = GatherSequence.apply(x, self.group)  # type: ignore[no-untyped-call]
        return out


class CausalMask(nn.Module):
    """``[queries, keys]`` boolean mask of the gathered keys each local query must not see (True:
    masked), or with ``allowed=True`` of those it may see (SDPA's convention).  Under the
    no-kv-gather fault (``skip()`` true) the keys of the other ranks are masked as well: the
    attention a forgotten gather computes, with every rank's collectives still in step."""

    def __init__(self, queries: Tensor, keys: Tensor, mine: Tensor, skip: Any, *, allowed: bool = False) -> None:
        super().__init__()
        self.queries, self.keys, self.mine, self.skip, self.allowed = queries, keys, mine, skip, allowed

    def forward(self, like: Tensor) -> Tensor:
        masked = self.keys.to(like.device)[None, :] > self.queries.to(like.device)[:, None]
        if self.skip():
            masked = masked | ~self.mine.to(like.device)[None, :]
        return ~masked if self.allowed else masked


class Positions(nn.Module):
    """This rank's global positions, shaped and typed like the ``arange`` they replace."""

    def __init__(self, positions: Tensor) -> None:
        super().__init__()
        self.positions = positions

    def forward(self, like: Tensor) -> Tensor:
        return self.positions.to(device=like.device, dtype=like.dtype)


def _op(node: Any, *names: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and any(f"aten.{n}." in str(node.target) for n in names)


def _scaled_scores(node: Any) -> Any:
    while _op(node, "mul", "div") and not isinstance(node.args[1], fx.Node):
        node = node.args[0]
    return node


def attention_sites(unit: fx.GraphModule) -> list[tuple[str, tuple[fx.Node, ...]]]:
    """The attentions of ``unit``'s graph: ``("sdpa", (node,))`` for each
    ``scaled_dot_product_attention``; ``("math", (fill or None, transpose of k, matmul with v))``
    for each ``softmax([mask_fill](q @ k^T [* scale])) [dropout] @ v``."""
    sites: list[tuple[str, tuple[Any, ...]]] = []
    for node in unit.graph.nodes:
        if _op(node, "scaled_dot_product_attention"):
            sites.append(("sdpa", (node,)))
            continue
        if not _op(node, "softmax", "_softmax"):
            continue
        fill = node.args[0] if _op(node.args[0], "masked_fill") else None
        scores = _scaled_scores(fill.args[0] if fill is not None else node.args[0])
        if not _op(scores, "matmul") or not _op(scores.args[1], "transpose"):
            continue
        probs = node
        while len(probs.users) == 1 and _op(next(iter(probs.users)), "dropout", "_to_copy", "to"):
            probs = next(iter(probs.users))
        outs = [u for u in probs.users if _op(u, "matmul") and u.args[0] is probs]
        if len(outs) == 1 and len(probs.users) == 1:
            sites.append(("math", (fill, scores.args[1], outs[0])))
    return sites


def _arange_length(node: fx.Node) -> int | None:
    if not _op(node, "arange"):
        return None
    ints = [a for a in node.args if isinstance(a, int)]
    if len(ints) != len(node.args) or not ints:
        return None
    if len(ints) == 1:
        return ints[0]
    step = ints[2] if len(ints) > 2 else 1
    return (ints[1] - ints[0]) // step if step > 0 else None


#: ops through which an arange's values stay position ids (offset, reshaped, cast)
_CARRIES_POSITIONS = ("add", "unsqueeze", "expand", "view", "reshape", "slice", "to", "_to_copy", "clone",
                      "contiguous", "alias")  # fmt: skip


def _is_position(node: fx.Node) -> bool:
    """True when an ``arange``'s values reach a position embedding's indices or leave the unit
    (position ids for rotary embeddings) through ops that carry its values (:data:`_CARRIES_POSITIONS`);
    mask building, which the rewritten attention replaces, indexes local arrays with such aranges
    or compares them, and those stay local."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output" or (_op(user, "embedding") and user.args[1] is n):
                return True
            if user in seen or not _op(user, *_CARRIES_POSITIONS):
                continue
            seen.add(user)
            todo.append(user)
    return False


def context_problems(units: Sequence[Any], layer_names: Sequence[str], plan: Any) -> list[str]:
    """Why the runtime cannot execute the plan's C (empty when it can, or C = 1), naming the axis
    or the layer, with the fix."""
    c = plan.context_parallel_degree
    if c <= 1:
        return []
    problems = []
    if plan.tensor_parallel_degree > 1:
        problems.append(f"context parallelism (C={c}) with tensor parallelism (T={plan.tensor_parallel_degree}): "
                        "the runtime executes C with T = 1 only (replan with --tensor-parallel 1)")
    if plan.zero_stage > 0:
        problems.append(f"context parallelism (C={c}) with ZeRO {plan.zero_stage}: the runtime executes C with ZeRO "
                        "0 only (replan with --zero 0)")
    if not any(attention_sites(u) for u in units) and layer_names:
        problems.append(f"context parallelism (C={c}): no layer of this model has an attention the runtime "
                        "recognises (scaled_dot_product_attention, or softmax(q @ k^T) @ v) "
                        f"(layers {layer_names[0]!r}..{layer_names[-1]!r}); replan with --context-parallel 1")
    return problems


class ContextParallel:
    """The plan's C on this rank: :meth:`apply` rewrites a stage's units (positions, attention);
    :meth:`local` cuts a batch's sequences.  ``replica``: the rank's index on the folded data axis
    (d * C + c)."""

    def __init__(self, plan: Any, *, replica: int, seq: int, device_type: str = "cpu",
                 fault_from: tuple[list[int], int] | None = None) -> None:  # fmt: skip
        from torch.distributed.device_mesh import DeviceMesh

        k, d, c, t = (plan.pipeline_degree, plan.data_parallel_degree, plan.context_parallel_degree,
                      plan.tensor_parallel_degree)  # fmt: skip
        check_sequence(seq, c)
        mesh = DeviceMesh(device_type, torch.arange(k * d * c * t).view(k, d, c, t), mesh_dim_names=("pp", "dp", "cp", "tp"))
        self.group, self.degree, self.rank, self.seq = mesh["cp"].get_group(), c, replica % c, seq
        self.queries = local_positions(seq, self.rank, c)
        self.keys = torch.cat([local_positions(seq, j, c) for j in range(c)])
        self.mine = torch.arange(self.keys.numel()) // (seq // c) == self.rank  # the gathered keys this rank holds
        self.fault_from = fault_from
        self.layers: list[str] = []

    def skip_gather(self) -> bool:
        """``--inject-fault R:S:no-kv-gather``: from step S on, attend to this rank's K and V only."""
        return self.fault_from is not None and self.fault_from[0][0] >= self.fault_from[1]

    def local(self, t: Any) -> Any:
        return local_sequence(t, self.seq, self.rank, self.degree)

    def apply(self, stage_module: Any) -> None:
        for i, unit in enumerate(stage_module.units):
            changed = self._positions(unit)
            for j, (kind, nodes) in enumerate(attention_sites(unit)):
                self._attention(unit, kind, nodes, j)
                self.layers.append(str(stage_module.names[i]) if hasattr(stage_module, "names") else str(i))
                changed = True
            if changed:
                unit.graph.lint()
                unit.recompile()

    def _positions(self, unit: fx.GraphModule) -> bool:
        nodes = [n for n in unit.graph.nodes if _arange_length(n) == self.seq // self.degree and _is_position(n)]
        for j, node in enumerate(nodes):
            name = f"pipeplan_cp_positions_{j}"
            unit.add_submodule(name, Positions(self.queries))
            with unit.graph.inserting_after(node):
                pos = unit.graph.call_module(name, (node,))
            node.replace_all_uses_with(pos, delete_user_cb=_all_but(pos))
        return bool(nodes)

    def _attention(self, unit: fx.GraphModule, kind: str, nodes: tuple[Any, ...], j: int) -> None:
        graph = unit.graph
        gather, mask = f"pipeplan_cp_gather_{j}", f"pipeplan_cp_mask_{j}"
        unit.add_submodule(gather, Gather(self.group))
        if kind == "sdpa":
            (node,) = nodes
            q, k, v = node.args[:3]
            causal = (len(node.args) > 3 and node.args[3] is not None) or bool(node.kwargs.get("is_causal"))
            causal = causal or (len(node.args) > 5 and bool(node.args[5]))
            with graph.inserting_before(node):
                gk, gv = graph.call_module(gather, (k,)), graph.call_module(gather, (v,))
                allowed = None
                if causal:
                    unit.add_submodule(mask, CausalMask(self.queries, self.keys, self.mine, self.skip_gather, allowed=True))
                    allowed = graph.call_module(mask, (q,))
            rest = tuple(node.args[4:5])  # dropout_p; is_causal is replaced by the mask
            node.args = (q, gk, gv, allowed, *rest)
            node.kwargs = {key: val for key, val in node.kwargs.items() if key != "is_causal"}
            return
        fill, k_t, out = nodes
        with graph.inserting_before(k_t):
            gk = graph.call_module(gather, (k_t.args[0],))
        k_t.args = (gk, *k_t.args[1:])
        with graph.inserting_before(out):
            gv = graph.call_module(gather, (out.args[1],))
        out.args = (out.args[0], gv, *out.args[2:])
        if fill is not None:
            unit.add_submodule(mask, CausalMask(self.queries, self.keys, self.mine, self.skip_gather))
            with graph.inserting_before(fill):
                masked = graph.call_module(mask, (fill.args[0],))
            fill.args = (fill.args[0], masked, *fill.args[2:])


def _all_but(node: fx.Node) -> Any:
    return lambda user: user is not node
